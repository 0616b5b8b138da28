#include "zero/optimizer_partition.h"
#include "zerotrain/memory.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <utility>

#include "common/check.h"
#include "io/aio.h"
#include "optim/device_kernels.h"
#include "zero/gradient_reducer.h"
#include "zerotrain/comm.h"

namespace zt {
namespace {

// Chunk of 16-bit gradients converted to fp32 before one kernel call; bounds the scratch buffer.
constexpr int64_t kConversionChunk = 1 << 20;

optim::DeviceGradType device_grad_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return optim::DeviceGradType::BF16;
    case at::kHalf: return optim::DeviceGradType::F16;
    default: return optim::DeviceGradType::F32;
  }
}

// The current stream of `device` (a cudaStream_t for CUDA): the device kernels run in order with
// the rest of the compute stream's work.
void* current_stream_handle(c10::Device device) {
  c10::impl::VirtualGuardImpl impl(device.type());
  return impl.getStream(device).native_handle();
}

}  // namespace

// One pass of the step over the sub-groups: disk sub-groups of the pass's roles are read into a
// ring of buffers ahead of their turn and written back after it (docs/offload.md "The step").
class OptimizerPartition::Stream {
 public:
  struct Role {
    const TieredArray* array = nullptr;
    bool read = false, write = false;
  };
  // `extra_bytes` (per sub-group, or empty): a role not among `arrays` yet (the gradients).
  Stream(io::AioEngine& io, const std::vector<SubGroup>& groups, int buffer_count, bool pipeline_read,
         bool pipeline_write, const std::vector<const TieredArray*>& arrays, const std::vector<int64_t>& extra_bytes)
      : io_(io), groups_(groups), pipeline_read_(pipeline_read), pipeline_write_(pipeline_write) {
    // One buffer holds every disk role of the largest sub-group.
    int64_t largest = 0;
    for (int g = 0; g < int(groups.size()); ++g) {
      int64_t bytes = extra_bytes.empty() ? 0 : extra_bytes[size_t(g)];
      for (const TieredArray* a : arrays)
        if (a && a->on_disk(g)) bytes += a->buffer_bytes(g);
      largest = std::max(largest, bytes);
    }
    slots_.resize(size_t(std::max(1, buffer_count)));
    if (largest > 0)
      for (Slot& s : slots_) s.buffer = io::AlignedBuffer(largest);
  }

  int64_t buffer_bytes() const {
    int64_t total = 0;
    for (const Slot& s : slots_) total += s.buffer.size();
    return total;
  }

  // Runs `body(g, pointer_of)` for every sub-group in order; pointer_of(role index, partition
  // offset) gives the address of that element of a disk role in its buffer.
  template <class Body>
  void pass(const std::vector<Role>& roles, Body&& body) {
    roles_ = roles;
    const int n = int(groups_.size());
    const int depth = int(slots_.size());
    int issued = 0;
    for (int g = 0; g < n; ++g) {
      // Read ahead: sub-groups up to g + depth - 2 (one buffer is still being written back).
      while (issued < n && (issued == g || (pipeline_read_ && issued <= g + depth - 2))) issue_reads(issued++);
      Slot& slot = slots_[size_t(g % depth)];
      wait(slot.reads);
      body(g, [&](int role, int64_t offset) -> void* {
        const int64_t at = slot.region[size_t(role)];
        ZT_CHECK_STATE(at >= 0, "a disk role without a buffer region");
        return static_cast<char*>(slot.buffer.data()) + at +
               (offset - groups_[size_t(g)].begin) * roles_[size_t(role)].array->element_size();
      });
      for (size_t r = 0; r < roles_.size(); ++r)
        if (roles_[r].write && roles_[r].array && roles_[r].array->on_disk(g))
          slot.writes.push_back(roles_[r].array->write(g, static_cast<char*>(slot.buffer.data()) + slot.region[r]));
      if (!pipeline_write_) wait(slot.writes);
    }
    for (Slot& s : slots_) wait(s.writes);
  }

  double stall_seconds() const { return stall_seconds_; }

 private:
  struct Slot {
    io::AlignedBuffer buffer;
    std::vector<int64_t> region;  // per role: byte offset in the buffer, -1 when not on disk
    std::vector<io::AioEngine::Ticket> reads, writes;
  };

