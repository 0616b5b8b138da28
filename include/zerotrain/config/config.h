// Training configuration: DeepSpeed's keys and defaults where DeepSpeed has them (docs/config.md),
// plus zerotrain's own top-level blocks "model", "data", "train" and "comm".
//
// Contract: load_config()/parse_config() either return a fully validated TrainConfig whose batch
// triple is consistent with the world size, or throw zt::ConfigError with a one-line message that
// names the key, the expected and the found value (unknown keys suggest the nearest valid key).
// Every leaf value records where it came from. Plain data; copyable; no hidden state.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace zt {

struct BertConfig;   // zerotrain/config/bert_config.h
struct LlamaConfig;  // zerotrain/config/llama_config.h

// Auto: the file said "auto" (the Hugging Face convention) and a rule of docs/config.md chose the value.
enum class ValueSource { Default, File, CommandLine, Derived, Auto };
const char* to_string(ValueSource source);

enum class Precision { FP32, BF16, FP16 };
const char* to_string(Precision precision);  // "fp32", "bf16", "fp16"

struct OptimizerConfig {
  std::string type = "Adam";  // "Adam" (AdamW unless adam_w_mode false), "AdamW", "Lamb", "SGD"
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;  // Adam, AdamW, Lamb
  double eps = 1e-8;                  // Adam, AdamW, Lamb
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // decoupled weight decay
  bool bias_correction = true;            // Adam, AdamW, Lamb
  double min_coeff = 0.01, max_coeff = 10.0;  // Lamb: trust-ratio clamp (DeepSpeed defaults)
  double momentum = 0.0, dampening = 0.0;     // SGD (torch.optim.SGD semantics)
  bool nesterov = false;                      // SGD
  // Lamb: DeepSpeed's FusedLamb clipping; accepted only where DeepSpeed zeroes it (outside fp16).
  double lamb_max_grad_norm = 0.0;
};

// DeepSpeed's learning-rate schedulers (deepspeed/runtime/lr_schedules.py) with their parameter
// names and defaults; which parameters a type takes: src/config/derive.cpp. Formulas:
// zerotrain/optim/lr_schedule.h.
struct SchedulerConfig {
  // "" (constant lr), "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"
  std::string type;
  // WarmupLR, WarmupDecayLR (warmup_num_steps and warmup_type also WarmupCosineLR)
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;      // WarmupLR: the optimizer's lr when not given (derived)
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" or "linear"; anything else runs "log" (noted), as DeepSpeed
  int64_t total_num_steps = 0;      // WarmupDecayLR, WarmupCosineLR (derived from train.steps when not given)
  double cos_min_ratio = 1e-4;      // WarmupCosineLR
  double warmup_min_ratio = 0.0;    // WarmupCosineLR
  // OneCycle. cycle_min_lr and cycle_max_lr have no default (required, as in DeepSpeed).
  std::optional<double> cycle_min_lr, cycle_max_lr;
  double decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000;
  std::optional<double> cycle_second_step_size;      // unset: cycle_first_step_size
  int64_t cycle_first_stair_count = 0;               // <= 0: continuous
  std::optional<int64_t> cycle_second_stair_count;   // unset: cycle_first_stair_count
  int64_t decay_step_size = 0;                       // 0: no decay after the cycle
  bool cycle_momentum = true;  // cycles beta1 (Adam, AdamW, Lamb); SGD has no betas: off, noted
  double cycle_min_mom = 0.8, cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

// Where a ZeRO-Offload / ZeRO-Infinity tier keeps its data (docs/offload.md).
enum class OffloadDevice { None, Cpu, Nvme };
const char* to_string(OffloadDevice device);  // "none", "cpu", "nvme"

// zero_optimization.offload_optimizer (DeepSpeed's keys and defaults): where the fp32 master
// weights and optimizer moments of this rank's partition live. Stages 1-3.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::None;
  std::string nvme_path;      // required for nvme: a writable directory
  bool pin_memory = true;     // page-locked host buffers (a CUDA device only; a note on CPU when given)
  int buffer_count = 4;       // nvme: aligned buffers the step streams sub-groups through
  bool pipeline_read = false, pipeline_write = false;  // nvme: overlap reads / writes with the step
  bool fast_init = false;     // nvme: initial state written straight from the model, not via a host copy
  double ratio = 1.0;         // fraction of the partition offloaded (the rest stays in memory)
  // zerotrain's own: the ZeRO-Offload paper's delayed parameter update (§5.2); the optimizer step
  // of step t runs during step t+1's forward and backward after `delayed_update_after` steps.
  bool delayed_update = false;
  int64_t delayed_update_after = 40;
  // zerotrain's own: with device nvme at stages 2-3, the reduced gradients of the sub-groups whose
  // state is on NVMe are written there as each bucket is reduced, and streamed in by the step.
  bool nvme_gradients = false;
};

