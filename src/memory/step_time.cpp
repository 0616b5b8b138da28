// The step-time model (zerotrain/memory/step_time.h); docs/step_time.md has the formulas and sources.
#include "zerotrain/memory/step_time.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "layout/reuse_distance.h"
#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/config/gpt_config.h"
#include "zerotrain/config/gpt_flops.h"

namespace zt {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Elementwise traffic of one transformer layer per token, in elements of the hidden width: the
// kernels between the matrix products (two LayerNorms, GELU over 4h, residual sums, dropout, bias
// adds) read and write about 22h elements in forward and twice that in backward
// (docs/step_time.md "Compute").
constexpr double kElementwiseForwardPerHidden = 22.0;

// Bytes the fused Adam moves per parameter: p, g, m, v read and p, m, v written in fp32 (28); mixed
// precision also reads the 16-bit gradient and writes the 16-bit working copy (docs/optim.md).
constexpr double kAdamBytesFp32 = 28.0, kAdamBytesMixed = 32.0;
// What the nvme optimizer tier reads and writes per parameter each step: fp32 master, m and v.
constexpr double kOptimizerStateBytes = 12.0;

// Half of the overlappable communication hides behind compute on the GPU presets: what DeepSpeed's
// ZeRO-3 achieved in ZeRO++'s published runs at 100-800 Gb/s (docs/step_time.md "Against published
// figures"); zerotrain's own overlap on GPUs is not measured yet.
constexpr double kGpuOverlap = 0.5;

ClusterPreset preset(std::string name, std::string description, int per_node, DeviceKind kind, double device_gib,
                     double host_gib, double nvme_gib, ClusterRates rates) {
  ClusterSpec spec;
  spec.nodes = 1;
  spec.devices_per_node = per_node;
  spec.device = kind;
  spec.device_memory = int64_t(device_gib * kGiB);
  spec.host_memory = int64_t(host_gib * kGiB);
  spec.nvme_bytes = int64_t(nvme_gib * kGiB);
  spec.rates = rates;
  spec.name = name;
  return ClusterPreset{std::move(name), std::move(description), spec};
}

ClusterRates v100_rates(double intra, double inter) {
  ClusterRates r;
  r.device_flops_fp32 = 14e12;   // 15.7 TFLOP/s fp32 peak
  r.device_flops_16bit = 50e12;  // 40% of the 125 TFLOP/s tensor-core peak (docs/step_time.md)
  r.device_memory_bandwidth = 750e9;  // of 900 GB/s HBM2
  r.intra_node_bandwidth = intra;
  r.intra_node_latency = 5e-6;
  r.inter_node_bandwidth = inter;
  r.inter_node_latency = 10e-6;
  r.host_device_bandwidth = 11e9;  // PCIe 3.0 x16
  r.host_adam_rate = 2e9;
  r.overlap = kGpuOverlap;
  return r;
}

}  // namespace