  void issue_reads(int g) {
    Slot& slot = slots_[size_t(g % int(slots_.size()))];
    wait(slot.writes);  // the buffer's previous sub-group must be on disk before it is reused
    slot.region.assign(roles_.size(), -1);
    int64_t at = 0;
    for (size_t r = 0; r < roles_.size(); ++r) {
      const TieredArray* a = roles_[r].array;
      if (!a || !a->on_disk(g)) continue;
      slot.region[r] = at;
      if (roles_[r].read) slot.reads.push_back(a->read(g, static_cast<char*>(slot.buffer.data()) + at));
      at += a->buffer_bytes(g);
    }
  }

  void wait(std::vector<io::AioEngine::Ticket>& tickets) {
    if (tickets.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    for (auto t : tickets) io_.wait(t);
    tickets.clear();
    stall_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  io::AioEngine& io_;
  const std::vector<SubGroup>& groups_;
  bool pipeline_read_, pipeline_write_;
  std::vector<Slot> slots_;
  std::vector<Role> roles_;
  double stall_seconds_ = 0;
};

OptimizerPartition::OptimizerPartition(const FlatLayout& layout, const Options& options, Communicator& comm,
                                       Working working)
    : layout_(layout), options_(options), comm_(comm), working_(std::move(working)) {
  const OptimizerConfig& o = options.optimizer;
  kind_ = o.type == "Lamb" ? Kind::Lamb : o.type == "SGD" ? Kind::Sgd : Kind::Adam;
  adam_ = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.adam_w_mode, o.bias_correction};
  lamb_ = {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.bias_correction, o.min_coeff, o.max_coeff};
  sgd_ = {o.lr, o.momentum, o.dampening, o.weight_decay, o.nesterov};
  // The delayed update writes the working values while the caller reads the old ones: the fp32
  // masters cannot be the working parameters then.
  staged_ = options.devices.stage_through_host;
  separate_master_ = keeps_fp32_masters(options.working_dtype != at::kFloat, options.delayed, staged_);
  ZT_CHECK_STATE(!(staged_ && options.devices.device_step()), "staged through the host yet stepping on the device");
  ZT_CHECK_STATE(!options.devices.device_step() || (!options.delayed && (options.tiers.on_disk.empty() || !options.tiers.io)),
                 "a device step with the delayed update or NVMe tiers");
  ZT_CHECK_STATE(!options.delayed || kind_ != Kind::Lamb || options.shard_world == 1,
                 "a delayed LAMB step would run its all-reduce beside the caller's collectives");
  const int64_t partition = layout.partition_numel;
  const Tiers& tiers = options.tiers;
  groups_ = tiers.groups.empty() ? std::vector<SubGroup>{{0, partition}} : tiers.groups;
  const bool tiered = !tiers.on_disk.empty() && tiers.io != nullptr;
  auto role = [&](const char* name, bool needed) {
    if (!needed) return TieredArray(name, at::kFloat, 0);
    // Not page-locked: only the staging copies below cross to the device.
    if (!tiered) return TieredArray(name, at::kFloat, partition, options.devices.state);
    return TieredArray(name, at::kFloat, groups_, tiers.on_disk, *tiers.io, tiers.directory / (std::string(name) + ".swap"));
  };
  const bool first_moment = kind_ != Kind::Sgd || sgd_.momentum != 0.0;
  // The long-lived arenas come first, so that later transients leave no holes beneath them.
  master_ = role("master", separate_master_);
  // The CPU kernels read fp32 gradients; the device kernels read the working dtype.
  if (options.working_dtype != at::kFloat && !options.devices.device_step())
    grad_scratch_ = torch::empty({std::min<int64_t>(partition, kConversionChunk)}, torch::kFloat32);
  exp_avg_ = role("exp_avg", first_moment);
  exp_avg_sq_ = role("exp_avg_sq", kind_ != Kind::Sgd);
  if (options.delayed || staged_) {
    // The next working copy has the working partition's tiers, so that installing it is a swap
    // (staged: host memory, installed by copies to the device).
    const TieredArray* w = working_.partition;
    if (!staged_ && w && w->any_on_disk()) {
      std::vector<char> on_disk(groups_.size());
      for (int g = 0; g < int(groups_.size()); ++g) on_disk[size_t(g)] = w->on_disk(g);
      next_working_ = TieredArray("params.next", options.working_dtype, groups_, on_disk, *tiers.io,
                                  w->file().parent_path() / "params.next.swap");
    } else {
      next_working_ = TieredArray("params.next", options.working_dtype, partition, c10::kCPU, options.devices.pin_host);
    }
    grad_snapshot_ = empty_host(partition, options.working_dtype, options.devices.pin_host);
  }
  copies_ = std::make_unique<DeviceCopies>(options.devices.compute, options.devices.emulate_copy_engine);
  snapshot_has_.assign(layout.buckets.size(), 0);
  plan_chunks();
  const bool working_on_disk = working_.partition && working_.partition->any_on_disk();
  std::vector<int64_t> gradient_bytes;
  for (size_t g = 0; g < tiers.gradients_on_disk.size(); ++g)
    gradient_bytes.push_back(tiers.gradients_on_disk[g]
                                 ? io::align_up(groups_[g].numel * int64_t(c10::elementSize(options.working_dtype)))
                                 : 0);
  const bool gradients_on_disk = std::any_of(gradient_bytes.begin(), gradient_bytes.end(), [](int64_t b) { return b > 0; });
  if (tiered || working_on_disk || gradients_on_disk) {
    ZT_CHECK_STATE(tiers.io != nullptr, "an offload tier without an I/O engine");
    stream_ = std::make_unique<Stream>(*tiers.io, groups_, tiers.buffer_count, tiers.pipeline_read,
                                       tiers.pipeline_write,
                                       // The next working copy has the working partition's tiers and is never in the same
                                       // pass: one of the two sizes the buffers.
                                       std::vector<const TieredArray*>{&master_, &exp_avg_, &exp_avg_sq_, working_.partition},
                                       gradient_bytes);
  }
}

OptimizerPartition::~OptimizerPartition() { join_worker(); }

void OptimizerPartition::join_worker() {
  // A step still running owns the buffers and the state: it finishes before they go (its error,
  // if any, has nobody left to hear it).
  if (worker_.joinable()) worker_.join();
}

// Pieces of the owned fragments, contiguous in the flat buffer and the partition, cut at
// sub-group boundaries and (16-bit gradients, converted through the scratch) every
// kConversionChunk elements.
template <typename Hyper>
Hyper OptimizerPartition::for_group(Hyper hyper, int group) const {
  if (group <= 0 || size_t(group) >= options_.groups.size()) return hyper;
  const Options::Group& g = options_.groups[size_t(group)];
  if (g.lr) hyper.lr = *g.lr;
  if (g.weight_decay) hyper.weight_decay = *g.weight_decay;
  return hyper;
}

void OptimizerPartition::plan_chunks() {
  const int64_t limit = grad_scratch_.defined() ? kConversionChunk : std::numeric_limits<int64_t>::max();
  chunks_.assign(groups_.size(), {});
  size_t g = 0;
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    // Padding (placement -1) joins whatever chunk it follows: its elements stay zero.
    const int group = f.placement >= 0 && !options_.placement_group.empty() ? options_.placement_group[size_t(f.placement)] : -1;
    for (int64_t done = 0; done < f.numel;) {
      const int64_t at = f.partition_offset + done;
      while (at >= groups_[g].begin + groups_[g].numel) ++g;
      std::vector<Chunk>& chunks = chunks_[g];
      if (chunks.empty() || chunks.back().numel >= limit ||
          chunks.back().flat_offset + chunks.back().numel != f.flat_offset + done ||
          chunks.back().partition_offset + chunks.back().numel != at ||
          (group >= 0 && chunks.back().group != group && chunks.back().numel > 0 &&
           !(chunks.back().placements.size() == 1 && chunks.back().placements[0] < 0)))
        chunks.push_back({f.flat_offset + done, at, 0, {0}, {}, std::max(group, 0)});
      if (group >= 0) chunks.back().group = group;
      Chunk& c = chunks.back();
      const int64_t take = std::min({f.numel - done, limit - c.numel, groups_[g].begin + groups_[g].numel - at});
      c.numel += take;
      c.bounds.push_back(c.numel);
      c.placements.push_back(f.placement);
      done += take;
    }
  }
  runs_.clear();
  for (const auto& chunks : chunks_)
    for (const Chunk& c : chunks) {
      if (!runs_.empty() && runs_.back().flat_offset + runs_.back().numel == c.flat_offset &&
          runs_.back().partition_offset + runs_.back().numel == c.partition_offset)
        runs_.back().numel += c.numel;
      else
        runs_.push_back({c.flat_offset, c.partition_offset, c.numel});
    }
}