// zero_optimization.offload_param: where this rank's stage-3 parameter shards live. Stage 3 only.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::None;
  std::string nvme_path;
  bool pin_memory = true;
  int buffer_count = 5;                // nvme: shard buffers (read-ahead depth in blocks)
  int64_t buffer_size = 100'000'000;   // nvme: elements per shard buffer (>= the largest block shard)
  int64_t max_in_cpu = 1'000'000'000;  // nvme: shard elements kept in host memory instead
};

// The "aio" block: the asynchronous I/O engine of the nvme tiers.
struct AioConfig {
  int64_t block_size = 1 << 20;  // bytes per request
  int queue_depth = 8;           // requests in flight
  int thread_count = 1;          // submitting threads
  bool single_submit = false;    // submit one request per call instead of a batch
  bool overlap_events = true;    // submit new requests while completions are reaped
};

struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  int64_t reduce_bucket_size = 500'000'000;  // elements
  int64_t allgather_bucket_size = 500'000'000;
  bool overlap_comm = false;
  // Stage 3 prefetch: a block is gathered ahead only if it has at most stage3_prefetch_bucket_size
  // elements (0: no prefetch) and the gathered elements stay within stage3_max_live_parameters.
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  int64_t stage3_max_live_parameters = 1'000'000'000;
  // Stage 3 release (DeepSpeed's rule): after its use in forward a block stays gathered when the
  // elements of the block uses between this use and its next one (the rest of forward, then
  // backward in reverse) are fewer than this; 0 releases every block after each use.
  // docs/zero.md "Stage 3".
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  // Stage 3: a trainable parameter with fewer elements stays gathered on every rank (its
  // optimizer state is still sharded); small tensors are not worth a collective each.
  int64_t stage3_param_persistence_threshold = 100'000;
  // ZeRO++'s hpZ: stage 3 keeps a secondary partition of each block over groups of this many
  // consecutive ranks (a node's), filled by a block's first gather after the parameters change;
  // later gathers of it (backward's, after a release) run within the group. 0 or 1: none.
  // docs/zero.md "hpZ".
  int hpz_partition_size = 1;
  // Elements per optimizer sub-group: the unit the nvme tier reads, steps and writes back.
  int64_t sub_group_size = 1'000'000'000;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  // The switches the engine composes (docs/design.md "Stages as switches"); derived from `stage`
  // when the configuration is read and never asked for by stage number elsewhere: stage 1 shards
  // optimizer states, stage 2 also gradients, stage 3 also parameters.
  bool shard_optimizer_states = false;
  bool shard_gradients = false;
  bool shard_parameters = false;
};

// Sets `zero.stage` and the switches it derives; the one place that maps a stage to switches.
void set_zero_stage(ZeroConfig& zero, int stage);

struct LossScaleConfig {  // the "fp16" block
  bool enabled = false;
  double loss_scale = 0.0;  // 0: dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1.0;
};