const std::vector<ClusterPreset>& cluster_presets() {
  static const std::vector<ClusterPreset> presets = [] {
    std::vector<ClusterPreset> p;
    {
      ClusterRates r = v100_rates(120e9, 42e9);
      r.nvme_read_bandwidth = 2e9;
      r.nvme_write_bandwidth = 1.5e9;
      p.push_back(preset("dgx1-v100", "DGX-1: 8 V100-SXM2 32 GB, NVLink cube mesh, 4 x 100 Gb/s InfiniBand", 8,
                         DeviceKind::Cuda, 32, 512, 7000, r));
    }
    {
      ClusterRates r = v100_rates(120e9, 85e9);
      r.nvme_read_bandwidth = 4e9;
      r.nvme_write_bandwidth = 3e9;
      p.push_back(preset("dgx2-v100",
                         "DGX-2: 16 V100-SXM3 32 GB, NVSwitch, 8 x 100 Gb/s InfiniBand (the ZeRO papers' cluster)", 16,
                         DeviceKind::Cuda, 32, 1536, 30000, r));
    }
    {
      ClusterRates r;
      r.device_flops_fp32 = 50e12;    // 67 TFLOP/s fp32 peak (no TF32)
      r.device_flops_16bit = 500e12;  // half the 989 TFLOP/s dense bf16 peak (docs/step_time.md)
      r.device_memory_bandwidth = 2.7e12;  // of 3.35 TB/s HBM3
      r.intra_node_bandwidth = 450e9;      // NVLink 4 through NVSwitch
      r.intra_node_latency = 5e-6;
      r.inter_node_bandwidth = 360e9;      // 8 x 400 Gb/s InfiniBand NDR
      r.inter_node_latency = 10e-6;
      r.host_device_bandwidth = 50e9;      // PCIe 5.0 x16
      r.host_adam_rate = 6e9;
      r.nvme_read_bandwidth = 20e9;
      r.nvme_write_bandwidth = 10e9;
      r.overlap = kGpuOverlap;
      p.push_back(preset("dgx-h100", "DGX H100: 8 H100-SXM 80 GB, NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand", 8,
                         DeviceKind::Cuda, 80, 2048, 30000, r));
    }
    {
      // Measured on 2-core, 24 GiB machines (AMD EPYC, AVX-512 + AVX512-BF16), 2 ranks of
      // one thread each, by bench/step_time.sh (docs/step_time.md "Calibration").
      ClusterRates r;
      r.device_flops_fp32 = 78e9;
      r.device_flops_16bit = 170e9;
      r.device_memory_bandwidth = 29e9;  // the fused Adam's bytes with both ranks stepping
      r.intra_node_bandwidth = 1.28e9;   // Gloo over loopback: a gather's bus bandwidth
      r.intra_node_latency = 50e-6;
      r.reduce_bandwidth_factor = 0.92;
      r.host_adam_rate = 2.06e9;
      r.nvme_read_bandwidth = 0.9e9;
      r.nvme_write_bandwidth = 0.7e9;
      r.overlap = 0.0;  // the ranks own both cores: Gloo's copies and sums take compute time
      p.push_back(preset("cpu-box", "2 CPU ranks of one thread on a 2-core, 24 GiB machine (AMD EPYC with AVX512-BF16)", 2,
                         DeviceKind::Cpu, 0, 23, 0, r));
    }
    return p;
  }();
  return presets;
}

ClusterSpec cluster_preset(const std::string& name) {
  std::vector<std::string> names;
  for (const auto& p : cluster_presets()) {
    if (p.name == name) return p.spec;
    names.push_back(p.name);
  }
  throw ConfigError(fmt::format("cluster preset: expected one of {}, found '{}'", fmt::join(names, ", "), name));
}