void OptimizerPartition::store_master(int64_t begin, const at::Tensor& values) {
  ZT_CHECK_STATE(separate_master_, "masters are stored only where they are a role of their own");
  master_.store(begin, values);
}

// Runs kernel(chunk, p, g, m, v, half_out) over every chunk, sub-group by sub-group; the roles on
// disk are streamed (read before, written after). With separate fp32 masters (the delayed update
// in fp32) the updated masters are copied to the working values after the kernel.
template <class Kernel>
void OptimizerPartition::for_each_chunk(PassTarget target, bool writes_params, bool reads_gradients, Kernel&& kernel) {
  TieredArray* const params = separate_master_ ? &master_ : working_.partition;  // null: the flat buffer
  // The working values the step writes when they are not `params`; null: the flat buffer.
  TieredArray* const out = !separate_master_ ? nullptr : target.to_next ? &next_working_ : working_.partition;
  const bool copy_fp32 = separate_master_ && options_.working_dtype == at::kFloat;
  // Gradients on disk (nvme_gradients) are streamed in with the state.
  const TieredArray* const gradient_tier =
      reads_gradients && target.gradients && target.gradients->sharded() && target.gradients->partition().any_on_disk()
          ? &target.gradients->partition()
          : nullptr;
  enum { kParams, kExpAvg, kExpAvgSq, kOut, kGrad };
  auto address = [&](const TieredArray* a, int role, int g, const Chunk& c, auto& disk_pointer) -> void* {
    if (a == nullptr || !a->defined() || a->numel() == 0) return nullptr;
    if (a->on_disk(g)) return disk_pointer(role, c.partition_offset);
    return a->view(c.partition_offset, c.numel).data_ptr();
  };
  auto body = [&](int g, auto&& disk_pointer) {
    for (const Chunk& c : chunks_[size_t(g)]) {
      // This chunk's gradients: streamed in (on disk), the reducer's arena, or the delayed
      // update's snapshot; 16-bit ones converted to fp32 through the scratch.
      const void* grads = nullptr;
      if (reads_gradients) {
        at::Tensor grad = gradient_tier && gradient_tier->on_disk(g)
                              ? torch::from_blob(disk_pointer(kGrad, c.partition_offset), {c.numel},
                                                 torch::TensorOptions().dtype(options_.working_dtype))
                          : target.gradients ? target.gradients->owned_gradient(c.flat_offset, c.partition_offset, c.numel)
                                             : grad_snapshot_.narrow(0, c.partition_offset, c.numel);
        if (grad_scratch_.defined()) {
          at::Tensor converted = grad_scratch_.narrow(0, 0, c.numel);
          converted.copy_(grad);
          grads = converted.data_ptr<float>();
        } else {
          grads = grad.data_ptr();  // fp32 for the CPU kernels; the working dtype for the device kernels
        }
      }
      float* p = params ? static_cast<float*>(address(params, kParams, g, c, disk_pointer))
                        : working_.flat.data_ptr<float>() + c.flat_offset;
      float* m = static_cast<float*>(address(&exp_avg_, kExpAvg, g, c, disk_pointer));
      float* v = static_cast<float*>(address(&exp_avg_sq_, kExpAvgSq, g, c, disk_pointer));
      void* o = nullptr;
      if (separate_master_)
        o = out ? address(out, kOut, g, c, disk_pointer)
                : static_cast<char*>(working_.flat.data_ptr()) + c.flat_offset * int64_t(working_.flat.element_size());
      kernel(c, p, grads, m, v, copy_fp32 ? nullptr : static_cast<uint16_t*>(o));
      if (copy_fp32 && writes_params) {
        ZT_CHECK_STATE(!options_.devices.device_step(), "an fp32 copy of device masters through the host");
        std::memcpy(o, p, size_t(c.numel) * sizeof(float));
      }
    }
  };
  if (!stream_) {
    auto no_disk = [](int, int64_t) -> void* { return nullptr; };
    for (int g = 0; g < int(groups_.size()); ++g) body(g, no_disk);
    return;
  }
  // The working partition is read only when it holds the masters (plain fp32); the working copy
  // the step produces is only written.
  std::vector<Stream::Role> roles = {{params, true, writes_params},
                                     {&exp_avg_, true, true},
                                     {&exp_avg_sq_, true, true},
                                     {out, false, writes_params},
                                     {gradient_tier, true, false}};
  const double stall_before = stream_->stall_seconds();
  stream_->pass(roles, body);
  // The worker's waits for the disk are not the caller's: finish_step() counts what it waits.
  if (!target.to_next) {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    io_counters_.seconds += stream_->stall_seconds() - stall_before;
  }
}

