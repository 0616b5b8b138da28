#include "zerotrain/memory/estimate.h"

#include "layout/offload_plan.h"
#include "layout/reuse_distance.h"
#include "memory/estimate_report.h"
#include "memory/llama_estimate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "zerotrain/config/config.h"
#include "zerotrain/error.h"
#include "zerotrain/memory/memory.h"
#include "zerotrain/config/gpt_config.h"

namespace zt {
namespace {

constexpr int64_t kMiB = 1 << 20;
// Measured with the CPU build (AMD EPYC, 2 ranks): the first training step of a model with 75k parameters
// raises a rank's resident set by 18 MiB over its pre-model baseline, whatever the stage,
// precision or world size (library code and caches first touched; docs/memory.md "runtime").
// 1.5 MiB of it, the collectives' code, is now in the baseline: the ranks' agreement on their
// configuration is the first collective, before the baseline is read.
constexpr int64_t kCpuRuntimeBytes = 33 * kMiB / 2;
// What a 16-bit run adds to that on CPU: LibTorch's 16-bit kernels and their caches. Measured as
// the bf16 peak above the fp32-calibrated estimate, 10.5-13 MiB and constant over micro-batches
// 4-32, 2-8 layers and widths 128-256 (AMD EPYC with AVX512_BF16; 9-11 MiB on an Intel Xeon
// without it). On a CPU without AVX-512 (AMD EPYC with AVX2 only), where LibTorch runs 16-bit
// products in plain loops, the same runs peaked within 2 MiB of the estimate without the term:
// it is counted only where this CPU has AVX-512; docs/memory.md "runtime".
constexpr int64_t kCpuSixteenBitRuntimeBytes = 11 * kMiB;
// CPU ranks sharing a machine exchange collectives through one shared-memory segment of two 1 MiB
// slots per rank (src/comm/shared_memory.h kSlotBytes), used in turn. A slot's pages become
// resident as far as the largest message written to it, and every rank maps every rank's slots:
// a rank's resident set holds, per rank of the node, two slots filled up to the run's largest
// collective (measured with 2 ranks: RssShmem 4 MiB where gradient buckets exceed a slot, 1.5 MiB
// for a model of 120k fp32 parameters, whose largest message is its 0.46 MiB of gradients).
constexpr int64_t kCpuSharedMemorySlotBytes = 1 * kMiB;
bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}
// A CUDA context with LibTorch's kernels loaded; not measured here (no GPU), the commonly
// reported size on recent data-centre GPUs. Override with EstimateOptions::runtime_bytes.
constexpr int64_t kCudaRuntimeBytes = 512 * kMiB;
// The most fp32 initial values the engine holds at once with replicated parameters
// (src/zero/engine.cpp kInitialValuesChunk).
constexpr int64_t kInitialValuesChunkElements = int64_t{1} << 20;
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The partition's shape when the model's parameter list is unknown: stage 3's blocks of
// largest_block elements (or block_gathered's), its persistent parameters in one bucket of their
// own, and every block cut into buckets of at most `bucket_limit` elements; stages 1-2 the whole
// model in such buckets. Each bucket padded as compute_layout pads it (zerotrain/layout/layout.h).
FlatLayout approximate_partition_shape(const ModelFigures& model, bool shard_parameters, int world,
                                       int64_t bucket_limit) {
  const int64_t psi = model.parameters;
  std::vector<std::pair<int64_t, int>> pieces;  // elements, group
  if (shard_parameters) {
    const int64_t persistent = std::min(psi, model.persistent_parameters);
    std::vector<int64_t> blocks = model.block_gathered;
    if (blocks.empty()) {
      const int64_t block = std::max<int64_t>(1, model.largest_block > 0 ? model.largest_block : psi);
      for (int64_t left = psi - persistent; left > 0; left -= block) blocks.push_back(std::min(block, left));
    }
    for (size_t b = 0; b < blocks.size(); ++b) pieces.push_back({blocks[b], int(b)});
    if (persistent > 0) pieces.push_back({persistent, -1});
  } else {
    pieces.push_back({psi, -1});
  }
  FlatLayout shape;
  shape.world_size = world;
  LayoutOptions defaults;
  shape.alignment = defaults.alignment;
  const int64_t unit = int64_t(world) * shape.alignment;
  for (const auto& [numel, group] : pieces)
    for (int64_t done = 0; done < numel; done += bucket_limit) {
      BucketLayout b;
      b.parameter_numel = std::min(bucket_limit, numel - done);
      b.numel = ceil_div(b.parameter_numel, unit) * unit;
      b.shard_numel = b.numel / world;
      b.offset = shape.total_numel;
      b.partition_offset = shape.partition_numel;
      b.group = group;
      shape.buckets.push_back(b);
      shape.total_numel += b.numel;
      shape.partition_numel += b.shard_numel;
      shape.parameter_numel += b.parameter_numel;
    }
  return shape;
}

// The partition the engine lays out for `model`: exact from its parameter list (stage 3's blocks
// and order as the engine assigns them), approximate otherwise.
FlatLayout partition_shape(const ModelFigures& model, const TrainConfig& config, int64_t bucket_limit) {
  const ZeroConfig& zero = config.zero;
  const int world = zero.shard_optimizer_states ? config.data_parallel_size() : 1;
  if (model.parameter_list.empty() || model.parameter_list.size() != model.parameter_owner.size())
    return approximate_partition_shape(model, zero.shard_parameters, world, bucket_limit);
  std::vector<ParameterSpec> specs = model.parameter_list;
  if (zero.shard_parameters) {
    const Stage3Blocks blocks =
        assign_stage3_blocks(specs, model.parameter_owner, zero.stage3_param_persistence_threshold);
    std::vector<ParameterSpec> ordered;
    for (size_t i : blocks.order) ordered.push_back(specs[i]);
    specs = std::move(ordered);
  }
  LayoutOptions options;
  options.world_size = world;
  options.bucket_size = std::max<int64_t>(1, zero.reduce_bucket_size);
  return compute_layout(specs, options);
}

OffloadTarget target_of(OffloadDevice device) {
  return device == OffloadDevice::Cpu ? OffloadTarget::Cpu : device == OffloadDevice::Nvme ? OffloadTarget::Nvme
                                                                                        : OffloadTarget::None;
}

}  // namespace