namespace {

// The members of one collective: `per_node` ranks on each of `nodes` nodes.
struct Group {
  int per_node = 1;
  int nodes = 1;
  int size() const { return per_node * nodes; }
};

enum class Collective { AllReduce, ReduceScatter, AllGather };

// A ring over the group, its ranks of a node adjacent: every byte crosses each node's links once
// per pass, so the pass runs at the slower of the intra-node bus bandwidth and the node's network
// bandwidth shared by the groups that run at once (tensor parallelism makes several).
double bus_bandwidth(const ClusterSpec& cluster, const Group& g, Collective kind) {
  const ClusterRates& r = cluster.rates;
  double bandwidth = g.per_node > 1 ? r.intra_node_bandwidth : 0;
  if (g.nodes > 1) {
    const double concurrent = double(cluster.devices_per_node) / double(g.per_node);
    const double inter = r.inter_node_bandwidth / concurrent;
    bandwidth = g.per_node > 1 ? std::min(bandwidth, inter) : inter;
  }
  if (kind != Collective::AllGather) bandwidth *= r.reduce_bandwidth_factor;
  return bandwidth;
}

struct Transfer {
  double seconds = 0;
  double bytes = 0;  // sent per device
};

// `count` collectives over `g` moving `bytes` in total (the whole buffer, not a shard).
Transfer collective(const ClusterSpec& cluster, const Group& g, Collective kind, double bytes, double count) {
  const int n = g.size();
  if (n <= 1 || bytes <= 0) return {};
  // On CPU devices the engine reduce-scatters its gradient buckets by an in-place all-reduce and
  // keeps its block (docs/comm.md "What Gloo lacks"): two passes, as an all-reduce.
  const bool as_all_reduce = kind == Collective::ReduceScatter && cluster.device == DeviceKind::Cpu;
  const double passes = kind == Collective::AllReduce || as_all_reduce ? 2.0 : 1.0;
  const double share = double(n - 1) / double(n);
  const double bandwidth = bus_bandwidth(cluster, g, kind);
  if (!(bandwidth > 0))
    throw ConfigError(fmt::format("cluster rates: a collective over {} rank(s) on {} node(s) needs {}; found none "
                                  "(give --cluster or the bandwidth flags)",
                                  g.per_node, g.nodes, g.nodes > 1 ? "inter_node_bandwidth" : "intra_node_bandwidth"));
  const ClusterRates& r = cluster.rates;
  const double latency = (g.per_node - 1) * r.intra_node_latency + (g.nodes - 1) * r.inter_node_latency;
  Transfer t;
  t.bytes = passes * share * bytes;
  t.seconds = t.bytes / bandwidth + passes * std::max(1.0, count) * latency;
  return t;
}

// The GPT the figures describe, for its FLOP count.
GPTConfig gpt_of(const ModelFigures& m) {
  GPTConfig g;
  g.n_layer = m.layers;
  g.n_embd = m.hidden;
  g.n_head = m.heads > 0 ? m.heads : (m.hidden % 64 == 0 ? m.hidden / 64 : 1);
  g.vocab_size = m.vocabulary;
  g.context_length = m.sequence_length;
  g.loss_chunk_tokens = m.loss_chunk_tokens;
  return g;
}

// What a transfer can hide behind: nothing, or the forward or backward of the micro-step it runs in.
enum class HiddenBehind { Nothing, Forward, Backward };

// One phase (forward or backward) of every micro-step and the transfers the engine overlaps with it.
struct Phase {
  double compute = 0;   // seconds per micro-step
  double each = 0;      // transfer seconds in every micro-step's phase
  double boundary = 0;  // transfer seconds in the boundary micro-step's phase only (once per step)
  // The fraction of the phase's transfers that hides behind its compute over `m` micro-steps: in
  // each, `overlap` of the transfers up to the phase's compute.
  double hidden(double overlap, double m) const {
    const double total = m * each + boundary;
    if (total <= 0) return 0;
    const auto exposed = [&](double pool) { return pool - overlap * std::min(pool, compute); };
    return 1 - ((m - 1) * exposed(each) + exposed(each + boundary)) / total;
  }
};

}  // namespace

namespace {

// One step-time prediction, in docs/step_time.md's order: compute, the data-parallel (and stage
// 3's) collectives, tensor parallelism, offload traffic, the optimizer step, then what of the
// queued transfers hides behind compute. The phases share the inputs and the queue of transfers.
class StepTimeModel {
 public:
  StepTimeModel(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                const EstimateOptions& options, const StepTimeOptions& what_if)
      : model_(model), cluster_(cluster), config_(config), zero_(config.zero), r_(cluster.rates),
        what_if_(what_if), mixed_(config.precision != Precision::FP32),
        rate_(mixed_ && r_.device_flops_16bit > 0 ? r_.device_flops_16bit : r_.device_flops_fp32),
        tp_(what_if.tensor_parallel),
        opt_(options.offload_optimizer.value_or(config.zero.offload_optimizer.device)),
        param_(options.offload_param.value_or(config.zero.offload_param.device)),
        recompute_(options.recompute.value_or(recompute_of(config))), gpu_(cluster.device == DeviceKind::Cuda),
        element_(mixed_ ? 2.0 : 4.0) {}

  StepTime run() {
    validate();
    st_.micro_batch = config_.train_micro_batch_size_per_gpu;
    st_.accumulation = std::max<int64_t>(1, config_.gradient_accumulation_steps);
    micro_steps_ = double(st_.accumulation);
    tokens_ = double(st_.micro_batch) * double(std::max<int64_t>(1, model_.sequence_length));
    compute();
    // Data parallelism runs over the ranks holding the same tensor-parallel slice.
    dp_ = Group{cluster_.devices_per_node / tp_, cluster_.nodes};
    psi_ = double(model_.parameters) / tp_;
    shard_ = psi_ / double(dp_.size());
    data_parallel_collectives();
    if (zero_.shard_parameters) stage3_collectives();
    if (tp_ > 1) tensor_parallel_collectives();
    offload_traffic();
    optimizer_step();
    overlap();
    return st_;
  }

 private:
  struct Pending {
    std::string name;
    Transfer t;
    double times;
    HiddenBehind behind;
    bool offload;
  };