void OptimizerPartition::step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
                              std::optional<Betas> betas) {
  ZT_CHECK_STATE(!in_flight_, "a synchronous step while a delayed one is in flight");
  if (staged_) {
    snapshot_gradients(gradients);
    run_step(lr, betas, step, grad_scale, PassTarget{nullptr, true}, 0);
    install_next_working();
    return;
  }
  run_step(lr, betas, step, grad_scale, PassTarget{&gradients, false}, 0);
}

// A bucket's owned slice, padding included (zero, and never read by the kernels).
void OptimizerPartition::copy_bucket_to_snapshot(int bucket, const GradientReducer& gradients) {
  const BucketLayout& lb = layout_.buckets[size_t(bucket)];
  if (lb.shard_numel == 0) return;
  copies_->to_host(grad_snapshot_.narrow(0, lb.partition_offset, lb.shard_numel),
                   gradients.owned_gradient(layout_.shard_offset(bucket, options_.shard_rank), lb.partition_offset,
                                            lb.shard_numel));
}

void OptimizerPartition::gradient_final(int bucket, const GradientReducer& gradients) {
  ZT_CHECK_STATE(takes_early_gradients(), "early gradients without the staged, undelayed step");
  copy_bucket_to_snapshot(bucket, gradients);
  snapshot_has_[size_t(bucket)] = 1;
}

