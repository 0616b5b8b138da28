#include "zero/optimizer_partition.h"
#include "zerotrain/memory/memory.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "common/check.h"
#include "io/aio.h"
#include "zero/optimizer_stream.h"

// The optimizer partition's construction: its roles on their tiers, the next working copy and the
// gradient snapshot where the step needs them, the chunks the kernels run over, the stream; and its
// sizes. The rest of its implementation, by responsibility:
//   optimizer_kernels.cpp    the step: the kernels dispatched over the chunks, parameter groups
//   optimizer_stream.h/.cpp  NVMe sub-groups streamed through aligned buffers; the pass over chunks
//   optimizer_delayed.cpp    the delayed update's worker and the install of the next working copy
//   optimizer_staging.cpp    the gradients copied to the host for the step staged through it
//   optimizer_fragments.cpp  checkpoint fragments, and the working copy refreshed from the masters

namespace zt {
namespace {

// Chunk of 16-bit gradients converted to fp32 before one kernel call; bounds the scratch buffer
// (the offload plan counts it among the host buffers).
constexpr int64_t kConversionChunk = kConversionChunkElements;

}  // namespace

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
  install_by_swap_ = working_.partition != nullptr && (!staged_ || options.devices.parameters_on_host);
  ZT_CHECK_STATE(!options.devices.parameters_on_host || working_.partition != nullptr,
                 "parameters on the host without a sharded working partition");
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
  if (options.delayed || staged_) grad_snapshot_ = empty_host(partition, options.working_dtype, options.devices.pin_host);
  // Staged with the partition on the host, the undelayed step writes it in place: no next copy.
  if (options.delayed || (staged_ && !options.devices.parameters_on_host)) {
    // The next working copy has the working partition's tiers, so that installing it is a swap
    // (staged: host memory, installed by copies to the device).
    const TieredArray* w = working_.partition;
    if (install_by_swap_ && w->any_on_disk()) {
      std::vector<char> on_disk(groups_.size());
      for (int g = 0; g < int(groups_.size()); ++g) on_disk[size_t(g)] = w->on_disk(g);
      next_working_ = TieredArray("params.next", options.working_dtype, groups_, on_disk, *tiers.io,
                                  w->file().parent_path() / "params.next.swap");
    } else {
      next_working_ = TieredArray("params.next", options.working_dtype, partition, c10::kCPU,
                                  install_by_swap_ ? options.devices.pin_parameters : options.devices.pin_host);
    }
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

// Pieces of the owned fragments, contiguous in the flat buffer and the partition, cut at
// sub-group boundaries and (16-bit gradients, converted through the scratch) every
// kConversionChunk elements.
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

void OptimizerPartition::zero_moments() {
  exp_avg_.fill_zero();
  exp_avg_sq_.fill_zero();
}

OptimizerPartition::IoCounters OptimizerPartition::io_counters() const {
  std::lock_guard<std::mutex> lock(counters_mutex_);
  return io_counters_;
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