  void validate() {
    if (!(rate_ > 0) || !(r_.device_memory_bandwidth > 0))
      throw ConfigError(fmt::format(
          "cluster rates: the step-time model needs the device's FLOP/s and memory bandwidth; found {} and {} "
          "(give --cluster with a preset, or --rate device_flops_fp32=... --rate device_memory_bandwidth=...)",
          rate_, r_.device_memory_bandwidth));
    if (model_.parameters <= 0) throw ConfigError("step time: the model's parameter count is unknown");
    if (cluster_.world_size() != config_.world_size)
      throw ConfigError(fmt::format("step time: the cluster has {} devices but the configuration {} ranks",
                                    cluster_.world_size(), config_.world_size));
    if (tp_ < 1 || cluster_.devices_per_node % tp_ != 0)
      throw ConfigError(fmt::format("tensor_parallel: expected a divisor of the {} devices per node, found {}",
                                    cluster_.devices_per_node, tp_));
    hpz_configured_ = what_if_.hpz_partition_size == 1 && zero_.shard_parameters && zero_.hpz_partition_size > 1;
    hpz_ = hpz_configured_ ? zero_.hpz_partition_size : what_if_.hpz_partition_size;
    if (hpz_ < 1 || cluster_.devices_per_node % hpz_ != 0)
      throw ConfigError(fmt::format("{}: expected a divisor of the {} devices per node, found {}",
                                    hpz_configured_ ? "zero_optimization.zero_hpz_partition_size" : "hpz_partition_size",
                                    cluster_.devices_per_node, hpz_));
  }

  void compute() {
    double elementwise_bytes = 0;
    if (model_.has_shape()) {
      const GPTConfig gpt = gpt_of(model_);
      const StepFlops f = gpt_micro_batch_flops(gpt, st_.micro_batch, model_.sequence_length, recompute_, model_.layers);
      forward_flops_ = double(f.forward);
      recompute_flops_ = double(f.recompute);
      const double layer_pass =
          kElementwiseForwardPerHidden * double(model_.hidden) * tokens_ * double(model_.layers) * element_;
      elementwise_bytes = 3 * layer_pass + (recompute_ == Recompute::Full ? layer_pass : 0);
    } else {
      forward_flops_ = 2.0 * double(model_.parameters) * tokens_;
      st_.notes.push_back("the model's shape is unknown: compute is 6 FLOPs per parameter and token, no attention term");
    }
    per_device_ = 1.0 / double(tp_);
    const double forward =
        forward_flops_ * per_device_ / rate_ + elementwise_bytes / 3 * per_device_ / r_.device_memory_bandwidth;
    const double backward = (2 * forward_flops_ + recompute_flops_) * per_device_ / rate_ +
                            (elementwise_bytes - elementwise_bytes / 3) * per_device_ / r_.device_memory_bandwidth;
    fwd_ = Phase{forward};
    bwd_ = Phase{backward};
    st_.compute = micro_steps_ * (forward + backward);
    st_.terms.push_back({"forward compute", micro_steps_ * forward, micro_steps_ * forward, 0});
    st_.terms.push_back({recompute_ == Recompute::None ? "backward compute" : "backward compute with recomputation",
                         micro_steps_ * backward, micro_steps_ * backward, 0});
  }

  void queue(std::string name, Transfer t, double times, HiddenBehind behind, bool offload = false) {
    if (t.seconds > 0) pending_.push_back({std::move(name), t, times, behind, offload});
  }
  // Gradient reductions overlap backward only with overlap_comm (docs/zero.md).
  HiddenBehind grads_behind() const { return zero_.overlap_comm ? HiddenBehind::Backward : HiddenBehind::Nothing; }

  // Stages 0-2: the gradient reduction and, with sharded optimizer states, the updated parameters.
  void data_parallel_collectives() {
    const double buckets = std::ceil(psi_ / double(std::max<int64_t>(1, zero_.reduce_bucket_size)));
    const double gathers = std::ceil(psi_ / double(std::max<int64_t>(1, zero_.allgather_bucket_size)));
    if (!zero_.shard_optimizer_states) {
      // Stage 0: the summed gradients on every rank, once per step on the boundary micro-step.
      queue("all-reduce gradients", collective(cluster_, dp_, Collective::AllReduce, psi_ * element_, buckets), 1,
            grads_behind());
    } else if (!zero_.shard_gradients) {
      queue("reduce-scatter gradients", collective(cluster_, dp_, Collective::ReduceScatter, psi_ * element_, buckets),
            1, grads_behind());
    } else if (!zero_.shard_parameters) {
      // Stage 2 empties its buckets every micro-step.
      queue("reduce-scatter gradients", collective(cluster_, dp_, Collective::ReduceScatter, psi_ * element_, buckets),
            micro_steps_, grads_behind());
    }
    if (zero_.shard_optimizer_states && !zero_.shard_parameters)
      queue("all-gather updated parameters", collective(cluster_, dp_, Collective::AllGather, psi_ * element_, gathers),
            1, HiddenBehind::Nothing);
  }