void OptimizerPartition::snapshot_gradients(const GradientReducer& gradients) {
  for (int b = 0; b < int(layout_.buckets.size()); ++b)
    if (!snapshot_has_[size_t(b)]) copy_bucket_to_snapshot(b, gradients);
  std::fill(snapshot_has_.begin(), snapshot_has_.end(), 0);
  // Also completes the copies of the last install, which read the next working copy the step is
  // about to overwrite.
  copies_->wait_host();
}

void OptimizerPartition::launch_step(double lr, int64_t step, float grad_scale, const GradientReducer& gradients,
                                     std::optional<Betas> betas) {
  ZT_CHECK_STATE(options_.delayed, "launch_step without the delayed update");
  ZT_CHECK_STATE(!in_flight_, "launch_step while a step is in flight");
  snapshot_gradients(gradients);
  // The kernels' thread count is the caller's (a new thread would take OpenMP's default).
  const int threads = at::get_num_threads();
  in_flight_ = true;
  worker_ = std::thread([this, lr, betas, step, grad_scale, threads] {
    try {
      at::NoGradGuard no_grad;
      run_step(lr, betas, step, grad_scale, PassTarget{nullptr, true}, threads);
    } catch (...) {
      worker_error_ = std::current_exception();
    }
  });
}

void OptimizerPartition::finish_step() {
  if (!in_flight_) return;
  const auto start = std::chrono::steady_clock::now();
  worker_.join();
  in_flight_ = false;
  {
    std::lock_guard<std::mutex> lock(counters_mutex_);
    io_counters_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (worker_error_) std::rethrow_exception(std::exchange(worker_error_, nullptr));
  install_next_working();
}

// The next working copy becomes the working one: sharded, the two arrays trade places (the old
// values are overwritten by the next step before they are read again); otherwise the owned region
// of the flat buffer is copied from it.
void OptimizerPartition::install_next_working() {
  if (working_.partition && !staged_) {
    std::swap(*working_.partition, next_working_);
    return;
  }
  // Staged: asynchronous on a device, ordered before the compute stream's next use of the
  // parameters; the host copy stays untouched until the next snapshot_gradients() waits.
  for (const Run& r : runs_)
    copies_->to_device(working_.partition ? working_.partition->view(r.partition_offset, r.numel)
                                          : working_.flat.narrow(0, r.flat_offset, r.numel),
                       next_working_.view(r.partition_offset, r.numel));
}

OptimizerPartition::IoCounters OptimizerPartition::io_counters() const {
  std::lock_guard<std::mutex> lock(counters_mutex_);
  return io_counters_;
}

void OptimizerPartition::run_step(double lr, std::optional<Betas> betas, int64_t step, float grad_scale,
                                  PassTarget target, int threads) {
  optim::StepOptions options;
  options.grad_scale = grad_scale;
  options.threads = threads;
  if (options_.working_dtype != at::kFloat)
    options.half = options_.working_dtype == at::kBFloat16 ? optim::HalfType::BF16 : optim::HalfType::FP16;
  adam_.lr = lr;
  sgd_.lr = lr;
  lamb_.lr = lr;
  const Betas b = betas.value_or(Betas{options_.optimizer.beta1, options_.optimizer.beta2});
  adam_.beta1 = lamb_.beta1 = b.beta1;
  adam_.beta2 = lamb_.beta2 = b.beta2;
  auto with_half = [&](uint16_t* h) {
    optim::StepOptions o = options;
    o.half_out = h;
    return o;
  };
  // State on a device: the device kernels, on the compute stream, gradients in the working dtype.
  const bool on_device = options_.devices.device_step();
  optim::DeviceStepOptions device_options;
  if (on_device) {
    device_options.grad_scale = grad_scale;
    device_options.grad_type = device_grad_type(options_.working_dtype);
    device_options.half = options.half;
    device_options.stream = current_stream_handle(options_.devices.state);
  }
  auto device_with_half = [&](uint16_t* h) {
    optim::DeviceStepOptions o = device_options;
    o.half_out = h;
    return o;
  };
  switch (kind_) {
    case Kind::Adam:
      for_each_chunk(target, true, true,
                     [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t* h) {
                       const auto hyper = for_group(adam_, c.group);
                       if (on_device)
                         optim::adam_step_device(p, g, m, v, c.numel, hyper, step, device_with_half(h));
                       else
                         optim::adam_step(p, static_cast<const float*>(g), m, v, c.numel, hyper, step, with_half(h));
                     });
      break;
    case Kind::Sgd:
      for_each_chunk(target, true, true,
                     [&](const Chunk& c, float* p, const void* g, float* m, float*, uint16_t* h) {
                       const auto hyper = for_group(sgd_, c.group);
                       if (on_device)
                         optim::sgd_step_device(p, g, m, c.numel, hyper, step, device_with_half(h));
                       else
                         optim::sgd_step(p, static_cast<const float*>(g), m, c.numel, hyper, step, with_half(h));
                     });
      break;
    case Kind::Lamb:
      if (on_device) lamb_on_device(target, step, device_options);
      else lamb_on_host(target, step, options);
      break;
  }
}

void OptimizerPartition::lamb_on_host(PassTarget target, int64_t step, const optim::StepOptions& options) {
  const int tensors = int(layout_.placements.size());
  // [w_sq of each tensor..., u_sq of each tensor...], summed over this rank's pieces.
  torch::Tensor sums = torch::zeros({2 * tensors}, torch::kFloat64);
  double* s = sums.data_ptr<double>();
  for_each_chunk(target, false, true, [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t*) {
    const int pieces = int(c.placements.size());
    std::vector<double> w_sq(pieces), u_sq(pieces);
    optim::lamb_partial_norms(p, static_cast<const float*>(g), m, v, c.numel, c.bounds.data(), pieces,
                              for_group(lamb_, c.group), options, w_sq.data(), u_sq.data());
    for (int k = 0; k < pieces; ++k)
      if (c.placements[k] >= 0) {
        s[c.placements[k]] += w_sq[k];
        s[tensors + c.placements[k]] += u_sq[k];
      }
  });
  if (options_.shard_world > 1) comm_.all_reduce(sums, ReduceOp::Sum, "lamb.tensor_norms").wait();
  for_each_chunk(target, true, false, [&](const Chunk& c, float* p, const void*, float* m, float* v, uint16_t* h) {
    const int pieces = int(c.placements.size());
    std::vector<double> w_sq(pieces, 0.0), u_sq(pieces, 0.0);  // padding: ratio 1, update 0
    for (int k = 0; k < pieces; ++k)
      if (c.placements[k] >= 0) {
        w_sq[k] = s[c.placements[k]];
        u_sq[k] = s[tensors + c.placements[k]];
      }
    optim::StepOptions o = options;
    o.half_out = h;
    optim::lamb_apply(p, m, v, c.numel, c.bounds.data(), pieces, w_sq.data(), u_sq.data(), for_group(lamb_, c.group),
                      step, o);
  });
}

// The same two phases with the sums on the device: per chunk the kernel writes each piece's sums,
// which are added into the per-tensor totals (index_add_), all-reduced there (NCCL), and handed
// back per piece to the second kernel; nothing waits on the host.
void OptimizerPartition::lamb_on_device(PassTarget target, int64_t step, const optim::DeviceStepOptions& options) {
  const int tensors = int(layout_.placements.size());
  const auto device = torch::TensorOptions().device(options_.devices.state);
  torch::Tensor sums = torch::zeros({2 * tensors}, device.dtype(torch::kFloat64));
  // Per chunk: the pieces that belong to a tensor (not padding) and their tensors.
  auto piece_indices = [&](const Chunk& c) {
    std::vector<int64_t> pieces, owners;
    for (int k = 0; k < int(c.placements.size()); ++k)
      if (c.placements[k] >= 0) {
        pieces.push_back(k);
        owners.push_back(c.placements[k]);
      }
    auto to_device = [&](const std::vector<int64_t>& v) {
      return torch::tensor(v, torch::kLong).to(options_.devices.state, /*non_blocking=*/false);
    };
    return std::pair{to_device(pieces), to_device(owners)};
  };
  for_each_chunk(target, false, true, [&](const Chunk& c, float* p, const void* g, float* m, float* v, uint16_t*) {
    const int pieces = int(c.placements.size());
    torch::Tensor piece_sums = torch::zeros({2, pieces}, device.dtype(torch::kFloat64));
    optim::lamb_partial_norms_device(p, g, m, v, c.numel, c.bounds.data(), pieces, for_group(lamb_, c.group), options,
                                     piece_sums[0].data_ptr<double>(), piece_sums[1].data_ptr<double>());
    auto [kept, owners] = piece_indices(c);
    if (kept.numel() == 0) return;
    sums.narrow(0, 0, tensors).index_add_(0, owners, piece_sums[0].index_select(0, kept));
    sums.narrow(0, tensors, tensors).index_add_(0, owners, piece_sums[1].index_select(0, kept));
  });
  if (options_.shard_world > 1) comm_.all_reduce(sums, ReduceOp::Sum, "lamb.tensor_norms").wait();
  for_each_chunk(target, true, false, [&](const Chunk& c, float* p, const void*, float* m, float* v, uint16_t* h) {
    const int pieces = int(c.placements.size());
    torch::Tensor totals = torch::zeros({2, pieces}, device.dtype(torch::kFloat64));  // padding: ratio 1, update 0
    auto [kept, owners] = piece_indices(c);
    if (kept.numel() > 0) {
      totals[0].index_copy_(0, kept, sums.narrow(0, 0, tensors).index_select(0, owners));
      totals[1].index_copy_(0, kept, sums.narrow(0, tensors, tensors).index_select(0, owners));
    }
    optim::DeviceStepOptions o = options;
    o.half_out = h;
    optim::lamb_apply_device(p, m, v, c.numel, c.bounds.data(), pieces, totals[0].data_ptr<double>(),
                             totals[1].data_ptr<double>(), for_group(lamb_, c.group), step, o);
  });
}

void OptimizerPartition::refresh_working_from_masters() {
  if (!separate_master_) return;
  // In pieces of a checkpoint chunk: host memory stays bounded whatever the tiers.
  const int64_t piece = checkpoint_chunk_bytes() / int64_t(sizeof(float));
  TransferScratch scratch;
  at::Tensor masters, rounded;
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    for (int64_t done = 0; done < f.numel;) {
      const int64_t n = std::min(piece, f.numel - done);
      if (!masters.defined() || masters.numel() < n) {
        masters = rounded = at::Tensor();
        masters = torch::empty({n}, torch::kFloat32);
      }
      at::Tensor m = masters.narrow(0, 0, n);
      master_.read_elements(f.partition_offset + done, n, m.data_ptr(), scratch);
      if (working_.partition) {
        if (!rounded.defined() || rounded.numel() < n) rounded = torch::empty({n}, options_.working_dtype);
        at::Tensor r = rounded.narrow(0, 0, n);
        r.copy_(m);
        working_.partition->write_elements(f.partition_offset + done, n, r.data_ptr(), scratch);
      } else {
        working_.flat.narrow(0, f.flat_offset + done, n).copy_(m);
      }
      done += n;
    }
  }
}

