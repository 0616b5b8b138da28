#include "zero/parameter_tier.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <chrono>

#include "common/check.h"

namespace zt {

ParameterTier::ParameterTier(const FlatLayout& layout, TieredArray& partition, const std::vector<SubGroup>& groups,
                             io::AioEngine* io, int buffer_count, std::optional<Crossing> crossing)
    : layout_(layout), partition_(partition), groups_(groups), io_(io), crossing_(crossing) {
  int blocks = 0;
  for (const BucketLayout& b : layout.buckets) blocks = std::max(blocks, b.group + 1);
  block_groups_.resize(size_t(blocks));
  block_on_disk_.assign(size_t(blocks), false);
  block_of_bucket_.resize(layout.buckets.size());
  for (size_t b = 0; b < layout.buckets.size(); ++b) block_of_bucket_[b] = layout.buckets[b].group;
  group_offset_in_block_.assign(groups.size(), 0);
  if (crossing_) {
    // A block's shards lie side by side in its slot, bucket after bucket.
    slot_offset_.assign(layout.buckets.size(), 0);
    std::vector<int64_t> block_numel(size_t(blocks), 0);
    for (size_t b = 0; b < layout.buckets.size(); ++b) {
      const int block = layout.buckets[b].group;
      if (block < 0) continue;
      slot_offset_[b] = block_numel[size_t(block)];
      block_numel[size_t(block)] += layout.buckets[b].shard_numel;
    }
    const int64_t largest = blocks > 0 ? *std::max_element(block_numel.begin(), block_numel.end()) : 0;
    const auto options = torch::TensorOptions().dtype(partition.dtype()).device(crossing_->compute);
    slots_.resize(size_t(std::max(2, crossing_->slots)));
    for (Slot& slot : slots_) slot.data = torch::empty({largest}, options);
    if (!crossing_->compute.is_cpu()) {
      c10::impl::VirtualGuardImpl impl(crossing_->compute.type());
      copy_stream_ = impl.getStreamFromGlobalPool(crossing_->compute, /*isHighPriority=*/false);
    }
  }
  if (!partition.any_on_disk()) return;
  // Sub-groups never straddle a bucket shard, so each lies in exactly one bucket.
  size_t g = 0;
  std::vector<int64_t> block_bytes(size_t(blocks), 0);
  for (size_t b = 0; b < layout.buckets.size(); ++b) {
    const BucketLayout& lb = layout.buckets[b];
    for (; g < groups.size() && groups[g].begin < lb.partition_offset + lb.shard_numel; ++g) {
      if (lb.group < 0) {
        ZT_CHECK_STATE(!partition.on_disk(int(g)), "a persistent parameter's shard on disk");
        continue;
      }
      block_groups_[size_t(lb.group)].push_back(int(g));
      if (partition.on_disk(int(g))) {
        block_on_disk_[size_t(lb.group)] = true;
        group_offset_in_block_[g] = block_bytes[size_t(lb.group)];
        block_bytes[size_t(lb.group)] += partition.buffer_bytes(int(g));
      }
    }
  }
  for (int64_t bytes : block_bytes) largest_ = std::max(largest_, bytes);
  ZT_CHECK_STATE(io != nullptr, "parameters on disk without an I/O engine");
  buffers_.resize(size_t(std::max(1, buffer_count)));
  for (Buffer& b : buffers_) {
    b.data = io::AlignedBuffer(largest_);
    if (crossing_ && crossing_->pin && !crossing_->compute.is_cpu()) b.pinned = HostRegistration(b.data.data(), largest_);
  }
}

// The copies in flight read the buffers and write the slots about to be freed.
ParameterTier::~ParameterTier() {
  try {
    wait_copies();
  } catch (...) {  // a failing device at teardown: nothing left to protect
  }
}

void ParameterTier::wait_copies() {
  for (Slot& slot : slots_)
    if (slot.copied) slot.copied->synchronize();
  for (Buffer& b : buffers_)
    if (b.copied_out) {
      b.copied_out->synchronize();
      b.copied_out.reset();
    }
}

int ParameterTier::find(int block) const {
  for (size_t k = 0; k < buffers_.size(); ++k)
    if (buffers_[k].block == block) return int(k);
  return -1;
}

int ParameterTier::start_read(int block) {
  // The least recently used buffer that is not in use (its reads may be unwaited: a read ahead
  // for a block that did not come; wait before reusing it).
  int pick = -1;
  for (size_t k = 0; k < buffers_.size(); ++k)
    if (!buffers_[k].in_use && (pick < 0 || buffers_[k].last_use < buffers_[size_t(pick)].last_use)) pick = int(k);
  if (pick < 0) return -1;
  Buffer& b = buffers_[size_t(pick)];
  wait_reads(b);
  if (b.copied_out) {  // the copy to the device may still read it
    b.copied_out->synchronize();
    b.copied_out.reset();
  }
  b.block = block;
  b.last_use = ++clock_;
  for (int g : block_groups_[size_t(block)])
    if (partition_.on_disk(g))
      b.reads.push_back(partition_.read(g, static_cast<char*>(b.data.data()) + group_offset_in_block_[size_t(g)]));
  return pick;
}

void ParameterTier::wait_reads(Buffer& b) {
  if (b.reads.empty()) return;
  const auto start = std::chrono::steady_clock::now();
  for (auto t : b.reads) io_->wait(t);
  b.reads.clear();
  stall_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void ParameterTier::prepare(int block) {
  if (block < 0) return;
  // Still on the device since its last gather: nothing to read or copy.
  const bool in_slot = crossing_ && find_slot(block) >= 0;
  if (block_on_disk_[size_t(block)] && !in_slot) {
    int k = find(block);
    if (k < 0) k = start_read(block);
    ZT_CHECK_STATE(k >= 0, "every parameter buffer is in use (offload_param.buffer_count too small for the blocks gathered at once)");
    Buffer& b = buffers_[size_t(k)];
    wait_reads(b);
    b.in_use = true;
    b.last_use = ++clock_;
  }
  if (crossing_) cross(block);
}

int ParameterTier::find_slot(int block) const {
  for (size_t k = 0; k < slots_.size(); ++k)
    if (slots_[k].block == block) return int(k);
  return -1;
}

int ParameterTier::free_slot() const {
  int pick = -1;
  for (size_t k = 0; k < slots_.size(); ++k)
    if (!slots_[k].in_use && (pick < 0 || slots_[k].last_use < slots_[size_t(pick)].last_use)) pick = int(k);
  return pick;
}

// The block's shards into a slot on the compute device, unless one still holds them.
void ParameterTier::cross(int block) {
  int k = find_slot(block);
  std::optional<c10::Stream> compute_stream;
  if (copy_stream_) compute_stream = c10::impl::VirtualGuardImpl(crossing_->compute.type()).getStream(crossing_->compute);
  if (k < 0) {
    k = free_slot();
    ZT_CHECK_STATE(k >= 0, "every parameter slot on the device is in use");
    Slot& slot = slots_[size_t(k)];
    slot.block = -1;  // until its copies are issued
    {
      std::optional<c10::StreamGuard> on_copy_stream;
      if (copy_stream_) {
        // The gathers that read the slot's last block come first.
        if (slot.consumed) slot.consumed->block(*copy_stream_);
        on_copy_stream.emplace(*copy_stream_);
        delay_copy_stream_for_testing();
      }
      for (size_t b = 0; b < layout_.buckets.size(); ++b) {
        const BucketLayout& lb = layout_.buckets[b];
        if (lb.group != block || lb.shard_numel == 0) continue;
        slot.data.narrow(0, slot_offset_[b], lb.shard_numel).copy_(host_shard(int(b)), /*non_blocking=*/copy_stream_.has_value());
        crossed_bytes_ += lb.shard_numel * partition_.element_size();
      }
    }
    if (copy_stream_) {
      slot.copied.emplace(crossing_->compute.type());
      slot.copied->record(*copy_stream_);
    }
    if (block_on_disk_[size_t(block)]) {
      // The slot holds the block now: its read buffer may take the next read once the copy is done.
      Buffer& read = buffers_[size_t(find(block))];
      read.in_use = false;
      if (copy_stream_) {
        read.copied_out.emplace(crossing_->compute.type());
        read.copied_out->record(*copy_stream_);
      }
    }
    slot.block = block;
  }
  Slot& slot = slots_[size_t(k)];
  slot.in_use = true;
  slot.last_use = ++clock_;
  // The gathers, enqueued after this on the compute stream, read the copy.
  if (copy_stream_ && slot.copied) slot.copied->block(*compute_stream);
}

at::Tensor ParameterTier::shard(int bucket) {
  if (!crossing_) return host_shard(bucket);
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  const int block = block_of_bucket_[size_t(bucket)];
  // A persistent parameter's shard crosses on its own (once per step, synchronously).
  if (block < 0) return host_shard(bucket).to(crossing_->compute, /*non_blocking=*/false, /*copy=*/true);
  const int k = find_slot(block);
  ZT_CHECK_STATE(k >= 0 && slots_[size_t(k)].in_use, "a block's shard asked for before prepare()");
  return slots_[size_t(k)].data.narrow(0, slot_offset_[size_t(bucket)], lb.shard_numel);
}

at::Tensor ParameterTier::host_shard(int bucket) {
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  const int block = block_of_bucket_[size_t(bucket)];
  if (block < 0 || !block_on_disk_[size_t(block)]) return partition_.view(lb.partition_offset, lb.shard_numel);
  const int k = find(block);
  ZT_CHECK_STATE(k >= 0 && buffers_[size_t(k)].in_use, "a block's shard asked for before prepare()");
  // The bucket's sub-groups are consecutive in the buffer only when none has padding before the
  // next; a bucket is normally one sub-group (sub_group_size >= the bucket's shard).
  int first = -1, count = 0;
  for (int g : block_groups_[size_t(block)])
    if (groups_[size_t(g)].begin >= lb.partition_offset && groups_[size_t(g)].begin < lb.partition_offset + lb.shard_numel) {
      if (first < 0) first = g;
      ++count;
    }
  ZT_CHECK_STATE(first >= 0, "a bucket without sub-groups");
  const int64_t element = partition_.element_size();
  for (int g = first; g < first + count - 1; ++g)
    ZT_CHECK_STATE(groups_[size_t(g)].numel * element == partition_.buffer_bytes(g),
                   "offload_param: a bucket split into sub-groups that are not whole 4 KiB pages "
                   "(use a zero_optimization.sub_group_size that is a multiple of 4096 or at least the bucket)");
  char* base = static_cast<char*>(buffers_[size_t(k)].data.data()) + group_offset_in_block_[size_t(first)];
  return torch::from_blob(base, {lb.shard_numel}, torch::TensorOptions().dtype(partition_.dtype()));
}

bool ParameterTier::can_prepare(int block) const {
  if (block < 0) return true;
  if (crossing_) {
    if (find_slot(block) >= 0) return true;
    if (free_slot() < 0) return false;
  }
  if (!block_on_disk_[size_t(block)]) return true;
  for (const Buffer& b : buffers_)
    if (!b.in_use) return true;  // its own read-ahead buffer, or one to read into
  return false;
}

void ParameterTier::done(int block) {
  if (block < 0) return;
  if (crossing_) {
    const int k = find_slot(block);
    if (k >= 0) {
      Slot& slot = slots_[size_t(k)];
      slot.in_use = false;
      if (copy_stream_) {
        c10::impl::VirtualGuardImpl impl(crossing_->compute.type());
        slot.consumed.emplace(crossing_->compute.type());
        slot.consumed->record(impl.getStream(crossing_->compute));
      }
    }
  }
  if (!block_on_disk_[size_t(block)]) return;
  const int k = find(block);
  if (k >= 0) buffers_[size_t(k)].in_use = false;
}

void ParameterTier::expect(const std::vector<int>& upcoming) {
  if (buffers_.empty()) return;
  // Read ahead into the buffers not in use, nearest first, keeping one free for an unexpected block.
  int free = 0;
  for (const Buffer& b : buffers_) free += b.in_use ? 0 : 1;
  for (int block : upcoming) {
    if (free <= 1) break;
    if (block < 0 || !block_on_disk_[size_t(block)]) continue;
    if (int k = find(block); k >= 0) {
      buffers_[size_t(k)].last_use = ++clock_;
      continue;
    }
    if (start_read(block) < 0) break;
    --free;
  }
}

void ParameterTier::invalidate() {
  wait_copies();
  for (Slot& slot : slots_) {
    ZT_CHECK_STATE(!slot.in_use, "the partition changed while a block's shards were on the device for a gather");
    slot.block = -1;
  }
  for (Buffer& b : buffers_) {
    wait_reads(b);
    ZT_CHECK_STATE(!b.in_use, "the partition changed while a block's shards were in use");
    b.block = -1;
  }
}

int64_t ParameterTier::slot_bytes() const {
  int64_t total = 0;
  for (const Slot& slot : slots_) total += int64_t(slot.data.nbytes());
  return total;
}

int64_t ParameterTier::buffer_bytes() const {
  int64_t total = 0;
  for (const Buffer& b : buffers_) total += b.data.size();
  return total;
}

}  // namespace zt