  // Stage 3: each block gathered in forward (and again in backward unless kept), the gradients
  // reduce-scattered block by block, persistent parameters all-reduced.
  void stage3_collectives() {
    const double persistent = double(model_.persistent_parameters) / tp_;
    const double sharded = std::max(0.0, psi_ - persistent);
    const double blocks = model_.forward_block_order.empty() ? double(std::max<int64_t>(1, model_.layers) + 1)
                                                             : double(model_.forward_block_order.size());
    const double kept =
        !model_.forward_block_order.empty()
            ? double(kept_at_turn(model_.forward_block_order, model_.block_gathered, zero_.stage3_max_reuse_distance)) / tp_
            : double(kept_at_turn_equal_blocks(int64_t(sharded), std::max<int64_t>(1, model_.largest_block / tp_),
                                               zero_.stage3_max_reuse_distance));
    // The gatherer prefetches at least the next block, however large, while a positive
    // stage3_prefetch_bucket_size and the live-parameter budget allow (zero/parameter_gatherer.cpp).
    const bool prefetch = zero_.stage3_prefetch_bucket_size > 0 && zero_.stage3_max_live_parameters > model_.largest_block;
    // With hpZ only the first micro-step's forward reads the primary partition; every later gather
    // until the optimizer step reads the secondary one (zero/parameter_gatherer.cpp).
    Group secondary = dp_;
    if (hpz_ > 1) secondary = Group{std::min(hpz_, dp_.per_node), 1};
    const double primary_forwards = hpz_ > 1 ? 1 : micro_steps_;
    auto forward_gathers = [&](const Group& group, double times, const std::string& suffix) {
      const Transfer gather = collective(cluster_, group, Collective::AllGather, sharded * element_, blocks);
      // The first block's gather has nothing to hide behind.
      Transfer first{gather.seconds / blocks, gather.bytes / blocks};
      Transfer rest{gather.seconds - first.seconds, gather.bytes - first.bytes};
      queue("all-gather parameters (forward, first block" + suffix + ")", first, times, HiddenBehind::Nothing);
      queue("all-gather parameters (forward" + suffix + ")", rest, times,
            prefetch ? HiddenBehind::Forward : HiddenBehind::Nothing);
    };
    forward_gathers(dp_, primary_forwards, "");
    if (micro_steps_ > primary_forwards)
      forward_gathers(secondary, micro_steps_ - primary_forwards, ", later micro-steps, within the secondary partition");
    const double again = std::max(0.0, sharded - kept);
    regathered_ = sharded > 0 ? again / sharded : 0;
    if (again > 0) {
      const double count = blocks * again / std::max(1.0, sharded);
      queue(hpz_ > 1 ? "all-gather parameters (backward, within the secondary partition)"
                     : "all-gather parameters (backward)",
            collective(cluster_, secondary, Collective::AllGather, again * element_, count), micro_steps_,
            prefetch ? HiddenBehind::Backward : HiddenBehind::Nothing);
    }
    if (hpz_ > 1)
      st_.notes.push_back(fmt::format(
          "hpZ{}: the gathers after the first micro-step's forward stay within groups of {} ranks{}",
          hpz_configured_ ? "" : " what-if", hpz_,
          again > 0 || micro_steps_ > 1 ? "" : " (none here: every block stays gathered through backward, one micro-step)"));
    queue("reduce-scatter gradients", collective(cluster_, dp_, Collective::ReduceScatter, sharded * element_, blocks),
          micro_steps_, grads_behind());
    if (persistent > 0)
      queue("all-reduce persistent gradients",
            collective(cluster_, dp_, Collective::AllReduce, persistent * element_, 1), micro_steps_, grads_behind());
    shard_ = sharded / double(dp_.size()) + persistent / double(dp_.size());
  }