struct ModelConfig {
  // "gpt" (models/gpt.h), "bert" (models/bert.h: masked language modelling, docs/bert.md) or
  // "llama" (models/llama.h: Llama 2/3 and Qwen2 decoders, docs/llama.md).
  std::string type = "gpt";
  // A preset of the type: models/gpt.h's, bert_preset_names() ("bert-tiny" when model.type is
  // "bert" and no preset is given) or llama_preset_names() ("llama-tiny" for "llama").
  std::string preset = "tiny";
  // Overrides of the preset; 0 / negative means "from the preset".
  int64_t n_layer = 0, n_head = 0, n_embd = 0, vocab_size = 0, context_length = 0;
  // Llama only (refused with the other types): key/value heads of grouped-query attention and the
  // MLP's width; 0: the preset's.
  int64_t n_kv_head = 0, intermediate_size = 0;
  double dropout = -1.0;
  int64_t loss_chunk_tokens = 0;  // 0: the whole micro-batch at once (GPTConfig::loss_chunk_tokens)
  // A Hugging Face directory (config.json + model.safetensors, or sharded with
  // model.safetensors.index.json) whose weights start the run instead of the random
  // initialisation: GPT-2 for "gpt" (its config.json must match the model's shape), a
  // LlamaForCausalLM or Qwen2ForCausalLM for "llama" (its config.json is the shape). "": none.
  std::string init_from;
  // Llama only: a Hugging Face directory whose config.json alone gives the shape (the weights are
  // initialised at random). "": none.
  std::string config_from;
  // BERT only (refused with model.type "gpt"): pre-LN layers, and the next-sentence head and loss
  // (unset: the preset's, which is on for every BERT preset).
  bool pre_layer_norm = false;
  std::optional<bool> next_sentence;
};

struct DataConfig {
  // "embedded" (built-in corpus), "bin" (uint16/uint32 token file), "text" (a UTF-8 text file),
  // "jsonl" ({"text": ...} lines, needs `tokenizer`), "finetune" (prompt/response or chat
  // messages lines, needs `tokenizer`; docs/finetuning.md)
  std::string source = "embedded";
  std::string path;                 // the train file of "bin", the input file of the others
  std::string val_path;             // for "bin": optional held-out file
  double val_fraction = 0.1;        // held-out split when there is no val_path
  int64_t sequence_length = 0;      // 0: the model's context length (BERT: max_positions)
  // BERT's masking (MlmOptions, zerotrain/data/bert_data.h); refused with model.type "gpt".
  double mlm_probability = 0.15;    // share of each sequence's content positions predicted
  int64_t max_predictions = 0;      // cap per sequence; 0: none
  // A tokenizer.json (or a directory holding one): "text" and "jsonl" are tokenized with it at
  // load time (cached, docs/tokenizers.md "Tokenizing the training data"); "" with "text": bytes.
  std::string tokenizer;
  std::string cache_dir;            // where token caches go; "": beside the input file
  std::string eos_token;            // a token appended after each document / example; "": none
  std::string chat_template = "auto";  // "finetune" chat lines: "auto", "chatml", "llama3"
  // "finetune" with the GPT: several examples per sequence, each attending only to itself
  // (docs/finetuning.md "Packing").
  bool pack = false;
};

struct TrainLoopConfig {
  int64_t steps = 200;          // optimizer steps
  uint64_t seed = 1234;
  int64_t eval_interval = 0;    // 0: never
  int64_t eval_iters = 4;       // micro-batches per evaluation
  int threads = 0;              // intra-op threads per rank; 0: cores / local ranks
  std::string log_dir = "runs"; // CSV log, rank logs
  // What the process does with freed memory (docs/memory.md "The heap policy"): "bounded" keeps
  // freed tensor blocks for reuse within the live high-water mark (CpuBlockCache), "always" keeps
  // every freed page in glibc's heap, "auto" does so unless parameters are sharded, "never"
  // returns every block of 64 KiB or more to the OS.
  std::string retain_freed_memory = "bounded";
  // bf16/fp16 on a CPU where LibTorch has no fast 16-bit matrix multiply (bf16: no AVX-512 or
  // AMX): "auto" trains in fp32 and says so, "always" keeps the configured 16-bit precision
  // (docs/memory.md "Precision on CPUs without 16-bit units").
  std::string cpu_half_precision = "auto";
};

