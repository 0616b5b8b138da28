#include "zero/gradient_reducer.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <cmath>
#include <cstring>

#include "common/check.h"
#include "optim/device_kernels.h"

namespace zt {

GradientReducer::GradientReducer(const FlatLayout& layout, const Options& options, Communicator& comm)
    : layout_(layout), options_(options), comm_(comm) {
  ZT_CHECK_STATE(options.pre_divide > 0 && std::isfinite(options.pre_divide), "pre_divide must be positive");
  // A world of one reduces nothing; dividing there would only add rounding.
  pre_divide_ = options.world > 1 ? options.pre_divide : 1.0;
  auto working = torch::TensorOptions().dtype(options.working_dtype).device(options.device);
  if (sharded()) {
    const bool disk = options.disk && std::any_of(options.disk->on_disk.begin(), options.disk->on_disk.end(),
                                                  [](char d) { return d != 0; });
    if (disk) {
      partition_ = TieredArray("grads", options.working_dtype, options.disk->groups, options.disk->on_disk,
                               *options.disk->io, options.disk->file);
      on_disk_ = true;
    } else {
      partition_ = TieredArray("grads", options.working_dtype, layout.partition_numel, options.device);
      grad_partition_ = partition_.memory();
    }
    int64_t largest = 0;
    for (const auto& b : layout.buckets) {
      largest = std::max(largest, b.numel);
      largest_shard_ = std::max(largest_shard_, b.shard_numel);
    }
    // The scratch receives the reductions of later micro-steps of a window, which are added;
    // without gradient accumulation there are none (unless a bucket is refilled by a gradient
    // that came after it was launched; then launch() allocates it). With a disk tier every
    // reduction lands there first.
    const int64_t scratch = options.accumulation_steps > 1 || on_disk_ ? largest_shard_ : 0;
    // Two buffers let one fill while the other is in flight; without overlap_comm a bucket's
    // reduction completes before the next bucket starts, so one is enough.
    buffer_count_ = options.overlap_comm ? 2 : 1;
    int64_t staging = 0;
    if (on_disk_) {
      const std::vector<SubGroup>& groups = options.disk->groups;
      bucket_groups_.resize(layout.buckets.size());
      for (int g = 0, b = 0; g < int(groups.size()); ++g) {
        while (groups[size_t(g)].begin >= layout.buckets[size_t(b)].partition_offset + layout.buckets[size_t(b)].shard_numel) ++b;
        bucket_groups_[size_t(b)].push_back(g);
      }
      for (const auto& in_bucket : bucket_groups_) {
        int64_t bytes = 0;
        for (int g : in_bucket)
          if (partition_.on_disk(g)) bytes += partition_.buffer_bytes(g);
        staging = std::max(staging, bytes);
      }
      bucket_square_sum_.assign(layout.buckets.size(), SquareSums{});
      square_sum_known_.assign(layout.buckets.size(), 0);
    }
    for (int k = 0; k < buffer_count_; ++k) {
      buffers_[k].data = torch::zeros({largest}, working);
      buffers_[k].scratch = torch::empty({scratch}, working);
      if (staging > 0) buffers_[k].staging = io::AlignedBuffer(staging);
    }
  } else {
    flat_grads_ = torch::zeros({layout.total_numel}, working);
  }
  progress_.resize(layout.buckets.size());
  slots_.resize(layout.placements.size());
  split_segments_.resize(layout.buckets.size());
  if (!options.tensor_split.empty())
    for (const OwnedFragment& f : layout.owned_fragments(options.shard_rank))
      if (f.placement >= 0 && options.tensor_split[size_t(f.placement)])
        split_segments_[size_t(f.bucket)].emplace_back(f.partition_offset - layout.buckets[size_t(f.bucket)].partition_offset,
                                                       f.numel);
  final_sent_.assign(layout.buckets.size(), 0);
}

void GradientReducer::attach(int placement, const at::Tensor& param) {
  const ParameterPlacement& p = layout_.placements[placement];
  Slot& slot = slots_[placement];
  slot.param = param;
  slot.bucket = p.bucket;
  auto shape = param.sizes();
  const int64_t in_bucket = p.offset - layout_.buckets[p.bucket].offset;
  if (sharded()) {
    for (int k = 0; k < buffer_count_; ++k)
      slot.bucket_grad_view[k] = buffers_[k].data.narrow(0, in_bucket, p.numel).view(shape);
    slot.param.mutable_grad() = torch::Tensor();
  } else {
    slot.grad_view = flat_grads_.narrow(0, p.offset, p.numel).view(shape);
    slot.param.mutable_grad() = slot.grad_view;
  }
}

// Not sharded, before a backward and before the step reads the arena: each .grad is its arena
// view again. The script may have replaced it: torch's zero_grad() sets it to None (the gradient
// is then zero), or it assigned a tensor of its own (that is the gradient, as autograd would have
// added to it). A gradient another backward left there (before_gradient diverted it) is dropped.
void GradientReducer::reattach_gradients() {
  at::NoGradGuard no_grad;
  for (Slot& slot : slots_) {
    if (!slot.param.defined()) continue;
    const at::Tensor& grad = slot.param.grad();
    if (grad.is_same(slot.grad_view)) {
      slot.diverted = false;
      continue;
    }
    if (!grad.defined()) slot.grad_view.zero_();
    else if (!slot.diverted) slot.grad_view.copy_(grad.reshape(slot.grad_view.sizes()));
    slot.param.mutable_grad() = slot.grad_view;
    slot.diverted = false;
  }
}

void GradientReducer::begin_backward(bool boundary) {
  // Gradients are reduced on the boundary micro-step only, except when they are sharded: then
  // every micro-step reduces, so that no full-size gradient survives a backward. Unsharded
  // gradients are reduced from the gradient hooks while backward runs with overlap_comm, else
  // once backward has returned (as DeepSpeed's stages 0 and 1 without overlap_comm).
  boundary_ = boundary;
  if (!sharded()) reattach_gradients();
  reduce_whole_ = !sharded() && boundary && options_.world > 1;
  reducing_ = sharded() || (reduce_whole_ && options_.overlap_comm);
  if (sharded() || reduce_whole_)
    for (size_t i = 0; i < progress_.size(); ++i) {
      progress_[i].remaining = layout_.buckets[i].end_placement - layout_.buckets[i].first_placement;
      if (!sharded()) {
        progress_[i].state = BucketState::Idle;
        progress_[i].handle.reset();
      }
    }
  in_backward_ = true;
}

void GradientReducer::abort_backward() { in_backward_ = false; }

void GradientReducer::end_backward() {
  in_backward_ = false;
  if (sharded()) flush_buckets();
  if (reduce_whole_ && !options_.overlap_comm) {
    for (int b = 0; b < int(progress_.size()); ++b) launch(b);  // finish_window() waits for them
    reducing_ = true;
  }
}

// Sharded: the gradient of slot i is about to be accumulated; its .grad must be the right place
// in a zeroed bucket buffer.
//
// Not sharded, outside this engine's backward (another engine's loss reaching this model): the
// gradient goes to a tensor of its own instead of the arena, which holds this engine's window.
void GradientReducer::before_gradient(int i) {
  if (!sharded()) {
    Slot& slot = slots_[i];
    if (!in_backward_ && slot.param.grad().is_same(slot.grad_view)) {
      slot.param.mutable_grad() = at::Tensor();
      slot.diverted = true;
    }
    return;
  }
  if (!in_backward_) return;
  Slot& slot = slots_[i];
  BucketProgress& b = progress_[slot.bucket];
  if (b.state != BucketState::Filling) acquire_buffer(slot.bucket);
  slot.param.mutable_grad() = slot.bucket_grad_view[b.buffer];
}

bool GradientReducer::after_gradient(int i) {
  if (!reducing_ || !in_backward_) return false;
  const int bucket = slots_[i].bucket;
  // A gradient that arrives after its bucket was launched (out-of-order backward) makes its
  // bucket fill again; it is launched from flush_buckets(). remaining then stays below zero.
  if (--progress_[bucket].remaining == 0) launch(bucket);
  return true;
}

void GradientReducer::acquire_buffer(int bucket) {
  const int k = next_buffer_;
  next_buffer_ = (next_buffer_ + 1) % buffer_count_;
  BucketBuffer& buffer = buffers_[k];
  if (buffer.bucket >= 0 && progress_[buffer.bucket].buffer == k) {
    BucketProgress& previous = progress_[buffer.bucket];
    if (previous.state == BucketState::Filling) launch(buffer.bucket);  // a gradient never came
    complete(k);
  }
  buffer.data.narrow(0, 0, layout_.buckets[bucket].numel).zero_();
  buffer.bucket = bucket;
  progress_[bucket].state = BucketState::Filling;
  progress_[bucket].buffer = k;
}

void GradientReducer::launch(int bucket) {
  BucketProgress& b = progress_[bucket];
  const BucketLayout& lb = layout_.buckets[bucket];
  const std::string label = "grads.bucket" + std::to_string(bucket);
  // The window's gradient of this bucket, divided before it is summed (prescale_gradients,
  // gradient_predivide_factor); the engine divides the rest in its unscale factor.
  auto pre_divide = [&](const torch::Tensor& t) {
    if (pre_divide_ != 1.0) t.div_(pre_divide_);
  };
  switch (options_.reduction) {
    case GradientReduction::AllReduce:
      pre_divide(flat_grads_.narrow(0, lb.offset, lb.numel));
      b.handle = comm_.all_reduce(flat_grads_.narrow(0, lb.offset, lb.numel), ReduceOp::Sum, label);
      b.state = BucketState::InFlight;
      return;
    case GradientReduction::ReduceScatterInPlace:
      pre_divide(flat_grads_.narrow(0, lb.offset, lb.numel));
      b.handle = comm_.reduce_scatter(flat_grads_.narrow(0, lb.offset, lb.numel),
                                      flat_grads_.narrow(0, layout_.shard_offset(bucket, options_.shard_rank), lb.shard_numel),
                                      ReduceOp::Sum, label, InputUse::Scratch);
      b.state = BucketState::InFlight;
      return;
    case GradientReduction::ReduceScatterBuckets: {
      ZT_CHECK_STATE(b.state == BucketState::Filling, "launching a bucket that is not filling");
      BucketBuffer& buffer = buffers_[b.buffer];
      // The first reduction of a window writes the owned slice; later ones are added to it.
      buffer.add_into_partition = b.received;
      // Without accumulation only a bucket refilled by a late gradient needs the scratch.
      if (buffer.add_into_partition && buffer.scratch.numel() < lb.shard_numel)
        buffer.scratch = torch::empty({largest_shard_}, buffer.data.options());
      torch::Tensor owned = buffer.add_into_partition || on_disk_
                                ? buffer.scratch.narrow(0, 0, lb.shard_numel)
                                : grad_partition_.narrow(0, lb.partition_offset, lb.shard_numel);
      pre_divide(buffer.data.narrow(0, 0, lb.numel));
      buffer.handle =
          comm_.reduce_scatter(buffer.data.narrow(0, 0, lb.numel), owned, ReduceOp::Sum, label, InputUse::Scratch);
      b.state = BucketState::InFlight;
      b.received = true;
      if (!options_.overlap_comm) complete(b.buffer);
      return;
    }
  }
}

void GradientReducer::complete(int k) {
  BucketBuffer& buffer = buffers_[k];
  if (buffer.bucket < 0) return;
  BucketProgress& b = progress_[buffer.bucket];
  // The bucket may have moved on to the other buffer since (a late gradient refilled it).
  if (b.state != BucketState::InFlight || b.buffer != k) return;
  buffer.handle.wait();
  if (on_disk_) {
    store_shard(buffer.bucket, buffer, buffer.add_into_partition);
  } else if (buffer.add_into_partition) {
    const BucketLayout& lb = layout_.buckets[buffer.bucket];
    grad_partition_.narrow(0, lb.partition_offset, lb.shard_numel).add_(buffer.scratch.narrow(0, 0, lb.shard_numel));
  }
  b.state = BucketState::Idle;
  if (boundary_ && on_final_ && !on_disk_) {
    final_sent_[size_t(buffer.bucket)] = 1;
    on_final_(buffer.bucket);
  }
}

// End of a backward with sharded gradients: launch what is still filling (in bucket order, the
// same on every rank) and wait, so that only the owned partition holds gradients afterwards.
void GradientReducer::flush_buckets() {
  for (int bucket = 0; bucket < int(progress_.size()); ++bucket)
    if (progress_[bucket].state == BucketState::Filling) launch(bucket);
  for (int k = 0; k < buffer_count_; ++k) complete(k);
  // The next micro-step may read back what this one wrote.
  wait_writes();
}

// Disk tier: the bucket's reduction (in the scratch) plus, after the first micro-step of the
// window, the sum so far becomes the window's sum; its sum of squares is taken on the boundary
// micro-step; then it goes to the arena (memory sub-groups) or the swap file.
void GradientReducer::store_shard(int bucket, BucketBuffer& buffer, bool add) {
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  torch::Tensor shard = buffer.scratch.narrow(0, 0, lb.shard_numel);
  const std::vector<SubGroup>& groups = options_.disk->groups;
  for (auto t : buffer.writes) options_.disk->io->wait(t);  // the staging is about to be reused
  buffer.writes.clear();
  char* staging = static_cast<char*>(buffer.staging.data());
  auto part = [&](int g) { return shard.narrow(0, groups[size_t(g)].begin - lb.partition_offset, groups[size_t(g)].numel); };
  if (add) {
    std::vector<io::AioEngine::Ticket> reads;
    int64_t at = 0;
    for (int g : bucket_groups_[size_t(bucket)])
      if (partition_.on_disk(g)) {
        reads.push_back(partition_.read(g, staging + at));
        at += partition_.buffer_bytes(g);
      }
    for (auto t : reads) options_.disk->io->wait(t);
    at = 0;
    for (int g : bucket_groups_[size_t(bucket)]) {
      // new + old: the same bits as old + new, which the arena in memory computes.
      if (partition_.on_disk(g)) {
        part(g).add_(torch::from_blob(staging + at, {groups[size_t(g)].numel}, shard.options()));
        at += partition_.buffer_bytes(g);
      } else {
        part(g).add_(partition_.view(groups[size_t(g)].begin, groups[size_t(g)].numel));
      }
    }
  }
  if (boundary_) {
    bucket_square_sum_[size_t(bucket)] = square_sums(bucket, shard);
    square_sum_known_[size_t(bucket)] = 1;
  }
  int64_t at = 0;
  for (int g : bucket_groups_[size_t(bucket)]) {
    if (partition_.on_disk(g)) {
      std::memcpy(staging + at, part(g).data_ptr(), size_t(groups[size_t(g)].numel * shard.element_size()));
      buffer.writes.push_back(partition_.write(g, staging + at));
      at += partition_.buffer_bytes(g);
    } else {
      partition_.view(groups[size_t(g)].begin, groups[size_t(g)].numel).copy_(part(g));
    }
  }
}

void GradientReducer::wait_writes() {
  if (!on_disk_) return;
  for (int k = 0; k < buffer_count_; ++k) {
    for (auto t : buffers_[k].writes) options_.disk->io->wait(t);
    buffers_[k].writes.clear();
  }
}

// Disk tier: the window's sum of a bucket, whole, in the first buffer's scratch.
at::Tensor GradientReducer::read_shard(int bucket, BucketBuffer& buffer) {
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  torch::Tensor shard = buffer.scratch.narrow(0, 0, lb.shard_numel);
  const std::vector<SubGroup>& groups = options_.disk->groups;
  for (auto t : buffer.writes) options_.disk->io->wait(t);
  buffer.writes.clear();
  char* staging = static_cast<char*>(buffer.staging.data());
  int64_t at = 0;
  for (int g : bucket_groups_[size_t(bucket)]) {
    torch::Tensor part = shard.narrow(0, groups[size_t(g)].begin - lb.partition_offset, groups[size_t(g)].numel);
    if (partition_.on_disk(g)) {
      options_.disk->io->wait(partition_.read(g, staging + at));
      part.copy_(torch::from_blob(staging + at, {groups[size_t(g)].numel}, shard.options()));
      at += partition_.buffer_bytes(g);
    } else {
      part.copy_(partition_.view(groups[size_t(g)].begin, groups[size_t(g)].numel));
    }
  }
  return shard;
}

double GradientReducer::square_sum(const at::Tensor& t) {
  // One fp32 norm over a whole partition lost the small squares once the running sum had grown:
  // GPT-2 124M's first gradient norm came out 0.4% low at stage 0 (65.44 for 65.72), and with
  // clipping the stages then trained differently from each other and from DeepSpeed. Rows of
  // 1024 elements are each summed in fp32 (LibTorch's vectorised reduction) and the rows' squares
  // added in double. LibTorch converts 16-bit input to fp32 whole before reducing it, so those
  // gradients go through in chunks of rows: a bucket's fp32 copy was the step's largest
  // temporary (249 MB of GPT-2 124M's bf16 gradients per rank at stage 2), and it raised the
  // process's peak. Each row's norm, and so the sum, is the same either way.
  constexpr int64_t row = 1024;
  const at::Tensor flat = t.reshape({-1});
  const int64_t n = flat.numel(), whole = n / row * row;
  double sum = 0.0;
  if (whole > 0) {
    const int64_t rows = whole / row;
    const int64_t rows_per_call = t.scalar_type() == torch::kFloat32 ? rows : int64_t{1024};
    at::Tensor norms = torch::empty({rows}, t.options().dtype(torch::kFloat32));
    for (int64_t first = 0; first < rows; first += rows_per_call) {
      const int64_t count = std::min(rows_per_call, rows - first);
      at::Tensor out = norms.narrow(0, first, count);
      torch::linalg_vector_norm_out(out, flat.narrow(0, first * row, count * row).view({count, row}), 2, {1},
                                    false, torch::kFloat32);
    }
    sum += norms.to(torch::kFloat64).square().sum().item<double>();
  }
  if (whole < n) {
    const double tail = torch::linalg_vector_norm(flat.narrow(0, whole, n - whole), 2, c10::nullopt, false,
                                                  torch::kFloat32)
                            .item<double>();
    sum += tail * tail;
  }
  return sum;
}

// Not sharded: the window's reductions, launched from the hooks or after backward, complete.
void GradientReducer::wait_whole_reductions() {
  if (!reducing_) return;
  // Buckets whose parameters received no gradient this step (unused in forward) are still
  // reduced, in bucket order, so every rank issues the same collectives.
  for (int b = 0; b < int(progress_.size()); ++b)
    if (progress_[b].state != BucketState::InFlight) launch(b);
  for (int b = 0; b < int(progress_.size()); ++b) progress_[b].handle->wait();
  reducing_ = false;
}

void GradientReducer::reopen_window(bool keep) {
  if (sharded()) return;
  wait_whole_reductions();
  reattach_gradients();
  if (!keep) flat_grads_.zero_();
  else if (post_divisor() != 1.0) flat_grads_.div_(post_divisor());
}

void GradientReducer::finish_window() {
  if (!sharded()) {
    wait_whole_reductions();
    // After the reductions: a .grad the script replaced since its backward replaces the result.
    // Every bucket then reaches on_final_ below.
    reattach_gradients();
  }
  reducing_ = false;
  if (sharded() && !on_disk_)
    // A bucket that no gradient reached in this window holds no reduction: its slice is zero.
    for (int b = 0; b < int(progress_.size()); ++b)
      if (!progress_[b].received)
        grad_partition_.narrow(0, layout_.buckets[b].partition_offset, layout_.buckets[b].shard_numel).zero_();
  if (sharded() && on_disk_)
    for (int b = 0; b < int(progress_.size()); ++b) {
      if (!progress_[b].received) {
        buffers_[0].scratch.narrow(0, 0, layout_.buckets[size_t(b)].shard_numel).zero_();
        store_shard(b, buffers_[0], false);  // on the boundary: its sum of squares, 0, is known too
      } else if (!square_sum_known_[size_t(b)]) {
        // Reduced in an earlier micro-step of the window only.
        bucket_square_sum_[size_t(b)] = square_sums(b, read_shard(b, buffers_[0]));
        square_sum_known_[size_t(b)] = 1;
      }
    }
  wait_writes();
  if (on_final_ && !on_disk_)
    for (int b = 0; b < int(progress_.size()); ++b)
      if (!final_sent_[size_t(b)]) on_final_(b);
  std::fill(final_sent_.begin(), final_sent_.end(), 0);
}

GradientReducer::SquareSums GradientReducer::square_sums(int bucket, const at::Tensor& owned) const {
  const auto& segments = split_segments_[size_t(bucket)];
  if (segments.empty()) return {0.0, square_sum(owned)};
  SquareSums sums;
  int64_t at = 0;
  for (const auto& [offset, numel] : segments) {
    if (offset > at) sums.replicated += square_sum(owned.narrow(0, at, offset - at));
    sums.split += square_sum(owned.narrow(0, offset, numel));
    at = offset + numel;
  }
  if (at < owned.numel()) sums.replicated += square_sum(owned.narrow(0, at, owned.numel() - at));
  return sums;
}

GradientReducer::SquareSums GradientReducer::owned_square_sums() const {
  SquareSums sums;
  if (on_disk_) {
    for (const SquareSums& s : bucket_square_sum_) {
      sums.split += s.split;
      sums.replicated += s.replicated;
    }
    return sums;
  }
  auto owned = [&](int b) {
    const BucketLayout& lb = layout_.buckets[b];
    return sharded() ? grad_partition_.narrow(0, lb.partition_offset, lb.shard_numel)
                     : flat_grads_.narrow(0, layout_.shard_offset(b, options_.shard_rank), lb.shard_numel);
  };
  if (options_.device.is_cpu()) {
    for (int b = 0; b < int(layout_.buckets.size()); ++b) {
      const SquareSums s = square_sums(b, owned(b));
      sums.split += s.split;
      sums.replicated += s.replicated;
    }
    return sums;
  }
  // On a device: the global norm's kernel adds every bucket's squares (in double) into device
  // values [replicated, split], read once: the step's one wait for the device before the optimizer
  // (docs/gpu.md).
  const at::Tensor total = torch::zeros({2}, torch::TensorOptions().dtype(torch::kFloat64).device(options_.device));
  c10::impl::VirtualGuardImpl impl(options_.device.type());
  void* stream = impl.getStream(options_.device).native_handle();
  const optim::DeviceGradType type = options_.working_dtype == at::kBFloat16 ? optim::DeviceGradType::BF16
                                     : options_.working_dtype == at::kHalf   ? optim::DeviceGradType::F16
                                                                             : optim::DeviceGradType::F32;
  double* replicated = total.data_ptr<double>();
  double* split = replicated + 1;
  auto add = [&](const at::Tensor& t, int64_t offset, int64_t numel, double* into) {
    if (numel > 0)
      optim::square_sum_device(static_cast<char*>(t.data_ptr()) + offset * t.element_size(), type, numel, into, stream);
  };
  for (int b = 0; b < int(layout_.buckets.size()); ++b) {
    const at::Tensor t = owned(b);
    int64_t at = 0;
    for (const auto& [offset, numel] : split_segments_[size_t(b)]) {
      add(t, at, offset - at, replicated);
      add(t, offset, numel, split);
      at = offset + numel;
    }
    add(t, at, t.numel() - at, replicated);
  }
  const at::Tensor host = total.cpu();
  return {host[1].item<double>(), host[0].item<double>()};
}

at::Tensor GradientReducer::owned_gradient(int64_t flat_offset, int64_t partition_offset, int64_t n) const {
  if (!sharded()) return flat_grads_.narrow(0, flat_offset, n);
  return on_disk_ ? partition_.view(partition_offset, n) : grad_partition_.narrow(0, partition_offset, n);
}

void GradientReducer::clear() {
  if (sharded()) {
    for (auto& b : progress_) b.received = false;
    std::fill(square_sum_known_.begin(), square_sum_known_.end(), 0);
  } else {
    flat_grads_.zero_();
  }
}

int64_t GradientReducer::gradient_bytes() const {
  return sharded() ? partition_.memory_bytes() : int64_t(flat_grads_.nbytes());
}

int64_t GradientReducer::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& buffer : buffers_)
    if (buffer.data.defined()) bytes += int64_t(buffer.data.nbytes() + buffer.scratch.nbytes()) + buffer.staging.size();
  return bytes;
}

int64_t GradientReducer::staging_bytes() const {
  int64_t bytes = 0;
  for (const auto& buffer : buffers_) bytes += buffer.staging.size();
  return bytes;
}

}  // namespace zt