const char* to_string(DeviceKind kind) { return kind == DeviceKind::Cpu ? "cpu" : "cuda"; }

OffloadTarget parse_offload_target(const std::string& text, const std::string& what) {
  if (text == "none") return OffloadTarget::None;
  if (text == "cpu") return OffloadTarget::Cpu;
  if (text == "nvme") return OffloadTarget::Nvme;
  throw ConfigError(fmt::format("{}: expected none, cpu or nvme, found '{}'", what, text));
}

DeviceKind parse_device_kind(const std::string& text, const std::string& what) {
  if (text == "cpu") return DeviceKind::Cpu;
  if (text == "cuda" || text == "gpu") return DeviceKind::Cuda;
  throw ConfigError(fmt::format("{}: expected cpu or cuda, found '{}'", what, text));
}

Recompute parse_recompute(const std::string& name, const std::string& what) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full})
    if (name == to_string(r)) return r;
  throw ConfigError(fmt::format("{}: expected none, selective or full, found \"{}\"", what, name));
}

Recompute recompute_of(const TrainConfig& config) {
  const std::string& policy = config.activation_checkpointing.policy;
  return policy == "auto" ? Recompute::None : parse_recompute(policy, "activation_checkpointing.policy");
}

ActivationBytes transformer_activation_bytes(const ModelFigures& m, int64_t micro_batch, int element_bytes,
                                             Recompute recompute) {
  if (m.family == ModelFigures::Family::Llama) return llama_activation_bytes(m, micro_batch, element_bytes, recompute);
  ActivationBytes bytes;
  if (!m.has_shape() || micro_batch <= 0) return bytes;
  const int64_t e = element_bytes, s = m.sequence_length, b = micro_batch, h = m.hidden, V = m.vocabulary;
  const int64_t a = m.heads > 0 ? m.heads : std::max<int64_t>(1, h / 64);
  const int64_t sbh = s * b * h;
  const bool dropout = m.dropout > 0;
  // Split over a tensor group of P (docs/tensor_parallel.md), a rank keeps the attention's and the
  // MLP's tensors for its heads and features (q, k, v, the attention output, the MLP's 4h-wide
  // tensors: sbh_split each, and the scores of its a / P heads), and the layer norms' inputs and
  // outputs, the dropout masks of the residual branches and the block inputs whole (replicated).
  const int64_t P = std::max<int64_t>(1, m.tensor_parallel);
  const int64_t sbh_split = sbh / P, a_split = std::max<int64_t>(1, a / P);
  // Per layer (docs/memory.md "activations"): Korthikanti et al. (arXiv:2205.05198) eq. 1, sbh(34 + 5as/h)
  // bytes in 16-bit with 1-byte dropout masks, adapted to the kernels this LibTorch runs:
  // - without dropout, attention runs the fused (flash) kernel, which keeps its output and a
  //   log-sum-exp per row instead of the as² score, softmax and mask terms: 16·e·sbh + 4·abs;
  // - with dropout, attention runs the unfused kernel: scaled q, k, a copy of v, the softmax
  //   output, its mask and the dropped scores (3·e·as²b), and CPU dropout masks are e bytes
  //   (a scaling tensor of the activation's dtype), not 1: 18·e·sbh + 3·e·as²b.
  // Both add LayerNorm's fp32 mean and rstd (2 × 2 × 4·bs).
  // Of the 16 (18) sbh: 4 (6 with the two residual masks) replicated, 12 split.
  const int64_t layer_norm_stats = 16 * s * b;
  const int64_t per_layer = dropout ? e * (6 * sbh + 12 * sbh_split) + 3 * e * a_split * s * s * b + layer_norm_stats
                                    : e * (4 * sbh + 12 * sbh_split) + 4 * a_split * s * b + layer_norm_stats;
  // The head and loss run over chunks of c tokens (model.loss_chunk_tokens); with full
  // recomputation each chunk's log-softmax is freed after forward and recomputed in backward.
  const int64_t tokens = s * b;
  const bool chunked = m.loss_chunk_tokens > 0 && tokens > m.loss_chunk_tokens;
  const int64_t c = chunked ? m.loss_chunk_tokens : tokens;
  const bool head_recomputed = chunked && recompute == Recompute::Full;
  // The CPU generator's state, kept by each checkpoint (and the split region's, used with dropout).
  const int64_t generator_state = 5056 * (dropout && P > 1 ? 2 : 1);
  const int64_t log_softmax = head_recomputed ? 0 : 4 * tokens * V;
  // Outside the layers: token ids (int64) for the embedding's backward, ln_f's input and output,
  // the embedding dropout's mask, and the fp32 log-softmax of the logits (the loss is fp32).
  const int64_t outside = 8 * s * b + 2 * e * sbh + (dropout ? e * sbh : 0) + log_softmax;
  // Selective recomputation (src/models/gpt.cpp) keeps q, k, v and the attention output but not
  // the kernel's internals (fused: the log-sum-exp; unfused: the scaled q, k and v copies, the
  // scores, softmax, mask and dropped scores), nor GELU's 4h-wide output.
  const int64_t selective_layer = dropout ? per_layer - 3 * e * a_split * s * s * b - 4 * e * sbh_split
                                          : e * (4 * sbh + 8 * sbh_split) + layer_norm_stats;
  if (recompute == Recompute::Full) {
    // partition_activations: each rank keeps its 1/P of the (replicated) block inputs.
    const int64_t kept_input = m.partition_activations ? (sbh + P - 1) / P : sbh;
    bytes.saved = m.layers * (e * kept_input + generator_state) + outside;
  } else if (recompute == Recompute::Selective) {
    bytes.saved = m.layers * (selective_layer + generator_state) + outside;
  } else {
    bytes.saved = m.layers * per_layer + outside;
  }
  // Backward's working set on top of the saved tensors: the largest of three moments (checked
  // against the bytes allocated, tests/estimate_test.cpp). At the loss, the log-softmax's
  // gradient and its input's gradient, both fp32 [sb, V] (plus a 16-bit copy). At the tied head,
  // the embedding's fresh V·h weight gradient before autograd adds it into its arena (the logits'
  // gradient has replaced the freed log-softmax output). Inside the last layer, the incoming
  // h-wide gradient, the 4h-wide gradients around GELU and the MLP's fresh 4h² weight gradient
  // (and two as²b score gradients unfused), by when the tensors saved outside the layers are freed.
  // Chunked, these are one chunk's (a recomputed chunk's log-softmax is live with its gradients).
  const int64_t at_loss = (head_recomputed ? 12 : 8) * c * V + (e < 4 ? e * c * V : 0);
  const int64_t at_head = e * V * h + (e < 4 ? e * c * V : 0);
  const int64_t in_layer = e * (sbh + 4 * sbh_split) + 4 * e * h * h / P + (dropout ? 2 * e * a_split * s * s * b : 0) -
                           (2 * e * sbh + log_softmax);
  // At the end of backward, with the saved tensors freed: the tied embedding's gradient from the
  // head waits in autograd's input buffer for the embedding's own (dense, V·h) and the two are
  // summed: three V·h tensors (measured on GPT-2 124M at micro-batch 1, docs/memory.md).
  const int64_t at_embedding = 3 * e * V * h - bytes.saved;
  bytes.transient = std::max({at_loss, at_head, in_layer, at_embedding});
  // Recomputation adds, in one layer's backward, what that layer did not keep: all of it (full),
  // or its attention internals and GELU output (selective); measured in tests/estimate_test.cpp.
  if (recompute == Recompute::Full) bytes.transient += per_layer;
  // Unfused (dropout), backward frees the recomputed scores while it makes their gradients: half
  // of them are live at once (measured).
  if (recompute == Recompute::Selective) bytes.transient += (per_layer - selective_layer) / (dropout ? 2 : 1);
  return bytes;
}