  // Megatron: two all-reduces of the layer's activations in forward and two in backward (and two
  // more when full recomputation runs the forward again), within the node, not overlapped.
  void tensor_parallel_collectives() {
    const Group tensor{tp_, 1};
    const double activation = tokens_ * double(model_.hidden) * element_;
    const double count = 2.0 * double(std::max<int64_t>(1, model_.layers));
    queue("tensor-parallel all-reduces (forward)", collective(cluster_, tensor, Collective::AllReduce, activation, 1),
          micro_steps_ * count, HiddenBehind::Nothing);
    queue("tensor-parallel all-reduces (backward)", collective(cluster_, tensor, Collective::AllReduce, activation, 1),
          micro_steps_ * count * (recompute_ == Recompute::Full ? 2 : 1), HiddenBehind::Nothing);
  }

  void require_nvme_rates() const {
    if (!(r_.nvme_read_bandwidth > 0 && r_.nvme_write_bandwidth > 0))
      throw ConfigError("cluster rates: offload to nvme needs the NVMe read and write bandwidths; found none");
  }

  void offload_traffic() {
    node_share_ = double(cluster_.devices_per_node) / tp_;  // ranks of a node stepping on its host
    host_step_ = opt_ != OffloadTarget::None && gpu_;         // the optimizer runs on the CPUs
    if ((host_step_ || (gpu_ && param_ != OffloadTarget::None)) && !(r_.host_device_bandwidth > 0))
      throw ConfigError("cluster rates: offload to the host needs host_device_bandwidth (PCIe); found none");
    const double bytes = shard_ * element_;
    if (host_step_) {
      queue("gradients to the host", {bytes / r_.host_device_bandwidth, bytes}, zero_.shard_gradients ? micro_steps_ : 1,
            grads_behind(), true);
      queue("parameters to the device", {bytes / r_.host_device_bandwidth, bytes}, 1, HiddenBehind::Nothing, true);
    }
    if (param_ == OffloadTarget::None || !zero_.shard_parameters) return;
    const double passes = 1.0 + regathered_;  // every gather reads its shard from the host first
    if (gpu_)
      queue("parameter shards to the device", {bytes / r_.host_device_bandwidth, bytes}, micro_steps_ * passes,
            HiddenBehind::Forward, true);
    if (param_ == OffloadTarget::Nvme) {
      require_nvme_rates();
      queue("parameter shards from NVMe", {node_share_ * bytes / r_.nvme_read_bandwidth, bytes}, micro_steps_ * passes,
            HiddenBehind::Forward, true);
      queue("updated parameter shards to NVMe", {node_share_ * bytes / r_.nvme_write_bandwidth, bytes}, 1,
            HiddenBehind::Nothing, true);
    }
  }

  void optimizer_step() {
    const double owned = zero_.shard_optimizer_states ? shard_ : psi_;
    double optimizer = 0;
    if (host_step_) {
      if (!(r_.host_adam_rate > 0)) throw ConfigError("cluster rates: optimizer offload needs host_adam_rate; found none");
      optimizer = node_share_ * owned / r_.host_adam_rate;
    } else {
      optimizer = owned * (mixed_ ? kAdamBytesMixed : kAdamBytesFp32) / r_.device_memory_bandwidth;
    }
    optimizer_exposed_ = optimizer;
    if (opt_ == OffloadTarget::Nvme) {
      require_nvme_rates();
      // Sub-groups are read, stepped and written back in a pipeline: the slower side sets the pace.
      const double bytes = node_share_ * owned * kOptimizerStateBytes;
      const double swap = bytes / r_.nvme_read_bandwidth + bytes / r_.nvme_write_bandwidth;
      st_.offload += swap;
      st_.terms.push_back(
          {"optimizer states through NVMe", swap, std::max(0.0, swap - optimizer), 2 * owned * kOptimizerStateBytes});
      optimizer_exposed_ = std::max(optimizer, swap);
    }
    st_.optimizer = optimizer;
    st_.terms.push_back({host_step_ ? "optimizer step on the host" : "optimizer step", optimizer, optimizer, 0});
  }