struct CommConfig {
  double timeout_seconds = 300.0;  // also ZT_COMM_TIMEOUT_SECONDS (config wins when set in file)
};

struct MonitorConfig {  // DeepSpeed's "csv_monitor"
  bool enabled = true;
  std::string output_path;  // "" : train.log_dir
  std::string job_name = "zerotrain";
};

// DeepSpeed's "activation_checkpointing" block, plus zerotrain's `policy`
// (docs/activation_checkpointing.md). The block given without a policy means "full", the
// recomputation DeepSpeed's checkpointing does; "auto" lets the run choose the cheapest policy
// whose estimated memory fits this machine.
struct ActivationCheckpointingConfig {
  std::string policy = "none";  // "none", "selective", "full", "auto"
  bool partition_activations = false;  // needs model parallelism: refused when true
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
  int64_t number_checkpoints = 0;  // 0 (or null): every block
};

// DeepSpeed's "flops_profiler" block (docs/config.md "Reporting"): at `profile_step` the run reports
// the model's FLOPs per step, the achieved FLOP/s per rank and the model FLOPs utilisation.
struct FlopsProfilerConfig {
  bool enabled = false;
  double recompute_fwd_factor = 0.0;  // extra forward passes counted for recomputation (0: none)
  int64_t profile_step = 1;           // the optimizer step profiled (1-based)
  int64_t module_depth = -1;          // depth of the per-module breakdown (-1: every level)
  int64_t top_modules = 1;            // modules listed per depth
  bool detailed = true;               // the per-module breakdown printed
  std::string output_file;            // "" (null): standard output
};

// DeepSpeed's "comms_logger" block: every collective counted, with its bytes and time, per
// operation; a table at the end of the run and a CSV beside the run's log.
struct CommsLoggerConfig {
  bool enabled = false;
  bool verbose = false;                 // one line per collective as it completes
  bool prof_all = true;                 // every operation; false: only those in prof_ops
  bool debug = false;                   // the calling site's label in each verbose line
  std::vector<std::string> prof_ops;    // operation names ("all_reduce", ...) when prof_all is false
};

// Gradient averaging across data-parallel ranks (DeepSpeed's top-level keys of the same names):
// the reduced gradient is the mean either way; these choose where the division happens, which
// matters for fp16 range.
struct GradientAveragingConfig {
  bool prescale_gradients = false;        // divide by the world size before the reduction
  double gradient_predivide_factor = 1.0; // else divide by this before, and by world/this after
};