namespace {

// The quantities the estimate's steps share, in the order they are worked out
// (docs/memory.md): the inputs resolved, the model-state terms, the buffers and the offload plan.
struct EstimateTerms {
  const ModelFigures& model;
  const ClusterSpec& cluster;
  const TrainConfig& config;
  const ZeroConfig& zero;
  OffloadTarget offload_optimizer = OffloadTarget::None, offload_param = OffloadTarget::None;
  Recompute recompute = Recompute::None;
  int N = 1;
  int64_t psi = 0;
  bool mixed = false;
  int e = 4;  // bytes per working parameter and per gradient
  bool cpu_device = true;
  int64_t largest_parameter = 0, largest_block = 0;
  ModelStateBytes formula;
  int64_t persistent = 0, working_params = 0, secondary = 0;
  int64_t moments_per_parameter = 0, master_per_parameter = 0, master = 0, moments = 0;
  bool delayed = false, staged = false;
  int64_t largest_bucket = 0, comm_buffers = 0, optimizer_partition = 0;
  FlatLayout shape;
  OffloadPlan plan;
  int64_t conversion_chunk = 0, gathered = 0;
};

// The inputs checked and the devices and policy resolved (the options win over the configuration).
EstimateTerms resolve_inputs(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                             const EstimateOptions& options) {
  if (model.parameters <= 0)
    throw ConfigError(fmt::format("parameters: expected a positive count, found {}", model.parameters));
  if (cluster.nodes < 1 || cluster.devices_per_node < 1)
    throw ConfigError(fmt::format("nodes and devices per node: expected at least 1 each, found {} and {}",
                                  cluster.nodes, cluster.devices_per_node));
  if (cluster.world_size() != config.world_size)
    throw ConfigError(fmt::format("world size: the configuration was resolved for {} ranks, the cluster has {}",
                                  config.world_size, cluster.world_size()));
  if (model.tensor_parallel != config.tensor_parallel)
    throw ConfigError(fmt::format("tensor_parallel.autotp_size: the configuration splits the model over tensor groups "
                                  "of {}, the model figures are for groups of {}",
                                  config.tensor_parallel, model.tensor_parallel));
  EstimateTerms t{model, cluster, config, config.zero};
  const ZeroConfig& zero = config.zero;
  t.offload_optimizer = options.offload_optimizer.value_or(target_of(zero.offload_optimizer.device));
  t.offload_param = options.offload_param.value_or(target_of(zero.offload_param.device));
  t.recompute = options.recompute.value_or(recompute_of(config));
  if (t.offload_param != OffloadTarget::None && !zero.shard_parameters)
    throw ConfigError(fmt::format("--offload-param {}: parameters can be offloaded only when they are sharded "
                                  "(stage 3), found stage {}",
                                  to_string(t.offload_param), zero.stage));
  if (t.offload_optimizer != OffloadTarget::None && !zero.shard_optimizer_states)
    throw ConfigError(fmt::format("--offload-optimizer {}: optimizer states can be offloaded only when they are "
                                  "sharded (stage 1 or more), found stage {}",
                                  to_string(t.offload_optimizer), zero.stage));
  t.N = config.data_parallel_size();  // ZeRO shards over the data-parallel group
  t.psi = model.parameters;
  t.mixed = config.precision != Precision::FP32;
  t.e = t.mixed ? 2 : 4;
  t.cpu_device = cluster.device == DeviceKind::Cpu;
  t.largest_parameter = model.largest_parameter > 0 ? model.largest_parameter : t.psi;
  t.largest_block = std::min(t.psi, model.largest_block > 0 ? model.largest_block : t.psi);
  return t;
}

// Model states: the formula (docs/design.md "Memory per parameter", with the fp32 variant), plus
// the whole copies of persistent parameters that every rank keeps when parameters are sharded.
void model_state_terms(EstimateTerms& t) {
  const ZeroConfig& zero = t.zero;
  t.formula = model_state_formula(t.psi, t.N, t.config);
  t.persistent = zero.shard_parameters ? std::min(t.psi, t.model.persistent_parameters) : 0;
  t.working_params = t.formula.parameters + t.persistent * t.e;
  // hpZ's secondary partition (in the formula's parameters) stays on the device with offload too.
  t.secondary = zero.shard_parameters && zero.hpz_partition_size > 1 ? t.e * t.psi / zero.hpz_partition_size : 0;
  // The optimizer-state term split into its parts, each divided on its own (so each is exact).
  t.moments_per_parameter = model_state_bytes_per_parameter(t.config).optimizer_states - (t.mixed ? 4 : 0);
  // The delayed update keeps fp32 masters of their own in fp32 training too (docs/offload.md), and
  // so does optimizer offload with the model on a GPU, whose state the engine reaches through host
  // copies of the gradients (and of the working values, unless the parameters are offloaded too).
  t.delayed = zero.offload_optimizer.delayed_update && t.offload_optimizer != OffloadTarget::None;
  t.staged = t.offload_optimizer != OffloadTarget::None && !t.cpu_device;
  if (t.offload_param != OffloadTarget::None && !t.cpu_device && t.offload_optimizer == OffloadTarget::None)
    throw ConfigError(fmt::format("offload_param {}: with the model on a GPU, parameters are offloaded only with the "
                                  "optimizer state on the host too; expected offload_optimizer cpu or nvme, found none",
                                  to_string(t.offload_param)));
  t.master_per_parameter = keeps_fp32_masters(t.mixed, t.delayed, t.staged) ? 4 : 0;
  const int64_t opt_ranks = zero.shard_optimizer_states ? t.N : 1;
  t.master = t.master_per_parameter * t.psi / opt_ranks;
  t.moments = t.moments_per_parameter * t.psi / opt_ranks;
}

// Buffers (src/zero/engine.cpp): the largest bucket (stage 3's buckets never span blocks), and the
// engine's offload plan (layout/offload_plan.h) of this rank's partition: the sub-groups, the roles
// on NVMe and their files, the host buffers the tiers stream through.
void buffer_terms(EstimateTerms& t, MemoryEstimate& est) {
  const ZeroConfig& zero = t.zero;
  const int64_t bucket_limit = std::max<int64_t>(std::max<int64_t>(1, zero.reduce_bucket_size), t.largest_parameter);
  t.largest_bucket = std::min(bucket_limit, zero.shard_parameters ? t.largest_block : t.psi);
  if (zero.shard_gradients) {
    t.comm_buffers += (zero.overlap_comm ? 2 : 1) * t.largest_bucket * t.e;
    if (t.config.gradient_accumulation_steps > 1) t.comm_buffers += ceil_div(t.largest_bucket, t.N) * t.e;
  }
  t.optimizer_partition = zero.shard_optimizer_states ? ceil_div(t.psi, t.N) : t.psi;
  t.shape = partition_shape(t.model, t.config, bucket_limit);
  est.exact_partition =
      !t.model.parameter_list.empty() && t.model.parameter_list.size() == t.model.parameter_owner.size();
  OffloadPlanInput plan_input = offload_plan_input(t.config);
  plan_input.optimizer_on_nvme = t.offload_optimizer == OffloadTarget::Nvme;
  plan_input.parameters_on_nvme = t.offload_param == OffloadTarget::Nvme;
  plan_input.fp32_masters = t.master_per_parameter > 0;
  plan_input.moments = optimizer_moment_arrays(t.config);
  plan_input.delayed = t.delayed;
  plan_input.staged = t.staged;
  plan_input.parameters_on_host = t.offload_param != OffloadTarget::None && !t.cpu_device && zero.shard_parameters;
  plan_input.host_step = t.cpu_device || t.offload_optimizer != OffloadTarget::None;
  t.plan = plan_offload(t.shape, plan_input);
  est.nvme_load_staging_per_rank = t.plan.load_staging_optimizer + t.plan.load_staging_parameters;
  est.offload_host_buffers_per_rank = t.plan.host.total();
  if (!est.exact_partition && (plan_input.optimizer_on_nvme || plan_input.parameters_on_nvme))
    est.notes.push_back("the partition's shape is approximated from the model's counts (blocks of the largest "
                        "block's size), so the NVMe bytes and the offload buffers are approximate; the reference "
                        "GPT's are exact");
  // fp32 chunk through which the CPU kernels read 16-bit gradients (none for the device kernels).
  t.conversion_chunk = t.plan.host.conversion_scratch;
}

// What the shared-memory segment of a node's CPU ranks holds in each rank's resident set: two
// slots per rank filled up to the largest message, the gradient bucket reduced or the shard of
// parameters published (a tensor group's activation messages: whole slots).
int64_t shared_memory_bytes(const EstimateTerms& t, const ClusterSpec& cluster) {
  if (cluster.devices_per_node <= 1) return 0;
  const int64_t published = std::min(ceil_div(t.psi, t.N), std::max<int64_t>(1, t.zero.allgather_bucket_size));
  const int64_t largest_message =
      t.config.tensor_parallel > 1 ? kCpuSharedMemorySlotBytes : std::max(t.largest_bucket, published) * t.e;
  return 2 * std::min(kCpuSharedMemorySlotBytes, largest_message) * cluster.devices_per_node;
}

// Stage 3: the gather pool keeps released blocks for reuse within twice the largest block; blocks
// live at once are the one computing plus those prefetched ahead, which the engine launches while
// fewer than min(stage3_prefetch_bucket_size, stage3_max_live_parameters minus the elements live)
// elements are in flight: with the transformer's equal blocks, that budget rounded up to whole
// blocks, never more than the model. docs/memory.md "Buffers and runtime".
//
// Blocks kept gathered for their reuse (stage3_max_reuse_distance, layout/reuse_distance.h) are all
// live at the turn from forward to backward, beside the block computing and those prefetched with
// what the live limit leaves; never more than every block.
int64_t gathered_bytes(const EstimateTerms& t) {
  const ZeroConfig& zero = t.zero;
  if (!zero.shard_parameters) return 0;
  const int64_t block = std::max<int64_t>(1, t.largest_block);
  // The live limit counts the block computing too.
  const int64_t budget =
      std::max<int64_t>(0, std::min(zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters - block));
  const int64_t ahead = ceil_div(budget, block) * block;
  const int64_t live = std::min(t.psi, t.largest_block + ahead);
  const int64_t all_blocks = std::max<int64_t>(block, t.psi - t.persistent);
  const int64_t reuse = zero.stage3_max_reuse_distance;
  const int64_t kept = !t.model.forward_block_order.empty()
                           ? kept_at_turn(t.model.forward_block_order, t.model.block_gathered, reuse)
                           : kept_at_turn_equal_blocks(all_blocks, block, reuse);
  int64_t at_turn = 0;
  if (kept > 0) {
    const int64_t turn_budget = std::max<int64_t>(
        0, std::min(zero.stage3_prefetch_bucket_size, zero.stage3_max_live_parameters - kept - block));
    at_turn = std::min(all_blocks, kept + block + ceil_div(turn_budget, block) * block);
  }
  return std::max({2 * t.largest_block, live, at_turn}) * t.e;
}

// The optimizer state's offload: what leaves the device and where it goes, per rank.
void offload_optimizer_state(const EstimateTerms& t, RoleBytes& device, RoleBytes& host_per_rank, MemoryEstimate& est) {
  const OffloadPlan& plan = t.plan;
  if (t.offload_optimizer == OffloadTarget::Cpu && !t.cpu_device) {
    // ZeRO-Offload: fp32 masters and moments leave the device.
    host_per_rank.master_weights += t.master;
    host_per_rank.optimizer_moments += t.moments;
    device.master_weights = 0;
    device.optimizer_moments = 0;
  }
  // The step streams the disk sub-groups through buffer_count buffers, each holding every disk
  // role of the largest sub-group: masters, moments, the working shard (with parameters on NVMe
  // too: the fp32 master in fp32 training, the 16-bit result otherwise) and the gradients.
  host_per_rank.buffers += plan.host.optimizer_stream;
  if (t.offload_optimizer == OffloadTarget::Nvme) {
    const OffloadOptimizerConfig& o = t.zero.offload_optimizer;
    // Elements of the partition whose state is on NVMe: whole sub-groups (offload_optimizer.ratio).
    const int64_t state_on_nvme = plan.optimizer_elements_on_disk;
    const int64_t in_memory = std::max<int64_t>(0, t.optimizer_partition - state_on_nvme);
    est.nvme_per_rank.master_weights = plan.nvme.masters;
    est.nvme_per_rank.optimizer_moments = plan.nvme.moments;
    host_per_rank.master_weights += t.master_per_parameter * in_memory;
    host_per_rank.optimizer_moments += t.moments_per_parameter * in_memory;
    device.master_weights = 0;
    device.optimizer_moments = 0;
    const auto disk_groups = std::count(plan.optimizer_on_disk.begin(), plan.optimizer_on_disk.end(), 1);
    est.notes.push_back(fmt::format(
        "optimizer state on NVMe: {} of {} partition elements per rank ({} of {} sub-groups), streamed through {} "
        "buffers of {} B{}",
        state_on_nvme, t.shape.partition_numel, disk_groups, plan.groups.size(), o.buffer_count,
        plan.host.optimizer_stream / std::max(1, o.buffer_count),
        in_memory > 0 ? fmt::format("; {} elements' state stays in host memory (ratio {})", in_memory, o.ratio) : ""));
  }
}

// The gradients: the host copies of a GPU run with optimizer offload, and nvme_gradients.
void offload_gradients(const EstimateTerms& t, RoleBytes& device, RoleBytes& host_per_rank, MemoryEstimate& est) {
  const OffloadPlan& plan = t.plan;
  // With the model on a GPU, the state in host memory is reached through two host copies of the
  // partition in the working dtype, each allocated once at its exact size (page-locked with
  // pin_memory): the snapshot of the reduced gradients that the CPU step reads, and the updated
  // working values it writes for the copy back (docs/gpu.md "What lives where"). The fp32 chunk
  // through which the CPU kernels read 16-bit gradients is in host memory too.
  if (t.staged) {
    host_per_rank.gradients += plan.host.gradient_snapshot;
    host_per_rank.buffers += plan.host.next_working + t.conversion_chunk;
    device.buffers -= t.conversion_chunk;
    // The gradients stay on the device as well (the reduced partition at stage 2, the whole
    // gradients at stage 1): the snapshot is a copy of them (measured on an H200, docs/gpu.md).
  } else if (t.offload_optimizer != OffloadTarget::None && !t.cpu_device) {
    // The design's layout: the gradient partition the optimizer step reads goes to host memory as
    // fp32; sharded gradients are reduced in the buckets and copied out (stage 1 still all-reduces
    // the full gradients on the device before copying its partition out).
    host_per_rank.gradients += 4 * ceil_div(t.psi, t.N);
    if (t.zero.shard_gradients) device.gradients = 0;
  }
  if (plan.gradient_elements_on_disk > 0) {
    // docs/offload.md "Gradients on NVMe": the sub-groups whose state is on NVMe keep their
    // gradients there too; each gradient bucket buffer gets an aligned staging copy of a bucket's
    // disk sub-groups and a scratch shard.
    const int64_t moved = plan.gradient_elements_on_disk;
    est.nvme_per_rank.gradients += plan.nvme.gradients;
    if (t.cpu_device) device.gradients = std::max<int64_t>(0, device.gradients - t.e * moved);
    else host_per_rank.gradients = std::max<int64_t>(0, host_per_rank.gradients - (t.staged ? t.e : 4) * moved);
    const int64_t buffers = t.zero.overlap_comm ? 2 : 1;
    const int64_t shard_bytes = ceil_div(t.largest_bucket, t.N) * t.e;
    host_per_rank.buffers += plan.host.gradient_staging +
                             (t.config.gradient_accumulation_steps > 1 ? buffers - 1 : buffers) * shard_bytes;
  }
}

// The parameters' offload, and the delayed update's copies.
void offload_parameters(const EstimateTerms& t, RoleBytes& device, RoleBytes& host_per_rank, MemoryEstimate& est) {
  const OffloadPlan& plan = t.plan;
  // Persistent parameters and the secondary partition stay where they are.
  const int64_t shard = t.working_params - t.persistent * t.e - t.secondary;
  if (t.offload_param == OffloadTarget::Cpu && !t.cpu_device) {
    host_per_rank.parameters += shard;
    device.parameters = t.persistent * t.e + t.secondary;
  }
  if (t.offload_param != OffloadTarget::None && !t.cpu_device) {
    // Each gather copies the block's shards from the host into one of buffer_count slots of the
    // largest block's shard on the device first (docs/gpu.md "Parameter offload").
    const int slots = std::max(2, t.zero.offload_param.buffer_count);
    device.buffers += int64_t(slots) * ceil_div(t.largest_block, t.N) * t.e;
  }
  if (t.offload_param == OffloadTarget::Nvme) {
    // The block shards beyond max_in_cpu (whole blocks, the last ones kept) are in a file, read
    // into buffer_count buffers of one block's disk shards ahead of their gather.
    est.nvme_per_rank.parameters = plan.nvme.parameters;
    host_per_rank.parameters += std::max<int64_t>(0, shard - t.e * plan.parameter_elements_on_disk);
    host_per_rank.buffers += plan.host.parameter_reads;
    device.parameters = t.persistent * t.e + t.secondary;
  }
  // Staged with the parameters on the host: the next working copy has the partition's tiers.
  if (t.staged) est.nvme_per_rank.parameters += plan.nvme.next_parameters;
  if (t.delayed) {
    // The delayed update's snapshot of the owned gradients, and its second working copy of the
    // partition, which has the working shards' tiers; with the model on a GPU they are the host
    // copies counted above.
    if (!t.staged) {
      host_per_rank.buffers += plan.host.gradient_snapshot + plan.host.next_working;
      est.nvme_per_rank.parameters += plan.nvme.next_parameters;
    }
    est.notes.push_back("delayed parameter update: fp32 masters of their own, a snapshot of the owned gradients and "
                        "a second working copy of the partition");
  }
}

void policy_notes(const EstimateTerms& t, MemoryEstimate& est) {
  if (t.cpu_device && (t.offload_optimizer == OffloadTarget::Cpu || t.offload_param == OffloadTarget::Cpu))
    est.notes.push_back("on a CPU device, offloading to cpu moves nothing: it is the memory already in use");
  const std::string& retain = t.config.train.retain_freed_memory;
  if (t.cpu_device && (retain == "always" || (retain == "auto" && !t.zero.shard_parameters)))
    est.notes.push_back("the heap is retained (train.retain_freed_memory \"always\", or \"auto\" at stages 0-2) "
                        "and fragments: measured peaks ran 14-34% above this estimate (docs/memory.md); the "
                        "policy \"never\" keeps them within 10%");
  if (t.cpu_device && retain == "bounded")
    est.notes.push_back("freed tensor blocks are kept for reuse (train.retain_freed_memory \"bounded\", the default): "
                        "their pages never exceed the tensors' live peak, and measured peaks stay within 10% of this "
                        "estimate, as under \"never\" (docs/memory.md)");
  if (!t.model.has_shape())
    est.notes.push_back("activations not estimated: give the model's layers, hidden size, sequence length and "
                        "vocabulary (or a preset)");
}

// Construction: the model as built (fp32; whole, or under ShardedConstruction its shards plus one
// block), beside the engine's arenas, and the fp32 initial values unless fp32 parameters are
// adopted in place: a bucket with sharded parameters or masters on NVMe, a chunk of at most
// kInitialValuesChunkElements otherwise. With sharded parameters each bucket's working copy
// enters the gather pool, which keeps released blocks up to its limit from then on (for fp32 the
// initial values are that copy).
void construction_terms(const EstimateTerms& t, RoleBytes& device, RoleBytes& host_per_rank, MemoryEstimate& est) {
  const int64_t psi = t.psi;
  const int64_t as_built = t.zero.shard_parameters ? 4 * (ceil_div(psi, t.N) + t.largest_block) : 4 * psi;
  const bool in_place = !t.mixed && !t.zero.shard_parameters;
  const int64_t initial_values = t.zero.shard_parameters ? (t.mixed ? 4 * t.largest_bucket : 0) + t.gathered
                                 : in_place ? 0
                                 : t.plan.optimizer_elements_on_disk > 0
                                     ? 4 * t.largest_bucket  // masters in swap files: whole buckets
                                     : 4 * std::min(t.largest_bucket, kInitialValuesChunkElements);
  // The gradient arenas and the reducer's buckets are made after the initial values are in place,
  // when the model as built has been freed.
  const int64_t arenas = device.parameters + device.optimizer_states() + t.conversion_chunk;
  est.step_peak = device.step_peak();
  if (!t.cpu_device && t.zero.shard_parameters) {
    // Sharded parameters on a GPU: the blocks are built and sharded in host memory (as DeepSpeed's
    // zero.Init with a remote device does); the device receives the parameters outside the blocks
    // (fp32, moved with the rest of the model) and each bucket's initial values on their way into
    // the arenas, which with offload_param are in host memory.
    est.construction_peak = arenas + initial_values + 4 * t.persistent;
    host_per_rank.construction = as_built;
  } else {
    est.construction_peak = as_built + arenas + initial_values;
  }
  device.construction = std::max<int64_t>(0, est.construction_peak - est.step_peak);
}

// One node: its devices' host-side bytes (with CPU devices the devices' memory is host memory),
// and whether each place fits.
void node_totals(const ClusterSpec& cluster, bool cpu_device, const RoleBytes& host_per_rank, MemoryEstimate& est) {
  const int64_t dpn = cluster.devices_per_node;
  auto scale = [dpn](const RoleBytes& r) {
    RoleBytes s;
    s.parameters = dpn * r.parameters;
    s.gradients = dpn * r.gradients;
    s.master_weights = dpn * r.master_weights;
    s.optimizer_moments = dpn * r.optimizer_moments;
    s.activations = dpn * r.activations;
    s.buffers = dpn * r.buffers;
    s.gathered_blocks = dpn * r.gathered_blocks;
    s.runtime = dpn * r.runtime;
    s.data = dpn * r.data;
    s.construction = dpn * r.construction;
    return s;
  };
  est.per_host = scale(cpu_device ? est.per_device : host_per_rank);
  est.nvme_per_node = dpn * est.nvme_per_rank.total();
  if (!(cluster.headroom >= 0 && cluster.headroom < 1))
    throw ConfigError(fmt::format("headroom: expected a fraction in [0, 1), found {}", cluster.headroom));
  const auto usable = [&](int64_t capacity) { return int64_t(double(capacity) * (1.0 - cluster.headroom)); };
  if (cluster.device_memory > 0) est.fits_device = est.per_device.total() <= usable(cluster.device_memory);
  if (cluster.host_memory > 0) est.fits_host = est.per_host.total() <= usable(cluster.host_memory);
  est.fits_nvme = est.nvme_per_node == 0 || est.nvme_per_node <= cluster.nvme_bytes;
}

}  // namespace