  // What of each queued transfer hides behind its phase's compute; a transfer issued once per
  // step (times 1) runs in the boundary micro-step only.
  void overlap() {
    for (const Pending& p : pending_) {
      if (p.behind == HiddenBehind::Nothing) continue;
      Phase& phase = p.behind == HiddenBehind::Forward ? fwd_ : bwd_;
      if (p.times == 1 && micro_steps_ > 1)
        phase.boundary += p.t.seconds;
      else
        phase.each += p.t.seconds * p.times / micro_steps_;
    }
    const double fwd_hidden = fwd_.hidden(r_.overlap, micro_steps_), bwd_hidden = bwd_.hidden(r_.overlap, micro_steps_);
    double exposed = 0;
    for (const Pending& p : pending_) {
      const double seconds = p.t.seconds * p.times;
      const double hidden = p.behind == HiddenBehind::Nothing ? 0.0 : p.behind == HiddenBehind::Forward ? fwd_hidden : bwd_hidden;
      StepTimeTerm term{p.name, seconds, seconds * (1 - hidden), p.t.bytes * p.times};
      exposed += term.exposed;
      (p.offload ? st_.offload : st_.communication) += seconds;
      st_.terms.push_back(term);
    }
    st_.exposed = exposed + (optimizer_exposed_ - st_.optimizer);
    st_.total = st_.compute + st_.optimizer + st_.exposed;
    const double global_tokens = tokens_ * micro_steps_ * double(cluster_.world_size()) / tp_;
    st_.tokens_per_second = global_tokens / st_.total;
    st_.model_flops_per_device = micro_steps_ * 3 * forward_flops_ * per_device_ / st_.total;
    st_.executed_flops_per_device = micro_steps_ * (3 * forward_flops_ + recompute_flops_) * per_device_ / st_.total;
    if (r_.overlap < 1 && (fwd_.each + fwd_.boundary > 0 || bwd_.each + bwd_.boundary > 0))
      st_.notes.push_back(fmt::format("{:.0f}% of the overlappable communication can hide behind compute on these devices",
                                      100 * r_.overlap));
  }

  const ModelFigures& model_;
  const ClusterSpec& cluster_;
  const TrainConfig& config_;
  const ZeroConfig& zero_;
  const ClusterRates& r_;
  const StepTimeOptions& what_if_;
  const bool mixed_;
  const double rate_;
  const int tp_;
  const OffloadTarget opt_, param_;
  const Recompute recompute_;
  const bool gpu_;
  const double element_;  // bytes per working parameter and per gradient
  bool hpz_configured_ = false;
  int hpz_ = 1;
  StepTime st_;
  double micro_steps_ = 1, tokens_ = 0;
  double forward_flops_ = 0, recompute_flops_ = 0, per_device_ = 1;
  Phase fwd_, bwd_;
  Group dp_{1, 1};
  double psi_ = 0;         // elements each data-parallel rank trains
  double shard_ = 0;       // elements each rank owns
  double regathered_ = 0;  // the fraction of the sharded parameters gathered again in backward
  double node_share_ = 1;
  bool host_step_ = false;
  double optimizer_exposed_ = 0;
  std::vector<Pending> pending_;
};

}  // namespace

StepTime estimate_step_time(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                            const EstimateOptions& options, const StepTimeOptions& what_if) {
  if (model.tensor_parallel <= 1) return StepTimeModel(model, cluster, config, options, what_if).run();
  // Figures of one rank of a tensor group (the memory estimate's): the model below takes the whole
  // model's counts and divides them by the tensor-parallel size itself.
  const int64_t T = model.tensor_parallel;
  if (what_if.tensor_parallel != 1 && what_if.tensor_parallel != T)
    throw ConfigError(fmt::format("tensor parallel {}: the model is split over tensor groups of {} "
                                  "(tensor_parallel.autotp_size); expected that or nothing",
                                  what_if.tensor_parallel, T));
  ModelFigures whole = model;
  whole.tensor_parallel = 1;
  whole.parameters *= T;
  whole.persistent_parameters *= T;
  whole.largest_block *= T;
  whole.largest_parameter *= T;
  for (int64_t& gathered : whole.block_gathered) gathered *= T;
  whole.vocabulary *= T;
  whole.parameter_list.clear();
  whole.parameter_owner.clear();
  StepTimeOptions split = what_if;
  split.tensor_parallel = int(T);
  return StepTimeModel(whole, cluster, config, options, split).run();
}

}  // namespace zt