void OptimizerPartition::zero_moments() {
  exp_avg_.fill_zero();
  exp_avg_sq_.fill_zero();
}

std::vector<StateFragment> OptimizerPartition::fragments(bool with_moments,
                                                         const std::function<std::string(int)>& name_of) const {
  std::vector<StateFragment> out;
  const TieredArray* params = separate_master_ ? &master_ : working_.partition;
  auto scratch = std::make_shared<TransferScratch>();  // shared by the sources: one piece at a time
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;  // padding
    StateFragment s;
    s.parameter = name_of(f.placement);
    s.begin = f.parameter_offset;
    s.numel = f.numel;
    auto add = [&](const std::string& role, const TieredArray& a) {
      if (a.in_memory(f.partition_offset, f.numel)) {
        s.roles[role] = a.view(f.partition_offset, f.numel);
        return;
      }
      s.sources[role] = [&a, scratch, at = f.partition_offset](int64_t offset, int64_t count, float* values) {
        a.read_elements(at + offset, count, values, *scratch);
      };
    };
    if (params) add("master", *params);
    else s.roles["master"] = working_.flat.narrow(0, f.flat_offset, f.numel);
    if (with_moments && exp_avg_.numel()) add("exp_avg", exp_avg_);
    if (with_moments && exp_avg_sq_.numel()) add("exp_avg_sq", exp_avg_sq_);
    out.push_back(std::move(s));
  }
  return out;
}

