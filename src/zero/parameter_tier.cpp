#include "zero/parameter_tier.h"

#include <torch/torch.h>

#include <chrono>

#include "common/check.h"

namespace zt {

ParameterTier::ParameterTier(const FlatLayout& layout, TieredArray& partition, const std::vector<SubGroup>& groups,
                             io::AioEngine* io, int buffer_count)
    : layout_(layout), partition_(partition), groups_(groups), io_(io) {
  int blocks = 0;
  for (const BucketLayout& b : layout.buckets) blocks = std::max(blocks, b.group + 1);
  block_groups_.resize(size_t(blocks));
  block_on_disk_.assign(size_t(blocks), false);
  block_of_bucket_.resize(layout.buckets.size());
  for (size_t b = 0; b < layout.buckets.size(); ++b) block_of_bucket_[b] = layout.buckets[b].group;
  group_offset_in_block_.assign(groups.size(), 0);
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
  for (Buffer& b : buffers_) b.data = io::AlignedBuffer(largest_);
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
  if (block < 0 || !block_on_disk_[size_t(block)]) return;
  int k = find(block);
  if (k < 0) k = start_read(block);
  ZT_CHECK_STATE(k >= 0, "every parameter buffer is in use (offload_param.buffer_count too small for the blocks gathered at once)");
  Buffer& b = buffers_[size_t(k)];
  wait_reads(b);
  b.in_use = true;
  b.last_use = ++clock_;
}

at::Tensor ParameterTier::shard(int bucket) {
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
  if (block < 0 || !block_on_disk_[size_t(block)]) return true;
  for (const Buffer& b : buffers_)
    if (!b.in_use) return true;  // its own read-ahead buffer, or one to read into
  return false;
}

void ParameterTier::done(int block) {
  if (block < 0 || !block_on_disk_[size_t(block)]) return;
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
  for (Buffer& b : buffers_) {
    wait_reads(b);
    ZT_CHECK_STATE(!b.in_use, "the partition changed while a block's shards were in use");
    b.block = -1;
  }
}

int64_t ParameterTier::buffer_bytes() const {
  int64_t total = 0;
  for (const Buffer& b : buffers_) total += b.data.size();
  return total;
}

}  // namespace zt
