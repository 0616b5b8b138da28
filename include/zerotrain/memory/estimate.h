// Memory estimate of a training configuration before it runs, and a planner over configurations
// (docs/memory.md has every formula, its source and its validation against measurement).
//
// Contract
// - Pure functions of plain data; nothing is allocated beyond the returned values; thread-safe.
// - Model-state terms are model_state_formula's exactly (memory.h), plus, with sharded
//   parameters, the whole copies of the small parameters every rank keeps (persistence
//   threshold). Activations follow Korthikanti et al. 2022 per layer, adapted term by term to the
//   kernels this LibTorch runs (docs/memory.md). Buffers follow the engine's own bucket, scratch
//   and stage-3 gather-pool sizes.
// - The peak is the larger of two moments: the training step (model states + activations +
//   buffers + runtime) and the model's construction (the model as built beside the engine's
//   arenas). `zerotrain train --summary` reports this same estimate beside the measured peak.
// - Offload (zero_optimization.offload_optimizer / offload_param) is the engine's own offload plan
//   (src/layout/offload_plan.h) of the model's partition: the NVMe tiers' files per role, their
//   host buffer pools and what stays in memory (ratio, max_in_cpu), by whole sub-groups and
//   blocks; docs/memory.md "Offload". The partition is exact for a model whose parameter list is
//   known (the reference GPT: gpt_model_figures; the Llama: llama_model_figures), so the NVMe
//   bytes and the host buffers equal what the engine creates; otherwise it is approximated from
//   the figures and a note says so.
// - Activation checkpointing (full or selective recomputation) is modelled as the engine and the
//   reference models run it (docs/activation_checkpointing.md).
#pragma once
#include "zerotrain/config/config.h"
#include "zerotrain/layout/layout.h"
#include "zerotrain/config/recompute.h"
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace zt {

struct TrainConfig;
struct GPTConfig;
struct LlamaConfig;

using OffloadTarget = OffloadDevice;  // zerotrain/config/config.h: none, cpu, nvme
enum class DeviceKind { Cpu, Cuda };
const char* to_string(DeviceKind kind);
// "none", "cpu", "nvme" / "cpu", "cuda"; throws ConfigError naming `what` otherwise.
OffloadTarget parse_offload_target(const std::string& text, const std::string& what);
DeviceKind parse_device_kind(const std::string& text, const std::string& what);

// What the estimate needs to know of a model. Element counts; 0 means unknown.
struct ModelFigures {
  int64_t parameters = 0;             // Ψ: trainable elements
  int64_t largest_block = 0;          // elements a stage-3 gather brings whole (persistent ones excluded)
  int64_t largest_parameter = 0;      // elements of the largest single tensor
  int64_t persistent_parameters = 0;  // elements kept whole on every rank with sharded parameters
  // Transformer shape (GPT-2 style): activations are estimated only when layers,
  // hidden, sequence_length and vocabulary are known.
  int64_t layers = 0, hidden = 0, heads = 0, sequence_length = 0, vocabulary = 0;
  double dropout = 0.0;
  int64_t loss_chunk_tokens = 0;  // the head and loss over at most this many tokens at a time (0: all)
  // Which decoder's tensors the activations follow: the GPT's (LayerNorm, a GELU MLP of 4·hidden,
  // the head tied to the embedding) or the Llama's (RMSNorm computed in fp32, grouped-query
  // attention with rotary embeddings, a SwiGLU MLP of `intermediate`, tied or not).
  enum class Family { Gpt, Llama };
  Family family = Family::Gpt;
  int64_t intermediate = 0;  // Llama: the SwiGLU width
  int64_t kv_heads = 0;      // Llama: key/value heads (0: heads)
  int64_t head_dim = 0;      // Llama: elements per head (0: hidden / heads)
  bool tied_head = true;     // the output head is the token embedding
  // Stage 3's block uses in forward order (block ids) and each block's gathered elements, for the
  // blocks kept gathered by stage3_max_reuse_distance; empty: unknown, taken as equal blocks of
  // largest_block.
  std::vector<int> forward_block_order;
  std::vector<int64_t> block_gathered;
  // The trainable parameters in registration order (names, shapes) and, per parameter, the
  // stage-3 marked module holding it (-1: none): the engine's exact partition shape
  // (assign_stage3_blocks, compute_layout). Empty: unknown, approximated from the counts above.
  std::vector<ParameterSpec> parameter_list;
  std::vector<int> parameter_owner;
  // Tensor parallelism (docs/tensor_parallel.md): the figures are one rank's of a tensor group of
  // this many (parameter counts and shapes its slices; the GPT only); the activations split as the
  // GPT splits them.
  int64_t tensor_parallel = 1;
  // activation_checkpointing.partition_activations: full recomputation keeps 1/tensor_parallel of
  // each block input per rank (estimate_memory sets it from the configuration).
  bool partition_activations = false;
  // Bytes the training data holds in each rank from set-up on (the trainer's figure:
  // zerotrain/train/train.h training_data_bytes): host memory, under both moments. 0: none counted.
  int64_t data_bytes = 0;
  bool has_shape() const { return layers > 0 && hidden > 0 && sequence_length > 0 && vocabulary > 0; }
};

// Exact figures of zerotrain's reference GPT (models/gpt.h) trained on `sequence_length` tokens,
// with stage 3's persistence threshold `persistence_threshold` (elements).
// `tensor_parallel`: one rank's figures of the GPT split over a tensor group of that many.
ModelFigures gpt_model_figures(const GPTConfig& gpt, int64_t sequence_length, int64_t persistence_threshold,
                               int64_t tensor_parallel = 1);
// The GPT a training configuration describes (preset plus the "model" block's overrides).
GPTConfig gpt_config_of(const TrainConfig& config);
// Exact figures of the Llama-family decoder (models/llama.h) trained on `sequence_length` tokens:
// parameters == llama_parameter_count(llama), its parameter list in registration order with each
// tensor's stage-3 block (the embedding, each layer, the final norm, the untied head).
// `tensor_parallel`: one rank's figures of the Llama split over a tensor group of that many
// (models/llama.h): its slices of the heads, features and vocabulary.
ModelFigures llama_model_figures(const LlamaConfig& llama, int64_t sequence_length, int64_t persistence_threshold,
                                 int64_t tensor_parallel = 1);

// What a cluster's devices and links sustain (achieved rates, not datasheet peaks): the inputs of
// the step-time model (zerotrain/memory/step_time.h, docs/step_time.md). 0 means unknown.
struct ClusterRates {
  double device_flops_fp32 = 0;        // FLOP/s per device on a transformer's matrix products in fp32
  double device_flops_16bit = 0;       // the same in bf16/fp16 (0: the fp32 rate, no 16-bit units)
  double device_memory_bandwidth = 0;  // bytes/s per device: the optimizer step and elementwise kernels
  double intra_node_bandwidth = 0;     // bytes/s: bus bandwidth of a collective among one node's devices
  double intra_node_latency = 0;       // seconds per ring step within a node
  double inter_node_bandwidth = 0;     // bytes/s leaving one node, all its network links together
  double inter_node_latency = 0;       // seconds per ring step across nodes
  // Gathering moves bytes only; reducing also adds them on the way. NCCL runs both at the link's
  // speed (1.0); Gloo on CPU ranks reduces on the cores the step computes on (below 1).
  double reduce_bandwidth_factor = 1.0;
  double host_device_bandwidth = 0;  // bytes/s per device each way (PCIe); unused with CPU devices
  double host_adam_rate = 0;         // parameters/s one node's CPUs step with the fused CPU Adam
  double nvme_read_bandwidth = 0, nvme_write_bandwidth = 0;  // bytes/s per node
  // The fraction of the communication the engine overlaps (bucket reductions during backward,
  // stage-3 prefetch) that can run concurrently with compute: 1 where collectives have their own
  // engines (GPUs with NCCL), about 0 where they take the cores the step computes on.
  double overlap = 1.0;
};

struct ClusterSpec {
  int nodes = 1;
  int devices_per_node = 1;
  DeviceKind device = DeviceKind::Cuda;
  int64_t device_memory = 0;  // bytes per device; 0: unknown (no fit check)
  int64_t host_memory = 0;    // bytes per node; 0: unknown
  int64_t nvme_bytes = 0;     // bytes per node; 0: none
  // Fraction of device and host memory a configuration must leave free to count as fitting:
  // allocator fragmentation and what no estimate sees (other processes, library workspaces).
  double headroom = 0.1;
  ClusterRates rates;  // for the step-time model; the memory estimate does not use them
  std::string name;    // the preset it came from ("" for a hand-made one)
  int world_size() const { return nodes * devices_per_node; }
};

// Choices that override the configuration's, and those a TrainConfig does not carry yet.
struct EstimateOptions {
  // nullopt: the configuration's zero_optimization.offload_optimizer / offload_param device. The
  // other offload settings (buffer_count, sub_group_size, ratio, buffer_size, max_in_cpu) always
  // come from the configuration.
  std::optional<OffloadTarget> offload_optimizer;
  std::optional<OffloadTarget> offload_param;
  // nullopt: the configuration's activation_checkpointing.policy ("auto" resolved by the caller
  // counts as none).
  std::optional<Recompute> recompute;
  int64_t runtime_bytes = -1;  // framework memory per process; -1: the default for the device kind
};

// Bytes of one place (a device, or one node's host memory) by role.
struct RoleBytes {
  int64_t parameters = 0;        // working parameters (fp32 or the 16-bit copy)
  int64_t gradients = 0;
  int64_t master_weights = 0;    // fp32 masters (mixed precision)
  int64_t optimizer_moments = 0;
  int64_t activations = 0;       // saved for backward plus backward's working memory at the peak
  int64_t buffers = 0;           // communication buckets, conversion chunk, gathered blocks
  int64_t gathered_blocks = 0;   // the stage-3 part of `buffers`
  int64_t runtime = 0;           // the framework itself (code, caches, device context)
  int64_t data = 0;              // the training data (ModelFigures::data_bytes); host memory only
  int64_t construction = 0;      // what building the model needs beyond the step's peak (0 if less)
  int64_t optimizer_states() const { return master_weights + optimizer_moments; }
  int64_t step_peak() const {
    return parameters + gradients + optimizer_states() + activations + buffers + runtime + data;
  }
  int64_t total() const { return step_peak() + construction; }  // the peak
};

struct ActivationBytes {
  int64_t saved = 0;      // tensors autograd keeps from forward to backward
  int64_t transient = 0;  // the largest working set backward adds on top of them
  int64_t total() const { return saved + transient; }
};

// Activation bytes per rank for one micro-batch of `micro_batch` sequences with `element_bytes`
// per activation (2 or 4); zero when the shape is unknown. Full recomputation keeps each layer's
// input and recomputes one layer at a time; selective keeps a layer's matrix-multiply outputs but
// not its attention internals and GELU output (docs/activation_checkpointing.md; the GPT only:
// for the Llama it counts as none, as the Llama refuses it).
ActivationBytes transformer_activation_bytes(const ModelFigures& model, int64_t micro_batch, int element_bytes,
                                             Recompute recompute);
// "none", "selective" or "full" (ConfigError naming `what` otherwise).
Recompute parse_recompute(const std::string& name, const std::string& what);
// The policy a configuration asks for ("auto" counts as none: the caller resolves it).
Recompute recompute_of(const TrainConfig& config);

struct MemoryEstimate {
  RoleBytes per_device;
  RoleBytes per_host;         // one node's host memory (with CPU devices: the devices' memory too)
  // One rank's files on NVMe by role (master_weights, optimizer_moments, gradients, parameters with
  // the delayed update's next working copy): the offload plan's, which the engine creates.
  RoleBytes nvme_per_rank;
  int64_t nvme_per_node = 0;
  // One rank's offload plan besides: what a checkpoint load stages beside the swap files, and the
  // host buffers the tiers stream through (OffloadReport::host_buffer_bytes); `exact_partition`
  // tells whether the partition's shape was the model's own or approximated.
  int64_t nvme_load_staging_per_rank = 0;
  int64_t offload_host_buffers_per_rank = 0;
  bool exact_partition = false;
  // What was estimated: the options' targets, else the configuration's devices.
  OffloadTarget offload_optimizer = OffloadTarget::None, offload_param = OffloadTarget::None;
  int64_t construction_peak = 0;  // per device, while the model is built and adopted
  int64_t step_peak = 0;          // per device, in a training step
  bool fits_device = true, fits_host = true, fits_nvme = true;
  bool fits() const { return fits_device && fits_host && fits_nvme; }
  std::vector<std::string> notes;  // assumptions and unsupported choices, one sentence each
};

// The estimate for `config` (switches, precision, optimizer, buckets, micro-batch) of `model` on
// `cluster` (whose world size must equal config.world_size). Throws ConfigError for impossible
// inputs (offloading parameters without sharding them, non-positive counts, a largest block
// shard beyond offload_param.buffer_size), naming the input.
MemoryEstimate estimate_memory(const ModelFigures& model, const ClusterSpec& cluster, const TrainConfig& config,
                               const EstimateOptions& options = {});

}  // namespace zt
