// The step-time model (zerotrain/step_time.h); docs/step_time.md has the formulas and sources.
#include "zerotrain/step_time.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "layout/reuse_distance.h"
#include "zerotrain/config.h"
#include "zerotrain/error.h"
#include "zerotrain/models/gpt_config.h"
#include "zerotrain/models/gpt_flops.h"

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

StepTime estimate_step_time(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                            const EstimateOptions& options, const StepTimeOptions& what_if) {
  const ClusterRates& r = cluster.rates;
  const bool mixed = config.precision != Precision::FP32;
  const double rate = mixed && r.device_flops_16bit > 0 ? r.device_flops_16bit : r.device_flops_fp32;
  if (!(rate > 0) || !(r.device_memory_bandwidth > 0))
    throw ConfigError(fmt::format(
        "cluster rates: the step-time model needs the device's FLOP/s and memory bandwidth; found {} and {} "
        "(give --cluster with a preset, or --rate device_flops_fp32=... --rate device_memory_bandwidth=...)",
        rate, r.device_memory_bandwidth));
  if (model.parameters <= 0) throw ConfigError("step time: the model's parameter count is unknown");
  const int world = cluster.world_size();
  if (world != config.world_size)
    throw ConfigError(fmt::format("step time: the cluster has {} devices but the configuration {} ranks", world,
                                  config.world_size));
  const int tp = what_if.tensor_parallel;
  if (tp < 1 || cluster.devices_per_node % tp != 0)
    throw ConfigError(fmt::format("tensor_parallel: expected a divisor of the {} devices per node, found {}",
                                  cluster.devices_per_node, tp));
  const ZeroConfig& zero = config.zero;
  const bool hpz_configured = what_if.hpz_partition_size == 1 && zero.shard_parameters && zero.hpz_partition_size > 1;
  const int hpz = hpz_configured ? zero.hpz_partition_size : what_if.hpz_partition_size;
  if (hpz < 1 || cluster.devices_per_node % hpz != 0)
    throw ConfigError(fmt::format("{}: expected a divisor of the {} devices per node, found {}",
                                  hpz_configured ? "zero_optimization.zero_hpz_partition_size" : "hpz_partition_size",
                                  cluster.devices_per_node, hpz));
  const OffloadTarget opt = options.offload_optimizer.value_or(zero.offload_optimizer.device);
  const OffloadTarget param = options.offload_param.value_or(zero.offload_param.device);
  const Recompute recompute = options.recompute.value_or(recompute_of(config));
  const bool gpu = cluster.device == DeviceKind::Cuda;

  StepTime st;
  st.micro_batch = config.train_micro_batch_size_per_gpu;
  st.accumulation = std::max<int64_t>(1, config.gradient_accumulation_steps);
  const double micro_steps = double(st.accumulation);
  const double element = mixed ? 2.0 : 4.0;  // bytes per working parameter and per gradient

  // --- compute ---------------------------------------------------------------------------------
  double forward_flops = 0, recompute_flops = 0, elementwise_bytes = 0;
  const double tokens = double(st.micro_batch) * double(std::max<int64_t>(1, model.sequence_length));
  if (model.has_shape()) {
    const GPTConfig gpt = gpt_of(model);
    const StepFlops f = gpt_micro_batch_flops(gpt, st.micro_batch, model.sequence_length, recompute, model.layers);
    forward_flops = double(f.forward);
    recompute_flops = double(f.recompute);
    const double layer_pass = kElementwiseForwardPerHidden * double(model.hidden) * tokens * double(model.layers) * element;
    elementwise_bytes = 3 * layer_pass + (recompute == Recompute::Full ? layer_pass : 0);
  } else {
    forward_flops = 2.0 * double(model.parameters) * tokens;
    st.notes.push_back("the model's shape is unknown: compute is 6 FLOPs per parameter and token, no attention term");
  }
  const double per_device = 1.0 / double(tp);
  const double forward = forward_flops * per_device / rate + elementwise_bytes / 3 * per_device / r.device_memory_bandwidth;
  const double backward = (2 * forward_flops + recompute_flops) * per_device / rate +
                          (elementwise_bytes - elementwise_bytes / 3) * per_device / r.device_memory_bandwidth;
  st.compute = micro_steps * (forward + backward);
  st.terms.push_back({"forward compute", micro_steps * forward, micro_steps * forward, 0});
  st.terms.push_back({recompute == Recompute::None ? "backward compute" : "backward compute with recomputation",
                      micro_steps * backward, micro_steps * backward, 0});

  // --- communication ---------------------------------------------------------------------------
  // Data parallelism runs over the ranks holding the same tensor-parallel slice.
  const Group dp{cluster.devices_per_node / tp, cluster.nodes};
  const double psi = double(model.parameters) / tp;  // elements each data-parallel rank trains
  const double ranks = double(dp.size());
  Phase fwd{forward}, bwd{backward};
  const double buckets = std::ceil(psi / double(std::max<int64_t>(1, zero.reduce_bucket_size)));
  const double gathers = std::ceil(psi / double(std::max<int64_t>(1, zero.allgather_bucket_size)));
  struct Pending {
    std::string name;
    Transfer t;
    double times;
    HiddenBehind behind;
    bool offload;
  };
  std::vector<Pending> pending;
  auto queue = [&](std::string name, Transfer t, double times, HiddenBehind behind, bool offload = false) {
    if (t.seconds > 0) pending.push_back({std::move(name), t, times, behind, offload});
  };
  const HiddenBehind nothing = HiddenBehind::Nothing, in_forward = HiddenBehind::Forward;
  // Gradient reductions overlap backward only with overlap_comm (docs/zero.md).
  const HiddenBehind grads_behind = zero.overlap_comm ? HiddenBehind::Backward : nothing;

  if (!zero.shard_optimizer_states) {
    // Stage 0: the summed gradients on every rank, once per step on the boundary micro-step.
    queue("all-reduce gradients", collective(cluster, dp, Collective::AllReduce, psi * element, buckets), 1,
          grads_behind);
  } else if (!zero.shard_gradients) {
    queue("reduce-scatter gradients", collective(cluster, dp, Collective::ReduceScatter, psi * element, buckets), 1,
          grads_behind);
  } else if (!zero.shard_parameters) {
    // Stage 2 empties its buckets every micro-step.
    queue("reduce-scatter gradients", collective(cluster, dp, Collective::ReduceScatter, psi * element, buckets),
          micro_steps, grads_behind);
  }
  if (zero.shard_optimizer_states && !zero.shard_parameters)
    queue("all-gather updated parameters", collective(cluster, dp, Collective::AllGather, psi * element, gathers), 1, nothing);

  double shard = psi / ranks;  // elements each rank owns
  double regathered = 0;       // the fraction of the sharded parameters gathered again in backward
  if (zero.shard_parameters) {
    const double persistent = double(model.persistent_parameters) / tp;
    const double sharded = std::max(0.0, psi - persistent);
    const double blocks = model.forward_block_order.empty() ? double(std::max<int64_t>(1, model.layers) + 1)
                                                            : double(model.forward_block_order.size());
    const double kept =
        !model.forward_block_order.empty()
            ? double(kept_at_turn(model.forward_block_order, model.block_gathered, zero.stage3_max_reuse_distance)) / tp
            : double(kept_at_turn_equal_blocks(int64_t(sharded), std::max<int64_t>(1, model.largest_block / tp),
                                               zero.stage3_max_reuse_distance));
    // The gatherer prefetches at least the next block, however large, while a positive
    // stage3_prefetch_bucket_size and the live-parameter budget allow (zero/parameter_gatherer.cpp).
    const bool prefetch = zero.stage3_prefetch_bucket_size > 0 && zero.stage3_max_live_parameters > model.largest_block;
    // With hpZ only the first micro-step's forward reads the primary partition; every later gather
    // until the optimizer step reads the secondary one (zero/parameter_gatherer.cpp).
    Group secondary = dp;
    if (hpz > 1) secondary = Group{std::min(hpz, dp.per_node), 1};
    const double primary_forwards = hpz > 1 ? 1 : micro_steps;
    auto forward_gathers = [&](const Group& group, double times, const std::string& suffix) {
      const Transfer gather = collective(cluster, group, Collective::AllGather, sharded * element, blocks);
      // The first block's gather has nothing to hide behind.
      Transfer first{gather.seconds / blocks, gather.bytes / blocks};
      Transfer rest{gather.seconds - first.seconds, gather.bytes - first.bytes};
      queue("all-gather parameters (forward, first block" + suffix + ")", first, times, nothing);
      queue("all-gather parameters (forward" + suffix + ")", rest, times, prefetch ? in_forward : nothing);
    };
    forward_gathers(dp, primary_forwards, "");
    if (micro_steps > primary_forwards)
      forward_gathers(secondary, micro_steps - primary_forwards, ", later micro-steps, within the secondary partition");
    const double again = std::max(0.0, sharded - kept);
    regathered = sharded > 0 ? again / sharded : 0;
    if (again > 0) {
      const double count = blocks * again / std::max(1.0, sharded);
      queue(hpz > 1 ? "all-gather parameters (backward, within the secondary partition)"
                    : "all-gather parameters (backward)",
            collective(cluster, secondary, Collective::AllGather, again * element, count), micro_steps,
            prefetch ? HiddenBehind::Backward : nothing);
    }
    if (hpz > 1)
      st.notes.push_back(fmt::format(
          "hpZ{}: the gathers after the first micro-step's forward stay within groups of {} ranks{}", hpz_configured ? "" : " what-if",
          hpz, again > 0 || micro_steps > 1 ? "" : " (none here: every block stays gathered through backward, one micro-step)"));
    queue("reduce-scatter gradients", collective(cluster, dp, Collective::ReduceScatter, sharded * element, blocks),
          micro_steps, grads_behind);
    if (persistent > 0)
      queue("all-reduce persistent gradients", collective(cluster, dp, Collective::AllReduce, persistent * element, 1),
            micro_steps, grads_behind);
    shard = sharded / ranks + persistent / ranks;
  }
  if (tp > 1) {
    // Megatron: two all-reduces of the layer's activations in forward and two in backward (and
    // two more when full recomputation runs the forward again), within the node, not overlapped.
    const Group tensor{tp, 1};
    const double activation = tokens * double(model.hidden) * element;
    const double count = 2.0 * double(std::max<int64_t>(1, model.layers));
    queue("tensor-parallel all-reduces (forward)", collective(cluster, tensor, Collective::AllReduce, activation, 1),
          micro_steps * count, nothing);
    queue("tensor-parallel all-reduces (backward)", collective(cluster, tensor, Collective::AllReduce, activation, 1),
          micro_steps * count * (recompute == Recompute::Full ? 2 : 1), nothing);
  }

  // --- offload traffic -------------------------------------------------------------------------
  const double node_share = double(cluster.devices_per_node) / tp;  // ranks of a node stepping on its host
  const bool host_step = opt != OffloadTarget::None && gpu;          // the optimizer runs on the CPUs
  if (host_step || (gpu && param != OffloadTarget::None)) {
    if (!(r.host_device_bandwidth > 0))
      throw ConfigError("cluster rates: offload to the host needs host_device_bandwidth (PCIe); found none");
  }
  if (host_step) {
    Transfer down{shard * element / r.host_device_bandwidth, shard * element};
    queue("gradients to the host", down, zero.shard_gradients ? micro_steps : 1, grads_behind, true);
    Transfer up{shard * element / r.host_device_bandwidth, shard * element};
    queue("parameters to the device", up, 1, nothing, true);
  }
  if (param != OffloadTarget::None && zero.shard_parameters) {
    const double passes = 1.0 + regathered;  // every gather reads its shard from the host first
    if (gpu) {
      Transfer in{shard * element / r.host_device_bandwidth, shard * element};
      queue("parameter shards to the device", in, micro_steps * passes, in_forward, true);
    }
    if (param == OffloadTarget::Nvme) {
      if (!(r.nvme_read_bandwidth > 0 && r.nvme_write_bandwidth > 0))
        throw ConfigError("cluster rates: offload to nvme needs the NVMe read and write bandwidths; found none");
      Transfer read{node_share * shard * element / r.nvme_read_bandwidth, shard * element};
      queue("parameter shards from NVMe", read, micro_steps * passes, in_forward, true);
      Transfer write{node_share * shard * element / r.nvme_write_bandwidth, shard * element};
      queue("updated parameter shards to NVMe", write, 1, nothing, true);
    }
  }

  // --- the optimizer step ----------------------------------------------------------------------
  const double owned = zero.shard_optimizer_states ? shard : psi;
  double optimizer = 0;
  if (host_step) {
    if (!(r.host_adam_rate > 0)) throw ConfigError("cluster rates: optimizer offload needs host_adam_rate; found none");
    optimizer = node_share * owned / r.host_adam_rate;
  } else {
    optimizer = owned * (mixed ? kAdamBytesMixed : kAdamBytesFp32) / r.device_memory_bandwidth;
  }
  double optimizer_exposed = optimizer;
  if (opt == OffloadTarget::Nvme) {
    if (!(r.nvme_read_bandwidth > 0 && r.nvme_write_bandwidth > 0))
      throw ConfigError("cluster rates: offload to nvme needs the NVMe read and write bandwidths; found none");
    // Sub-groups are read, stepped and written back in a pipeline: the slower side sets the pace.
    const double bytes = node_share * owned * kOptimizerStateBytes;
    const double swap = bytes / r.nvme_read_bandwidth + bytes / r.nvme_write_bandwidth;
    st.offload += swap;
    st.terms.push_back({"optimizer states through NVMe", swap, std::max(0.0, swap - optimizer), 2 * owned * kOptimizerStateBytes});
    optimizer_exposed = std::max(optimizer, swap);
  }
  st.optimizer = optimizer;
  st.terms.push_back({host_step ? "optimizer step on the host" : "optimizer step", optimizer, optimizer, 0});

  // --- overlap ---------------------------------------------------------------------------------
  // A transfer issued once per step (times 1) runs in the boundary micro-step only.
  for (const Pending& p : pending) {
    if (p.behind == nothing) continue;
    Phase& phase = p.behind == in_forward ? fwd : bwd;
    if (p.times == 1 && micro_steps > 1)
      phase.boundary += p.t.seconds;
    else
      phase.each += p.t.seconds * p.times / micro_steps;
  }
  const double fwd_hidden = fwd.hidden(r.overlap, micro_steps), bwd_hidden = bwd.hidden(r.overlap, micro_steps);
  double exposed = 0;
  for (const Pending& p : pending) {
    const double seconds = p.t.seconds * p.times;
    const double hidden = p.behind == nothing ? 0.0 : p.behind == in_forward ? fwd_hidden : bwd_hidden;
    StepTimeTerm term{p.name, seconds, seconds * (1 - hidden), p.t.bytes * p.times};
    exposed += term.exposed;
    (p.offload ? st.offload : st.communication) += seconds;
    st.terms.push_back(term);
  }
  st.exposed = exposed + (optimizer_exposed - optimizer);
  st.total = st.compute + optimizer + st.exposed;
  const double global_tokens = tokens * micro_steps * double(world) / tp;
  st.tokens_per_second = global_tokens / st.total;
  st.model_flops_per_device = micro_steps * 3 * forward_flops * per_device / st.total;
  st.executed_flops_per_device = micro_steps * (3 * forward_flops + recompute_flops) * per_device / st.total;
  if (r.overlap < 1 && (fwd.each + fwd.boundary > 0 || bwd.each + bwd.boundary > 0))
    st.notes.push_back(fmt::format("{:.0f}% of the overlappable communication can hide behind compute on these devices",
                                   100 * r.overlap));
  return st;
}

}  // namespace zt