OptimizerPartition::Staged OptimizerPartition::staged_fragments(bool with_moments,
                                                               const std::function<std::string(int)>& name_of) {
  Staged staged;
  staged.scratch = std::make_shared<TransferScratch>();
  TieredArray* params = separate_master_ ? &master_ : working_.partition;
  auto staging_of = [&](TieredArray& a) -> std::shared_ptr<TieredStaging> {
    if (!a.any_on_disk()) return nullptr;
    for (const auto& s : staged.arrays)
      if (&s->live() == &a) return s;
    return staged.arrays.emplace_back(std::make_shared<TieredStaging>(a));
  };
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    StateFragment s;
    s.parameter = name_of(f.placement);
    s.begin = f.parameter_offset;
    s.numel = f.numel;
    auto add = [&](const std::string& role, TieredArray* a) {
      if (auto staging = a ? staging_of(*a) : nullptr) {
        s.sinks[role] = [staging, scratch = staged.scratch, at = f.partition_offset](int64_t offset, int64_t count,
                                                                                    const float* values) {
          staging->write(at + offset, count, values, *scratch);
        };
      } else {
        s.roles[role] = torch::empty({f.numel}, torch::kFloat32);
      }
    };
    add("master", params);
    if (with_moments && exp_avg_.numel()) add("exp_avg", &exp_avg_);
    if (with_moments && exp_avg_sq_.numel()) add("exp_avg_sq", &exp_avg_sq_);
    staged.fragments.push_back(std::move(s));
  }
  return staged;
}