MemoryEstimate estimate_memory(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                               const EstimateOptions& options) {
  EstimateTerms t = resolve_inputs(model, cluster, config, options);
  MemoryEstimate est;
  est.offload_optimizer = t.offload_optimizer;
  est.offload_param = t.offload_param;
  model_state_terms(t);
  buffer_terms(t, est);
  t.gathered = gathered_bytes(t);
  ModelFigures shape = model;
  shape.partition_activations = config.activation_checkpointing.partition_activations;
  const ActivationBytes acts =
      transformer_activation_bytes(shape, config.train_micro_batch_size_per_gpu, t.e, t.recompute);
  const int64_t shared_memory = t.cpu_device ? shared_memory_bytes(t, cluster) : 0;
  const int64_t runtime = options.runtime_bytes >= 0 ? options.runtime_bytes
                          : t.cpu_device ? kCpuRuntimeBytes + (t.mixed && cpu_has_avx512() ? kCpuSixteenBitRuntimeBytes : 0) +
                                               shared_memory
                                         : kCudaRuntimeBytes;
  RoleBytes device;
  device.parameters = t.working_params;
  device.gradients = t.formula.gradients;
  device.master_weights = t.master;
  device.optimizer_moments = t.moments;
  device.activations = acts.total();
  device.gathered_blocks = t.gathered;
  device.buffers = t.comm_buffers + t.conversion_chunk + t.gathered;
  device.runtime = runtime;
  // Offload: what leaves the device and where it goes, per rank (docs/memory.md "Offload"). On a
  // CPU device "cpu" is the memory it already uses, so only NVMe moves anything there; host memory
  // is then the device's memory, and everything placed in it is counted on the device.
  RoleBytes host_per_rank;
  offload_optimizer_state(t, device, host_per_rank, est);
  offload_gradients(t, device, host_per_rank, est);
  offload_parameters(t, device, host_per_rank, est);
  if (t.cpu_device) {  // host memory is the device's memory
    device.parameters += host_per_rank.parameters;
    device.gradients += host_per_rank.gradients;
    device.master_weights += host_per_rank.master_weights;
    device.optimizer_moments += host_per_rank.optimizer_moments;
    device.buffers += host_per_rank.buffers;
    host_per_rank = RoleBytes{};
  }
  policy_notes(t, est);
  construction_terms(t, device, host_per_rank, est);
  // The data is loaded before the model and held to the end: under both moments, in host memory.
  if (model.data_bytes < 0)
    throw ConfigError(fmt::format("data_bytes: expected >= 0, found {}", model.data_bytes));
  if (t.cpu_device) {
    device.data = model.data_bytes;
    est.step_peak += model.data_bytes;
    est.construction_peak += model.data_bytes;
  } else {
    host_per_rank.data = model.data_bytes;
  }
  est.per_device = device;
  node_totals(cluster, t.cpu_device, host_per_rank, est);
  return est;
}

}  // namespace zt