struct TrainConfig {
  int world_size = 1;
  // Ranks per tensor group (tensor_parallel.autotp_size; DeepSpeed's 0 and 1 both mean none): the
  // world is a grid of world_size / tensor_parallel data-parallel groups (zerotrain/comm/comm.h
  // make_process_grid); the batch keys count data-parallel ranks, as in DeepSpeed.
  int tensor_parallel = 1;
  int data_parallel_size() const { return world_size / tensor_parallel; }
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  double gradient_clipping = 1.0;  // 0: off
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  Precision precision = Precision::FP32;
  // Under fp16/bf16, the model's floating-point buffers keep their own dtype (DeepSpeed 0.19's
  // rule: a rotary inv_freq stays fp32) unless data_types.buffer_dtype names one ("fp32", "fp16",
  // "bf16"; empty: keep). Buffers whose full names match a pattern of
  // data_types.keep_in_fp32_modules ('*' for any characters, matched anywhere in the name) stay
  // in, or return to, fp32. "auto" is no pattern here; the Python front end resolves it from the
  // model's own transformers lists.
  std::string buffer_dtype;
  std::vector<std::string> keep_in_fp32_buffers;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  LossScaleConfig fp16;
  ModelConfig model;
  DataConfig data;
  TrainLoopConfig train;
  CommConfig comm;
  MonitorConfig csv_monitor;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  FlopsProfilerConfig flops_profiler;
  CommsLoggerConfig comms_logger;
  GradientAveragingConfig averaging;
  // Dotted key ("zero_optimization.stage") -> where its value came from, for every known key.
  std::map<std::string, ValueSource> sources;
  // Dotted key -> value as JSON text, for printing the resolved configuration.
  std::map<std::string, std::string> resolved;
  // Keys given (file or command line) whose value has no effect in this configuration, one line
  // each: "fp16.loss_scale_window has no effect: fp16.enabled is false". DeepSpeed configs spell
  // such keys out routinely, so they are accepted, and the CLI says so once before training.
  std::vector<std::string> notes;
  // Notes that hold only when the model's parameters are on the CPU (offload keys, whose effect is
  // the copies to and from a GPU): printed beside `notes` for a CPU run, never for a GPU run.
  std::vector<std::string> cpu_device_notes;
  // Dotted key -> how the file spelled it when not by its canonical name ("bfloat16.enabled",
  // "zero_optimization.cpu_offload", "null"): shown beside the source by describe().
  std::map<std::string, std::string> spellings;
  // What zerotrain ignores, as DeepSpeed's reports it does not produce and keys DeepSpeed itself
  // ignores (unknown at the top level or in a block DeepSpeed reads leniently): at most two lines,
  // printed once by the CLI, and the dotted keys they name.
  std::vector<std::string> warnings;
  std::vector<std::string> ignored_keys;
};

// Parses JSON text (an empty string means "{}"), applies overrides of the form
// "key.path=value" (value parsed as JSON, else taken as a string), derives the batch triple for
// `world_size` and validates. Throws ConfigError, for any input: text over 1 MiB, not JSON,
// nested deeper than 16 levels, with a duplicate key, a string value over 4096 bytes or with
// control characters, or a number outside a key's range.
TrainConfig parse_config(const std::string& json_text, const std::vector<std::string>& overrides,
                         int world_size);

// Reads the file (ConfigError when missing, not a regular file, unreadable, empty or over
// 1 MiB), then parse_config(). An empty file is refused: "{}" asks for all defaults explicitly.
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides,
                        int world_size);

// The BERT a configuration with model.type "bert" trains: model.preset's BertConfig with the size
// overrides model.n_layer, n_head, n_embd (hidden; intermediate 4·hidden), vocab_size (content
// ids plus the four specials), context_length (max_positions) and dropout, and
// model.pre_layer_norm / model.next_sentence. Throws ConfigError for an unknown BERT preset (listing
// the valid ones) or an inconsistent shape.
BertConfig bert_config_of(const TrainConfig& config);

// The Llama-family decoder a configuration with model.type "llama" trains: the config.json of
// model.init_from or model.config_from when one is given (no preset or shape key may be given
// beside it), else model.preset's LlamaConfig with the overrides model.n_layer
// (num_hidden_layers), n_head (num_attention_heads), n_kv_head (num_key_value_heads), n_embd
// (hidden_size), intermediate_size, vocab_size and context_length (max_position_embeddings).
// Throws ConfigError for an unknown preset (listing the valid ones), an inconsistent shape, or a
// config.json that is missing, malformed or of an unsupported architecture (naming it and the
// supported ones).
LlamaConfig llama_config_of(const TrainConfig& config);

// The resolved configuration, one "key = value  (source)" line per key, sorted by key.
std::string describe(const TrainConfig& config);

}  // namespace zt