void OptimizerPartition::commit_fragments(Staged& staged) {
  TieredArray* params = separate_master_ ? &master_ : working_.partition;
  size_t i = 0;
  for (const OwnedFragment& f : layout_.owned_fragments(options_.shard_rank)) {
    if (f.placement < 0) continue;
    const StateFragment& s = staged.fragments.at(i++);
    for (const auto& [role, values] : s.roles) {
      if (role == "master") {
        if (params) params->store(f.partition_offset, values);
        else working_.flat.narrow(0, f.flat_offset, f.numel).copy_(values);
      } else if (role == "exp_avg") {
        exp_avg_.store(f.partition_offset, values);
      } else if (role == "exp_avg_sq") {
        exp_avg_sq_.store(f.partition_offset, values);
      }
    }
  }
  for (const auto& array : staged.arrays) array->commit();
}

int64_t OptimizerPartition::memory_bytes() const {
  return master_.memory_bytes() + exp_avg_.memory_bytes() + exp_avg_sq_.memory_bytes();
}

int64_t OptimizerPartition::disk_bytes() const {
  return master_.disk_bytes() + exp_avg_.disk_bytes() + exp_avg_sq_.disk_bytes();
}

int64_t OptimizerPartition::buffer_bytes() const {
  return (grad_scratch_.defined() ? int64_t(grad_scratch_.nbytes()) : 0) + (stream_ ? stream_->buffer_bytes() : 0) +
         (grad_snapshot_.defined() ? int64_t(grad_snapshot_.nbytes()) : 0) + next_working_.memory_bytes();
}

}  // namespace zt
