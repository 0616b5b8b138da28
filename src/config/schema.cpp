// The key table (DeepSpeed's names and defaults, docs/config.md "Keys") and the generic value checks.
#include "config/schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cmath>
#include <limits>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "zerotrain/error.h"

namespace zt::config_detail {
namespace {

// Stores a checked value in a field of whatever type the field has. An integer the field cannot
// hold means the table's range is wider than the field: a defect of the table, never stored
// truncated (config_test checks every integer key at its upper bound).
template <typename T>
void store(T& field, const json& v) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    const int64_t wide = v.get<int64_t>();
    if (!std::in_range<T>(wide))
      throw std::logic_error(fmt::format("configuration table: {} does not fit its field", wide));
    field = static_cast<T>(wide);
  } else {
    field = v.get<T>();
  }
}
#define ZT_FIELD(member) [](TrainConfig& c, const json& v) { store(c.member, v); }

Leaf make(std::string path, Kind kind, json def, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf;
  leaf.path = std::move(path);
  leaf.kind = kind;
  leaf.def = std::move(def);
  leaf.assign = std::move(assign);
  return leaf;
}
Leaf boolean(std::string path, bool def, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::Bool, def, std::move(assign));
}
Leaf integer(std::string path, int64_t def, std::optional<double> lo, std::optional<double> hi,
             std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Int, def, std::move(assign));
  leaf.lo = lo;
  leaf.hi = hi;
  return leaf;
}
Leaf number(std::string path, double def, std::optional<double> lo, bool lo_open, std::optional<double> hi,
            bool hi_open, std::function<void(TrainConfig&, const json&)> assign) {
  Leaf leaf = make(std::move(path), Kind::Number, def, std::move(assign));
  leaf.lo = lo;
  leaf.lo_open = lo_open;
  leaf.hi = hi;
  leaf.hi_open = hi_open;
  return leaf;
}
Leaf positive(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, true, std::nullopt, false, std::move(assign));
}
Leaf non_negative(std::string path, double def, std::function<void(TrainConfig&, const json&)> assign) {
  return number(std::move(path), def, 0.0, false, std::nullopt, false, std::move(assign));
}
Leaf string(std::string path, std::string def, std::function<void(TrainConfig&, const json&)> assign,
            std::vector<std::string> choices = {}) {
  Leaf leaf = make(std::move(path), Kind::String, std::move(def), std::move(assign));
  leaf.choices = std::move(choices);
  return leaf;
}
Leaf batch(std::string path, std::function<void(TrainConfig&, const json&)> assign) {
  return make(std::move(path), Kind::BatchSize, "auto", std::move(assign));
}
// A DeepSpeed key that zerotrain recognises but does not implement and that would change the
// training: only the default passes. `about` names the feature for the refusal.
Leaf reserved(Leaf leaf, std::string about) {
  leaf.supported = false;
  leaf.status = Status::Reserved;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A DeepSpeed key that cannot change a zerotrain run: accepted, a note when set (`about` says why).
Leaf inert(Leaf leaf, std::string about) {
  leaf.status = Status::Inert;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A DeepSpeed report zerotrain does not produce: accepted, named in the warning when set.
Leaf reporting(Leaf leaf, std::string about) {
  leaf.status = Status::Reporting;
  leaf.about = std::move(about);
  leaf.assign = nullptr;
  return leaf;
}
// A whole DeepSpeed feature block, read only for whether it switches the feature on.
Leaf block(std::string path, std::function<bool(const json&)> engaged) {
  Leaf leaf = make(std::move(path), Kind::Object, json::object(), nullptr);
  leaf.nullable = true;
  leaf.engaged = std::move(engaged);
  return leaf;
}
bool enabled_in(const json& v) {
  return v.is_object() && v.contains("enabled") && v["enabled"].is_boolean() && v["enabled"].get<bool>();
}
// True when any "enabled": true appears anywhere inside (compression_training's techniques each
// have their own switch, nested two levels down).
bool any_enabled(const json& v) {
  if (enabled_in(v)) return true;
  if (v.is_object() || v.is_array())
    for (const json& child : v) if (any_enabled(child)) return true;
  return false;
}
bool non_empty(const json& v) { return !v.is_null() && !(v.is_object() && v.empty()); }
Leaf nullable_string(std::string path, std::vector<std::string> choices = {}) {
  Leaf leaf = make(std::move(path), Kind::String, nullptr, nullptr);
  leaf.nullable = true;
  leaf.choices = std::move(choices);
  return leaf;
}
Leaf nullable(Leaf leaf) {
  leaf.nullable = true;
  return leaf;
}

constexpr int64_t k5e8 = 500'000'000, k1e9 = 1'000'000'000;

std::vector<Leaf> build_table() {
  std::vector<Leaf> t;
  auto none = nullptr;
  // --- batch and loop (DeepSpeed top level)
  t.push_back(batch("train_batch_size", [](TrainConfig& c, const json& v) {
    c.train_batch_size = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(batch("train_micro_batch_size_per_gpu", [](TrainConfig& c, const json& v) {
    c.train_micro_batch_size_per_gpu = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(batch("gradient_accumulation_steps", [](TrainConfig& c, const json& v) {
    c.gradient_accumulation_steps = v.is_number() ? v.get<int64_t>() : 0;
  }));
  t.push_back(non_negative("gradient_clipping", 1.0, ZT_FIELD(gradient_clipping)));
  t.push_back(integer("steps_per_print", 10, 1, std::nullopt, ZT_FIELD(steps_per_print)));
  t.push_back(boolean("wall_clock_breakdown", false, ZT_FIELD(wall_clock_breakdown)));
  t.push_back(boolean("prescale_gradients", false, ZT_FIELD(averaging.prescale_gradients)));
  t.push_back(positive("gradient_predivide_factor", 1.0, ZT_FIELD(averaging.gradient_predivide_factor)));
  // Gradient reduction dtype: null (the working precision's) or that dtype itself is honoured;
  // another one is refused in validate_support (reduction in another dtype is not implemented).
  {
    Leaf dtype = nullable_string("communication_data_type", {"fp32", "fp16", "bf16"});
    dtype.case_insensitive = true;
    t.push_back(std::move(dtype));
  }
  t.push_back(inert(string("seq_parallel_communication_data_type", "fp32", none, {"fp32", "fp16", "bf16"}),
                    "the dtype of sequence-parallel (Ulysses) communication; zerotrain has no sequence parallelism"));
  t.push_back(reserved(string("gradient_allreduce_op", "mean", none, {"mean", "sum"}),
                       "summing instead of averaging gradients across ranks"));
  t.back().case_insensitive = true;
  t.push_back(reserved(boolean("sparse_gradients", false, none), "sparse gradients of embedding layers"));
  t.push_back(reserved(boolean("disable_allgather", false, none), "broadcasting updated parameters instead of all-gathering them"));
  t.push_back(reserved(boolean("managed_gradient_accumulation", true, none),
                       "gradient accumulation left to the caller instead of the engine"));
  t.push_back(inert(boolean("zero_allow_untested_optimizer", false, none),
                    "it lets DeepSpeed's ZeRO wrap a client optimizer; every zerotrain optimizer is its own and "
                    "works with every stage"));
  t.push_back(inert(boolean("zero_force_ds_cpu_optimizer", true, none),
                    "it makes DeepSpeed insist on its CPU Adam under offload; zerotrain always steps with its own "
                    "fused kernel"));
  t.push_back(inert(boolean("dataloader_drop_last", false, none),
                    "it configures DeepSpeed's own data loader; zerotrain's loader always yields full micro-batches"));
  t.push_back(inert(nullable(integer("vocabulary_size", 0, 1, std::nullopt, none)),
                    "DeepSpeed only checks its alignment to 8; the model's vocabulary is model.vocab_size"));
  t.back().def = nullptr;
  t.push_back(inert(boolean("graph_harvesting", false, none),
                    "it captures DeepSpeed's bf16 optimizer step in a CUDA graph; the step's math is unchanged"));
  t.push_back(reserved(boolean("use_data_before_expert_parallelism", false, none),
                       "the rank layout of mixture-of-experts parallelism (zerotrain has no experts)"));
  t.push_back(reporting(boolean("dump_state", false, none), "DeepSpeed's print of its engine state"));
  t.push_back(reporting(boolean("memory_breakdown", false, none), "DeepSpeed's memory report at each step"));
  t.push_back(reporting(nullable_string("log_level"), "the verbosity of DeepSpeed's logger"));
  t.push_back(reporting(boolean("timers.throughput.enabled", true, none), "DeepSpeed's throughput timer"));
  t.push_back(reporting(boolean("timers.throughput.synchronized", true, none),
                        "whether DeepSpeed's throughput timer synchronises the device"));
  // Data types (DeepSpeed's "data_types" block): null or the working precision is honoured.
  t.push_back(nullable_string("data_types.grad_accum_dtype", {"fp32", "fp16", "bf16"}));
  t.push_back(nullable_string("data_types.param_dtype", {"fp32", "fp16", "bf16"}));
  t.push_back(inert(nullable_string("data_types.buffer_dtype", {"fp32", "fp16", "bf16"}),
                    "the dtype of model buffers; zerotrain's GPT has no buffers"));
  t.push_back(inert(make("data_types.keep_in_fp32_modules", Kind::AutoOrStringList, "auto", nullptr),
                    "the modules whose buffers stay in fp32 under 16-bit training; zerotrain's GPT and BERT have no "
                    "buffers"));

  // Whole DeepSpeed features zerotrain does not implement. Reserved: each changes the training
  // when switched on (the block may be given switched off, as many published configurations do).
  t.push_back(reserved(block("compression_training", any_enabled),
                       "compression training (quantization, pruning, layer reduction)"));
  t.push_back(reserved(block("data_efficiency", enabled_in), "data efficiency (curriculum sampling, random-LTD)"));
  t.push_back(reserved(block("curriculum_learning", enabled_in), "curriculum learning"));
  t.push_back(reserved(block("progressive_layer_drop", enabled_in), "progressive layer dropping"));
  t.push_back(reserved(block("elasticity", enabled_in), "elastic training (batch size chosen from the GPU count)"));
  t.push_back(reserved(block("quantize_training", enabled_in), "quantization-aware training (MoQ)"));
  t.push_back(reserved(block("sparse_attention", non_empty), "DeepSpeed's sparse attention"));
  t.push_back(reserved(block("amp", enabled_in), "NVIDIA Apex automatic mixed precision"));
  t.push_back(reserved(block("torch_autocast", enabled_in), "torch.autocast mixed precision"));
  t.push_back(reserved(block("hybrid_engine", enabled_in), "the hybrid engine (RLHF generation)"));
  t.push_back(reserved(block("weight_quantization", non_empty), "weight quantization"));
  t.push_back(reserved(block("expert_parallel", non_empty), "expert parallelism"));
  t.push_back(reserved(block("tensor_parallel",
                             [](const json& v) {
                               return v.is_object() && v.contains("autotp_size") && v["autotp_size"].is_number() &&
                                      v["autotp_size"].get<double>() > 1;
                             }),
                       "tensor parallelism (autotp_size > 1)"));
  // Blocks that cannot change a zerotrain run.
  t.push_back(inert(block("pipeline", non_empty),
                    "it configures DeepSpeed's pipeline engine, which runs only PipelineModule models; zerotrain's "
                    "model is not pipelined"));
  t.push_back(inert(block("compile",
                          [](const json& v) {
                            return v.is_object() && v.contains("deepcompile") && v["deepcompile"] == json(true);
                          }),
                    "DeepCompile compiles DeepSpeed's ZeRO into the model's graph; zerotrain runs its own ZeRO "
                    "(the math is the same)"));
  t.push_back(inert(block("autotuning", enabled_in),
                    "DeepSpeed's autotuner searches configurations in separate runs; zerotrain runs the "
                    "configuration as given (zerotrain estimate sizes one)"));
  t.push_back(inert(block("nebula", enabled_in), "Nebula is a checkpoint service of Azure; zerotrain writes its own "
                                                 "checkpoints"));
  t.push_back(inert(block("datastates", non_empty), "DataStates is an asynchronous checkpoint engine; zerotrain "
                                                    "writes its own checkpoints"));
  t.push_back(reporting(block("eigenvalue", enabled_in), "DeepSpeed's Hessian eigenvalue report"));
  // DeepSpeed's "checkpoint" block (read with dict.get).
  t.push_back(inert(string("checkpoint.tag_validation", "Warn", none, {"Warn", "Ignore", "Fail"}),
                    "DeepSpeed compares checkpoint tags across ranks; zerotrain's tags come from one rank and its "
                    "checkpoints are checksummed"));
  t.back().case_insensitive = true;
  t.push_back(reserved(boolean("checkpoint.load_universal", false, none), "loading universal checkpoints"));
  t.push_back(inert(boolean("checkpoint.use_node_local_storage", false, none),
                    "zerotrain writes each rank's file to the checkpoint directory it is given"));
  t.push_back(inert(boolean("checkpoint.parallel_write.pipeline_stage", false, none),
                    "it parallelises DeepSpeed's pipeline-stage checkpoint writes; zerotrain has no pipeline"));
  // DeepSpeed 0.19 chooses its checkpoint engine's writer here (type, io_buffer_size, decoupled, ...).
  t.push_back(inert(block("checkpoint.writer", non_empty),
                    "it chooses the writer of DeepSpeed's checkpoint engines; zerotrain writes its checkpoints with "
                    "its own writer (each rank its file, checksummed, published atomically)"));

  // --- optimizer. Type names compare case-insensitively, as in DeepSpeed.
  {
    Leaf type = string("optimizer.type", "Adam", ZT_FIELD(optimizer.type),
                       {"Adam", "AdamW", "Lamb", "SGD", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion",
                        "Muon", "MuAdam", "MuAdamW", "MuSGD",
                        // Any other torch.optim class DeepSpeed builds by its name (torch 2.11's).
                        "Adadelta", "Adafactor", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop",
                        "SparseAdam"});
    type.case_insensitive = true;
    t.push_back(std::move(type));
  }
  t.push_back(positive("optimizer.params.lr", 1e-3, ZT_FIELD(optimizer.lr)));
  t.push_back(make("optimizer.params.betas", Kind::Betas, json::array({0.9, 0.999}),
                   [](TrainConfig& c, const json& v) {
                     c.optimizer.beta1 = v[0].get<double>();
                     c.optimizer.beta2 = v[1].get<double>();
                   }));
  t.push_back(positive("optimizer.params.eps", 1e-8, ZT_FIELD(optimizer.eps)));
  t.push_back(non_negative("optimizer.params.weight_decay", 0.0, ZT_FIELD(optimizer.weight_decay)));
  t.push_back(boolean("optimizer.params.adam_w_mode", true, ZT_FIELD(optimizer.adam_w_mode)));
  t.push_back(boolean("optimizer.params.bias_correction", true, ZT_FIELD(optimizer.bias_correction)));
  t.push_back(non_negative("optimizer.params.min_coeff", 0.01, ZT_FIELD(optimizer.min_coeff)));
  t.push_back(positive("optimizer.params.max_coeff", 10.0, ZT_FIELD(optimizer.max_coeff)));
  t.push_back(non_negative("optimizer.params.momentum", 0.0, ZT_FIELD(optimizer.momentum)));
  t.push_back(number("optimizer.params.dampening", 0.0, 0.0, false, 1.0, false, ZT_FIELD(optimizer.dampening)));
  t.push_back(boolean("optimizer.params.nesterov", false, ZT_FIELD(optimizer.nesterov)));
  t.push_back(reserved(boolean("optimizer.params.amsgrad", false, none), "the AMSGrad variant"));
  t.push_back(inert(boolean("optimizer.params.torch_adam", false, none),
                    "it picks torch.optim.AdamW over DeepSpeed's fused kernel; zerotrain always uses its own fused "
                    "kernel, whose math is the same"));
  t.push_back(inert(boolean("optimizer.params.fused", false, none),
                    "it picks torch's fused Adam kernel; zerotrain always uses its own fused kernel, whose math is "
                    "the same"));
  t.push_back(reserved(boolean("optimizer.params.fp32_optimizer_states", true, none),
                       "optimizer states in the working precision (zerotrain keeps them in fp32)"));
  // Lamb (DeepSpeed's FusedLamb): its own clipping before the trust ratio; validate_support.
  t.push_back(non_negative("optimizer.params.max_grad_norm", 0.0, ZT_FIELD(optimizer.lamb_max_grad_norm)));
  t.push_back(reserved(boolean("optimizer.params.eps_inside_sqrt", false, none), "epsilon inside the square root"));
  t.push_back(inert(boolean("optimizer.legacy_fusion", false, none),
                    "it picks DeepSpeed's older fused fp16 optimizer; zerotrain has one implementation"));

  // --- scheduler (DeepSpeed's parameter names and defaults; which ones a type takes:
  // validate_semantics)
  t.push_back(string("scheduler.type", "", ZT_FIELD(scheduler.type),
                     {"", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}));
  t.push_back(non_negative("scheduler.params.warmup_min_lr", 0.0, ZT_FIELD(scheduler.warmup_min_lr)));
  t.push_back(positive("scheduler.params.warmup_max_lr", 1e-3, ZT_FIELD(scheduler.warmup_max_lr)));
  // DeepSpeed raises for warmup_num_steps <= 0.
  t.push_back(integer("scheduler.params.warmup_num_steps", 1000, 1, std::nullopt,
                      ZT_FIELD(scheduler.warmup_num_steps)));
  // DeepSpeed warns about any other warm-up type and runs "log": accepted, noted (config.cpp).
  t.push_back(string("scheduler.params.warmup_type", "log", ZT_FIELD(scheduler.warmup_type)));
  // 0 until derived: DeepSpeed requires it for WarmupDecayLR / WarmupCosineLR; we derive it
  // from train.steps when absent (and say so in the sources).
  t.push_back(integer("scheduler.params.total_num_steps", 0, 1, std::nullopt, ZT_FIELD(scheduler.total_num_steps)));
  t.push_back(number("scheduler.params.cos_min_ratio", 1e-4, 0.0, false, 1.0, false, ZT_FIELD(scheduler.cos_min_ratio)));
  t.push_back(number("scheduler.params.warmup_min_ratio", 0.0, 0.0, false, 1.0, false,
                     ZT_FIELD(scheduler.warmup_min_ratio)));
  // OneCycle. cycle_min_lr / cycle_max_lr have no default in DeepSpeed (null here; required for
  // OneCycle by validate_semantics); an explicit null is refused as DeepSpeed would fail on it.
  t.push_back(non_negative("scheduler.params.cycle_min_lr", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_min_lr = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  }));
  t.back().def = nullptr;
  t.push_back(non_negative("scheduler.params.cycle_max_lr", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_max_lr = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  }));
  t.back().def = nullptr;
  t.push_back(non_negative("scheduler.params.decay_lr_rate", 0.0, ZT_FIELD(scheduler.decay_lr_rate)));
  // DeepSpeed takes the step sizes as float(...): fractional sizes are valid there.
  t.push_back(positive("scheduler.params.cycle_first_step_size", 2000, ZT_FIELD(scheduler.cycle_first_step_size)));
  t.push_back(nullable(non_negative("scheduler.params.cycle_second_step_size", 0.0, [](TrainConfig& c, const json& v) {
    c.scheduler.cycle_second_step_size = v.is_null() ? std::nullopt : std::optional<double>(v.get<double>());
  })));
  t.back().def = nullptr;
  // A stair count <= 0 is the continuous cycle (DeepSpeed's command-line default is -1).
  t.push_back(integer("scheduler.params.cycle_first_stair_count", 0, std::nullopt, std::nullopt,
                      ZT_FIELD(scheduler.cycle_first_stair_count)));
  t.push_back(nullable(integer("scheduler.params.cycle_second_stair_count", 0, std::nullopt, std::nullopt,
                               [](TrainConfig& c, const json& v) {
                                 c.scheduler.cycle_second_stair_count =
                                     v.is_null() ? std::nullopt : std::optional<int64_t>(v.get<int64_t>());
                               })));
  t.back().def = nullptr;
  t.push_back(integer("scheduler.params.decay_step_size", 0, 0, std::nullopt, ZT_FIELD(scheduler.decay_step_size)));
  t.push_back(boolean("scheduler.params.cycle_momentum", true, ZT_FIELD(scheduler.cycle_momentum)));
  t.push_back(number("scheduler.params.cycle_min_mom", 0.8, 0.0, false, 1.0, true, ZT_FIELD(scheduler.cycle_min_mom)));
  t.push_back(number("scheduler.params.cycle_max_mom", 0.9, 0.0, false, 1.0, true, ZT_FIELD(scheduler.cycle_max_mom)));
  t.push_back(non_negative("scheduler.params.decay_mom_rate", 0.0, ZT_FIELD(scheduler.decay_mom_rate)));
  // LRRangeTest (DeepSpeed raises for a step size <= 0).
  t.push_back(non_negative("scheduler.params.lr_range_test_min_lr", 1e-3, ZT_FIELD(scheduler.lr_range_test_min_lr)));
  t.push_back(integer("scheduler.params.lr_range_test_step_size", 2000, 1, std::nullopt,
                      ZT_FIELD(scheduler.lr_range_test_step_size)));
  t.push_back(non_negative("scheduler.params.lr_range_test_step_rate", 1.0,
                           ZT_FIELD(scheduler.lr_range_test_step_rate)));
  t.push_back(boolean("scheduler.params.lr_range_test_staircase", false, ZT_FIELD(scheduler.lr_range_test_staircase)));

  // --- zero_optimization
  t.push_back(integer("zero_optimization.stage", 0, 0, 3, ZT_FIELD(zero.stage)));
  t.push_back(boolean("zero_optimization.contiguous_gradients", true, ZT_FIELD(zero.contiguous_gradients)));
  t.push_back(integer("zero_optimization.reduce_bucket_size", k5e8, 1, std::nullopt, ZT_FIELD(zero.reduce_bucket_size)));
  t.push_back(integer("zero_optimization.allgather_bucket_size", k5e8, 1, std::nullopt,
                      ZT_FIELD(zero.allgather_bucket_size)));
  // Default depends on the stage (true for 3): derive().
  t.push_back(boolean("zero_optimization.overlap_comm", false, ZT_FIELD(zero.overlap_comm)));
  const std::string Z = "zero_optimization.";
  t.push_back(inert(boolean(Z + "reduce_scatter", true, none),
                    "it makes DeepSpeed all-reduce instead of reduce-scatter; zerotrain reduces as its stage "
                    "needs, and the mean is the same"));
  t.push_back(inert(boolean(Z + "allgather_partitions", true, none),
                    "it makes DeepSpeed broadcast instead of all-gather; zerotrain all-gathers, and the parameters "
                    "are the same"));
  t.push_back(inert(boolean(Z + "round_robin_gradients", false, none),
                    "it spreads DeepSpeed's gradient copies to CPU memory over ranks; zerotrain's gradients are in "
                    "host memory already"));
  t.push_back(inert(boolean(Z + "use_multi_rank_bucket_allreduce", true, none),
                    "it merges DeepSpeed's per-rank reduce buckets; the reduced values are the same"));
  t.push_back(reserved(boolean(Z + "load_from_fp32_weights", true, none),
                       "loading the fp32 masters from 16-bit weights (zerotrain's checkpoints always hold fp32 "
                       "masters)"));
  t.push_back(reserved(boolean(Z + "elastic_checkpoint", false, none), "elastic checkpoints"));
  t.push_back(inert(boolean(Z + "ignore_unused_parameters", true, none),
                    "zerotrain reduces a parameter without a gradient as zero (docs/zero.md)"));
  t.push_back(reserved(boolean(Z + "legacy_stage1", false, none), "DeepSpeed's legacy stage 1"));
  t.push_back(integer(Z + "zero_hpz_partition_size", 1, 0, 1 << 20, ZT_FIELD(zero.hpz_partition_size)));
  t.push_back(reserved(boolean(Z + "zero_quantized_weights", false, none), "ZeRO++ quantized weight gathers (qwZ)"));
  t.push_back(reserved(boolean(Z + "zero_quantized_nontrainable_weights", false, none),
                       "quantized storage of frozen weights"));
  t.push_back(reserved(boolean(Z + "zero_quantized_gradients", false, none),
                       "ZeRO++ quantized gradient reduction (qgZ)"));
  t.push_back(reserved(block(Z + "zeropp_loco_param", non_empty), "LoCo-Zero++ error-compensated quantization"));
  t.back().def = nullptr;
  t.push_back(reserved(block(Z + "zenflow", non_empty), "ZenFlow (stall-free offloaded optimizer steps)"));
  t.back().def = nullptr;
  t.push_back(inert(integer(Z + "mics_shard_size", -1, -1, std::nullopt, none),
                    "MiCS shards over a sub-group of ranks to cut communication; zerotrain shards over all ranks"));
  t.push_back(inert(boolean(Z + "mics_hierarchical_params_gather", false, none),
                    "a MiCS gather order; zerotrain has no MiCS"));
  t.push_back(inert(boolean(Z + "memory_efficient_linear", true, none),
                    "a stage-3 linear layer of DeepSpeed that frees its input early; zerotrain's blocks are its own"));
  t.push_back(inert(boolean(Z + "override_module_apply", true, none),
                    "it patches torch's nn.Module.apply for stage 3; zerotrain has no Python modules"));
  t.push_back(inert(boolean(Z + "pipeline_loading_checkpoint", false, none),
                    "it loads stage-3 checkpoints for DeepSpeed's pipeline engine; zerotrain has no pipeline"));
  t.push_back(inert(boolean(Z + "log_trace_cache_warnings", false, none),
                    "a warning of DeepSpeed's stage-3 trace cache, which zerotrain does not have"));
  t.push_back(inert(boolean(Z + "enable_sanity_checks", false, none), "DeepSpeed's internal stage-3 checks"));
  t.push_back(inert(boolean(Z + "save_muon_momentum_buffer_in_memory", false, none),
                    "it applies to the Muon optimizer, which zerotrain refuses"));
  t.push_back(inert(block(Z + "leaf_module", non_empty),
                    "the command line's models have fixed stage-3 blocks, each gathered whole (from Python, "
                    "zerotrain.initialize honours it: docs/python.md \"Stage 3: units\")"));
  // DeepSpeed deprecates this and ignores it (it sets no other key); so does zerotrain.
  t.push_back(inert(nullable(boolean(Z + "cpu_offload_use_pin_memory", false, none)),
                    "DeepSpeed ignores it too (offload_optimizer.pin_memory and offload_param.pin_memory are the "
                    "settings)"));
  t.back().def = nullptr;
  t.push_back(integer("zero_optimization.stage3_prefetch_bucket_size", 50'000'000, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_prefetch_bucket_size)));
  t.push_back(integer("zero_optimization.stage3_param_persistence_threshold", 100'000, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_param_persistence_threshold)));
  t.push_back(integer("zero_optimization.stage3_max_live_parameters", k1e9, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_max_live_parameters)));
  t.push_back(integer("zero_optimization.stage3_max_reuse_distance", k1e9, 0, std::nullopt,
                      ZT_FIELD(zero.stage3_max_reuse_distance)));
  t.push_back(inert(integer(Z + "stage3_model_persistence_threshold", INT64_MAX, 0, std::nullopt, none),
                    "a cap on the total of persistent parameters; zerotrain keeps every parameter below "
                    "stage3_param_persistence_threshold gathered"));
  t.push_back(inert(integer(Z + "stage3_module_granularity_threshold", 0, std::nullopt, std::nullopt, none),
                    "it groups DeepSpeed's fine-grained modules for fetching; zerotrain fetches whole blocks"));
  t.push_back(inert(boolean(Z + "stage3_use_all_reduce_for_fetch_params", false, none),
                    "a way of gathering parameters; the gathered values are the same"));
  t.push_back(inert(boolean(Z + "stage3_allgather_sequential", false, none),
                    "a way of gathering parameters; the gathered values are the same"));
  t.push_back(inert(boolean(Z + "stage3_gather_16bit_weights_on_model_save", false, none),
                    "it makes DeepSpeed's save_16bit_model gather stage-3 weights; a zerotrain checkpoint is always "
                    "exported whole by zerotrain export"));
  // ZeRO-Offload / ZeRO-Infinity (docs/offload.md): DeepSpeed's keys and defaults; which ones
  // matter depends on the device (notes in config.cpp), what must hold together: derive.cpp.
  t.push_back(integer("zero_optimization.sub_group_size", k1e9, 0, std::nullopt, ZT_FIELD(zero.sub_group_size)));
  for (std::string block : {"zero_optimization.offload_optimizer", "zero_optimization.offload_param"}) {
    const bool opt = block.ends_with("optimizer");
    auto field = [opt](auto OffloadOptimizerConfig::*o, auto OffloadParamConfig::*p) {
      return [opt, o, p](TrainConfig& c, const json& v) {
        if (opt) store(c.zero.offload_optimizer.*o, v);
        else store(c.zero.offload_param.*p, v);
      };
    };
    t.push_back(string(block + ".device", "none",
                       [opt](TrainConfig& c, const json& v) {
                         const std::string s = v.get<std::string>();
                         const OffloadDevice d = s == "cpu" ? OffloadDevice::Cpu : s == "nvme" ? OffloadDevice::Nvme
                                                                                               : OffloadDevice::None;
                         (opt ? c.zero.offload_optimizer.device : c.zero.offload_param.device) = d;
                       },
                       {"none", "cpu", "nvme"}));
    // DeepSpeed's default is None (no directory); null and "" both mean "not given".
    t.push_back(nullable(string(block + ".nvme_path", "", [opt](TrainConfig& c, const json& v) {
      (opt ? c.zero.offload_optimizer.nvme_path : c.zero.offload_param.nvme_path) =
          v.is_null() ? std::string() : v.get<std::string>();
    })));
    t.back().def = nullptr;
    t.push_back(boolean(block + ".pin_memory", false,
                        field(&OffloadOptimizerConfig::pin_memory, &OffloadParamConfig::pin_memory)));
    t.push_back(integer(block + ".buffer_count", opt ? 4 : 5, 1, 1 << 16,
                        field(&OffloadOptimizerConfig::buffer_count, &OffloadParamConfig::buffer_count)));
    if (opt) {
      t.push_back(boolean(block + ".pipeline_read", false, ZT_FIELD(zero.offload_optimizer.pipeline_read)));
      t.push_back(boolean(block + ".pipeline_write", false, ZT_FIELD(zero.offload_optimizer.pipeline_write)));
      t.push_back(boolean(block + ".fast_init", false, ZT_FIELD(zero.offload_optimizer.fast_init)));
      // The fraction of the optimizer partition on the device's tier; 0 would offload nothing
      // (that is device "none").
      t.push_back(number(block + ".ratio", 1.0, 0.0, true, 1.0, false, ZT_FIELD(zero.offload_optimizer.ratio)));
      // zerotrain's own (the ZeRO-Offload paper's delayed parameter update, §5.2).
      t.push_back(boolean(block + ".delayed_update", false, ZT_FIELD(zero.offload_optimizer.delayed_update)));
      t.push_back(inert(boolean(block + ".super_offload", false, none),
                        "a CPU offload path of DeepSpeed for Superchips (GH200); the step's math is the same"));
      t.push_back(inert(number(block + ".cpuadam_cores_perc", 0.8, 0.0, false, 1.0, false, none),
                        "the share of cores DeepSpeed's super_offload steps on; zerotrain's threads are train.threads"));
      t.push_back(integer(block + ".delayed_update_after", 40, 0, std::nullopt,
                          ZT_FIELD(zero.offload_optimizer.delayed_update_after)));
      // zerotrain's own: the gradient partition beside the state on NVMe (stages 2-3).
      t.push_back(boolean(block + ".nvme_gradients", false, ZT_FIELD(zero.offload_optimizer.nvme_gradients)));
    } else {
      t.push_back(integer(block + ".buffer_size", 100'000'000, 1, std::nullopt, ZT_FIELD(zero.offload_param.buffer_size)));
      t.push_back(integer(block + ".max_in_cpu", k1e9, 0, std::nullopt, ZT_FIELD(zero.offload_param.max_in_cpu)));
    }
  }

  // --- precision. fp16/bf16 "enabled" become TrainConfig::precision in derive().
  t.push_back(boolean("fp16.enabled", false, ZT_FIELD(fp16.enabled)));
  t.push_back(non_negative("fp16.loss_scale", 0.0, ZT_FIELD(fp16.loss_scale)));
  t.push_back(integer("fp16.initial_scale_power", 16, 0, 63, ZT_FIELD(fp16.initial_scale_power)));
  constexpr double kIntMax = std::numeric_limits<int>::max();  // these two are `int` fields
  t.push_back(integer("fp16.loss_scale_window", 1000, 1, kIntMax, ZT_FIELD(fp16.loss_scale_window)));
  t.push_back(integer("fp16.hysteresis", 2, 1, kIntMax, ZT_FIELD(fp16.hysteresis)));
  t.push_back(positive("fp16.min_loss_scale", 1.0, ZT_FIELD(fp16.min_loss_scale)));
  t.push_back(reserved(boolean("fp16.auto_cast", false, none),
                       "autocast of fp16 operations (zerotrain casts the whole model to the working precision)"));
  t.push_back(reserved(boolean("fp16.consecutive_hysteresis", false, none),
                       "a hysteresis refilled by every step without overflow"));
  t.push_back(reserved(boolean("fp16.fp16_master_weights_and_grads", false, none),
                       "fp16 master weights and gradients (zerotrain keeps fp32 masters)"));
  t.push_back(boolean("bf16.enabled", false, none));
  // DeepSpeed's bf16 optimizer (chosen only with data_types.grad_accum_dtype "fp32" below stage 2)
  // adds each micro-step's bf16 gradient into an fp32 accumulator; the flag only chooses whether
  // per parameter during backward or all after it, with the same sums (docs/config.md).
  t.push_back(inert(boolean("bf16.immediate_grad_update", false, none),
                    "it only times when DeepSpeed's bf16 optimizer (data_types.grad_accum_dtype \"fp32\") adds "
                    "gradients into its fp32 accumulator, which zerotrain does not have; the sums are the same"));
  t.push_back(reserved(boolean("bf16.check_grad_overflow", true, none),
                       "stepping over inf/NaN gradients (zerotrain always skips such a step)"));
  t.push_back(reserved(boolean("bf16.bf16_master_weights_and_grads", false, none),
                       "bf16 master weights and gradients (zerotrain keeps fp32 masters)"));
  t.push_back(reserved(boolean("bf16.bf16_optimizer_states", false, none),
                       "bf16 optimizer states (zerotrain keeps them in fp32)"));

  // --- monitoring
  t.push_back(boolean("csv_monitor.enabled", true, ZT_FIELD(csv_monitor.enabled)));
  t.push_back(string("csv_monitor.output_path", "", ZT_FIELD(csv_monitor.output_path)));
  t.push_back(string("csv_monitor.job_name", "zerotrain", ZT_FIELD(csv_monitor.job_name)));
  // DeepSpeed's other monitors (deepspeed/monitor/config.py): zerotrain writes only the CSV log.
  const char* kTensorboard = "DeepSpeed's TensorBoard monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("tensorboard.enabled", false, none), kTensorboard));
  t.push_back(reporting(string("tensorboard.output_path", "", none), kTensorboard));
  t.push_back(reporting(string("tensorboard.job_name", "DeepSpeedJobName", none), kTensorboard));
  const char* kWandb = "DeepSpeed's Weights & Biases monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("wandb.enabled", false, none), kWandb));
  t.push_back(reporting(nullable_string("wandb.group"), kWandb));
  t.push_back(reporting(nullable_string("wandb.team"), kWandb));
  t.push_back(reporting(string("wandb.project", "deepspeed", none), kWandb));
  const char* kComet = "DeepSpeed's Comet monitor (zerotrain writes the CSV log, csv_monitor)";
  t.push_back(reporting(boolean("comet.enabled", false, none), kComet));
  t.push_back(reporting(integer("comet.samples_log_interval", 100, 0, std::nullopt, none), kComet));
  for (const char* key : {"project", "workspace", "api_key", "experiment_name", "experiment_key", "mode"})
    t.push_back(reporting(nullable_string(std::string("comet.") + key), kComet));
  t.push_back(reporting(nullable(boolean("comet.online", false, none)), kComet));
  t.back().def = nullptr;

  // --- reporting: DeepSpeed's flops_profiler and comms_logger (docs/config.md "Reporting")
  t.push_back(boolean("flops_profiler.enabled", false, ZT_FIELD(flops_profiler.enabled)));
  t.push_back(non_negative("flops_profiler.recompute_fwd_factor", 0.0, ZT_FIELD(flops_profiler.recompute_fwd_factor)));
  t.push_back(integer("flops_profiler.profile_step", 1, 1, std::nullopt, ZT_FIELD(flops_profiler.profile_step)));
  t.push_back(integer("flops_profiler.module_depth", -1, -1, 1 << 10, ZT_FIELD(flops_profiler.module_depth)));
  t.push_back(integer("flops_profiler.top_modules", 1, 1, 1 << 20, ZT_FIELD(flops_profiler.top_modules)));
  t.push_back(boolean("flops_profiler.detailed", true, ZT_FIELD(flops_profiler.detailed)));
  t.push_back(nullable(string("flops_profiler.output_file", "", [](TrainConfig& c, const json& v) {
    c.flops_profiler.output_file = v.is_null() ? std::string() : v.get<std::string>();
  })));
  t.back().def = nullptr;
  t.push_back(boolean("comms_logger.enabled", false, ZT_FIELD(comms_logger.enabled)));
  t.push_back(boolean("comms_logger.verbose", false, ZT_FIELD(comms_logger.verbose)));
  t.push_back(boolean("comms_logger.prof_all", true, ZT_FIELD(comms_logger.prof_all)));
  t.push_back(boolean("comms_logger.debug", false, ZT_FIELD(comms_logger.debug)));
  t.push_back(make("comms_logger.prof_ops", Kind::StringList, json::array(), ZT_FIELD(comms_logger.prof_ops)));

  // --- activation checkpointing (docs/activation_checkpointing.md)
  t.push_back(string("activation_checkpointing.policy", "none", ZT_FIELD(activation_checkpointing.policy),
                     {"none", "selective", "full", "auto"}));
  t.push_back(boolean("activation_checkpointing.partition_activations", false,
                      ZT_FIELD(activation_checkpointing.partition_activations)));
  t.push_back(boolean("activation_checkpointing.cpu_checkpointing", false,
                      ZT_FIELD(activation_checkpointing.cpu_checkpointing)));
  t.push_back(boolean("activation_checkpointing.contiguous_memory_optimization", false,
                      ZT_FIELD(activation_checkpointing.contiguous_memory_optimization)));
  t.push_back(boolean("activation_checkpointing.synchronize_checkpoint_boundary", false,
                      ZT_FIELD(activation_checkpointing.synchronize_checkpoint_boundary)));
  t.push_back(boolean("activation_checkpointing.profile", false, ZT_FIELD(activation_checkpointing.profile)));
  t.push_back(nullable(integer("activation_checkpointing.number_checkpoints", 0, 0, std::nullopt,
                               [](TrainConfig& c, const json& v) {
                                 c.activation_checkpointing.number_checkpoints = v.is_null() ? 0 : v.get<int64_t>();
                               })));
  t.back().def = nullptr;
  // The asynchronous I/O engine of the nvme tiers (DeepSpeed's "aio" block and defaults).
  t.push_back(integer("aio.block_size", 1 << 20, 1, 1LL << 30, ZT_FIELD(aio.block_size)));
  t.push_back(integer("aio.queue_depth", 8, 1, 1 << 16, ZT_FIELD(aio.queue_depth)));
  t.push_back(integer("aio.thread_count", 1, 1, 1 << 10, ZT_FIELD(aio.thread_count)));
  t.push_back(boolean("aio.single_submit", false, ZT_FIELD(aio.single_submit)));
  t.push_back(boolean("aio.overlap_events", true, ZT_FIELD(aio.overlap_events)));
  t.push_back(reserved(boolean("aio.use_gds", false, none),
                       "GPUDirect Storage (the nvme tiers read and write through host memory)"));

  // --- zerotrain's own blocks
  t.push_back(string("model.type", "gpt", ZT_FIELD(model.type), {"gpt", "bert"}));
  t.push_back(string("model.preset", "tiny", ZT_FIELD(model.preset)));
  // Upper bounds far beyond any model this library can build, low enough that the size
  // arithmetic of the estimate and the model (layers x 12 x width^2 + (vocab + context) x width)
  // cannot overflow 64 bits.
  for (const auto& shape : std::initializer_list<std::tuple<const char*, int64_t ModelConfig::*, double>>{
           {"n_layer", &ModelConfig::n_layer, 1 << 16},
           {"n_head", &ModelConfig::n_head, 1 << 16},
           {"n_embd", &ModelConfig::n_embd, 1 << 20},
           {"vocab_size", &ModelConfig::vocab_size, 1 << 24},
           {"context_length", &ModelConfig::context_length, 1 << 24}}) {
    // 0 keeps the preset's value. (A named copy, not a structured binding: clang 14, which builds
    // the fuzz targets, cannot capture those.)
    int64_t ModelConfig::*field = std::get<1>(shape);
    t.push_back(integer(std::string("model.") + std::get<0>(shape), 0, 0, std::get<2>(shape),
                        [field](TrainConfig& c, const json& v) { c.model.*field = v.get<int64_t>(); }));
  }
  // -1 (the default) keeps the preset's dropout; a given value must be a probability.
  t.push_back(number("model.dropout", -1.0, 0.0, false, 1.0, true, ZT_FIELD(model.dropout)));
  t.push_back(integer("model.loss_chunk_tokens", 0, 0, 1LL << 40, ZT_FIELD(model.loss_chunk_tokens)));
  t.push_back(string("model.init_from", "", ZT_FIELD(model.init_from)));
  // BERT only (validate_semantics refuses them with model.type "gpt").
  t.push_back(boolean("model.pre_layer_norm", false, ZT_FIELD(model.pre_layer_norm)));
  t.push_back(nullable(boolean("model.next_sentence", false, [](TrainConfig& c, const json& v) {
    c.model.next_sentence = v.is_null() ? std::nullopt : std::optional<bool>(v.get<bool>());
  })));
  t.back().def = nullptr;
  t.push_back(string("data.source", "embedded", ZT_FIELD(data.source), {"embedded", "bin", "text"}));
  t.push_back(string("data.path", "", ZT_FIELD(data.path)));
  t.push_back(string("data.val_path", "", ZT_FIELD(data.val_path)));
  t.push_back(number("data.val_fraction", 0.1, 0.0, false, 1.0, true, ZT_FIELD(data.val_fraction)));
  t.push_back(integer("data.sequence_length", 0, 0, std::nullopt, ZT_FIELD(data.sequence_length)));
  t.push_back(number("data.mlm_probability", 0.15, 0.0, true, 1.0, false, ZT_FIELD(data.mlm_probability)));
  t.push_back(integer("data.max_predictions", 0, 0, 1LL << 24, ZT_FIELD(data.max_predictions)));
  // The trainer keeps one loss per step; a hundred million steps is beyond any run and its
  // bookkeeping still fits in memory (a value past it is a typo or damage, refused up front).
  t.push_back(integer("train.steps", 200, 1, 100'000'000, ZT_FIELD(train.steps)));
  t.push_back(integer("train.seed", 1234, 0, std::nullopt, ZT_FIELD(train.seed)));
  t.push_back(integer("train.eval_interval", 0, 0, std::nullopt, ZT_FIELD(train.eval_interval)));
  t.push_back(integer("train.eval_iters", 4, 1, std::nullopt, ZT_FIELD(train.eval_iters)));
  t.push_back(integer("train.threads", 0, 0, 4096, ZT_FIELD(train.threads)));
  t.push_back(string("train.log_dir", "runs", ZT_FIELD(train.log_dir)));
  t.push_back(string("train.retain_freed_memory", "bounded", ZT_FIELD(train.retain_freed_memory),
                     {"bounded", "auto", "always", "never"}));
  t.push_back(string("train.cpu_half_precision", "auto", ZT_FIELD(train.cpu_half_precision), {"auto", "always"}));
  t.push_back(positive("comm.timeout_seconds", 300.0, ZT_FIELD(comm.timeout_seconds)));
  return t;
}
#undef ZT_FIELD

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  return s;
}

std::string fmt_bound(double v) {
  if (std::abs(v) >= 1e15 || v != std::floor(v)) return fmt::format("{}", v);
  return fmt::format("{}", static_cast<int64_t>(v));
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

const std::vector<Leaf>& leaves() {
  static const std::vector<Leaf> table = build_table();
  return table;
}

const Leaf* find_leaf(const std::string& path) {
  static const std::map<std::string, const Leaf*> index = [] {
    std::map<std::string, const Leaf*> m;
    for (const Leaf& leaf : leaves()) m.emplace(leaf.path, &leaf);
    return m;
  }();
  auto it = index.find(path);
  return it == index.end() ? nullptr : it->second;
}

bool is_block(const std::string& path) {
  if (path.empty()) return true;
  const std::string prefix = path + ".";
  return std::any_of(leaves().begin(), leaves().end(),
                     [&](const Leaf& leaf) { return leaf.path.starts_with(prefix); });
}

std::vector<std::string> children(const std::string& block) {
  const std::string prefix = block.empty() ? "" : block + ".";
  std::vector<std::string> names;
  for (const Leaf& leaf : leaves()) {
    if (!leaf.path.starts_with(prefix)) continue;
    std::string rest = leaf.path.substr(prefix.size());
    std::string name = rest.substr(0, rest.find('.'));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

Strictness strictness(const std::string& block) {
  // DeepSpeed reads these with dict.get (get_scalar_param): a key it does not know is ignored.
  static const std::set<std::string> lenient = {"optimizer",  "scheduler", "activation_checkpointing",
                                                "flops_profiler", "aio",    "checkpoint",
                                                "data_types", "timers",    "checkpoint.parallel_write"};
  return lenient.count(block) ? Strictness::Lenient : Strictness::Strict;
}

bool pydantic_block(const std::string& block) {
  static const std::set<std::string> models = {
      "zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
      "fp16",              "bf16",                                "tensorboard",
      "wandb",             "comet",                               "csv_monitor",
      "comms_logger",      "timers.throughput"};
  return models.count(block) > 0;
}

bool engaged(const Leaf& leaf, const json& value) {
  if (leaf.engaged) return leaf.engaged(value);
  if (value.is_number() && leaf.def.is_number()) return value.get<double>() != leaf.def.get<double>();
  return value != leaf.def;
}

std::string Leaf::expected() const {
  std::string text;
  switch (kind) {
    case Kind::Bool: text = "true or false"; break;
    case Kind::Betas: text = "two numbers in [0, 1)"; break;
    case Kind::BatchSize: text = "a positive integer or \"auto\""; break;
    case Kind::StringList: text = "a list of strings"; break;
    case Kind::AutoOrStringList: text = "\"auto\" or a list of strings"; break;
    case Kind::Object: text = "an object (a block of settings)"; break;
    case Kind::String:
      if (choices.empty()) {
        text = "a string";
      } else {
        text = "one of";
        for (size_t i = 0; i < choices.size(); ++i) text += (i ? ", \"" : " \"") + choices[i] + "\"";
      }
      break;
    case Kind::Int:
    case Kind::Number: {
      const bool is_int = kind == Kind::Int;
      const char* noun = is_int ? "integer" : "number";
      if (lo && hi) {
        text = fmt::format("{} {} in {}{}, {}{}", is_int ? "an" : "a", noun, lo_open ? "(" : "[", fmt_bound(*lo),
                           fmt_bound(*hi), hi_open ? ")" : "]");
      } else if (lo && *lo == 0 && lo_open) {
        text = fmt::format("a positive {}", noun);
      } else if (lo && *lo == 0) {
        text = fmt::format("a non-negative {}", noun);
      } else if (lo && *lo == 1 && is_int) {
        text = "a positive integer";
      } else if (lo) {
        text = fmt::format("{} {} {} {}", is_int ? "an" : "a", noun, lo_open ? ">" : ">=", fmt_bound(*lo));
      } else {
        text = is_int ? "an integer" : "a number";
      }
      break;
    }
  }
  if (nullable) text += " or null";
  return text;
}

json check_value(const Leaf& leaf, const json& value) {
  auto fail = [&](const std::string& extra = "") -> json {
    throw ConfigError(fmt::format("{}: expected {}, found {}{}", leaf.path, leaf.expected(), show(value), extra));
  };
  if (value.is_null() && leaf.nullable) return value;
  auto in_range = [&](double v) {
    if (leaf.lo && (leaf.lo_open ? v <= *leaf.lo : v < *leaf.lo)) return false;
    if (leaf.hi && (leaf.hi_open ? v >= *leaf.hi : v > *leaf.hi)) return false;
    return std::isfinite(v);
  };
  auto as_int = [&](const json& v) -> std::optional<int64_t> {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.2e18) return static_cast<int64_t>(d);
    }
    return std::nullopt;
  };
  switch (leaf.kind) {
    case Kind::Bool:
      if (!value.is_boolean()) fail();
      return value;
    case Kind::Int: {
      auto v = as_int(value);
      if (!v || !in_range(static_cast<double>(*v))) fail();
      return *v;
    }
    case Kind::Number:
      if (!value.is_number() || !in_range(value.get<double>())) fail();
      return value.get<double>();
    case Kind::BatchSize: {
      if (value.is_string() && value.get<std::string>() == "auto") return value;
      auto v = as_int(value);
      if (!v || *v < 1) fail();
      return *v;
    }
    case Kind::Object:
      if (!value.is_object()) fail();
      return value;
    case Kind::AutoOrStringList:
    case Kind::StringList: {
      if (leaf.kind == Kind::AutoOrStringList && value.is_string() && value.get<std::string>() == "auto") return value;
      if (!value.is_array()) fail();
      for (const json& item : value) {
        if (!item.is_string() || item.get_ref<const std::string&>().size() > kMaxStringBytes) fail();
        const std::string& s = item.get_ref<const std::string&>();
        if (std::any_of(s.begin(), s.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
          fail(" (control characters are not allowed)");
      }
      return value;
    }
    case Kind::Betas: {
      if (!value.is_array() || value.size() != 2) fail();
      for (const json& b : value)
        if (!b.is_number() || b.get<double>() < 0 || b.get<double>() >= 1) fail();
      return json::array({value[0].get<double>(), value[1].get<double>()});
    }
    case Kind::String: {
      if (!value.is_string()) fail();
      const std::string& s = value.get_ref<const std::string&>();
      // Names and paths: a control character (a NUL would cut a path short) or a megabyte of
      // text is a damaged file, not a setting.
      if (s.size() > kMaxStringBytes)
        throw ConfigError(fmt::format("{}: expected {} of at most {} bytes, found one of {} bytes", leaf.path,
                                      leaf.expected(), kMaxStringBytes, s.size()));
      if (std::any_of(s.begin(), s.end(), [](unsigned char ch) { return ch < 0x20 || ch == 0x7f; }))
        fail(" (control characters are not allowed)");
      if (leaf.choices.empty()) return value;
      for (const std::string& choice : leaf.choices)
        if (choice == s || (leaf.case_insensitive && lower(choice) == lower(s))) return choice;
      if (auto near = nearest(s, leaf.choices)) return fail(fmt::format(" — did you mean \"{}\"?", *near));
      return fail();
    }
  }
  return fail();
}

std::optional<std::string> nearest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = SIZE_MAX;
  for (const std::string& c : candidates) {
    if (c.empty()) continue;
    size_t d = edit_distance(lower(word), lower(c));
    if (d < best_distance) best_distance = d, best = c;
  }
  if (!best) return std::nullopt;
  // "Reasonably close": about one edit per four characters, at least one; a two-letter word
  // two edits away from another is no evidence of a typo.
  const size_t len = std::max(word.size(), best->size());
  const size_t limit = std::max<size_t>(1, len / 4);
  if (best_distance == 0 || best_distance > limit) return std::nullopt;
  return best;
}

void throw_unknown_key(const std::string& block, const std::string& key_in) {
  // The key is the user's text: escaped and shortened so that the message stays one short line.
  std::string key = show(json(key_in));
  key = key.substr(1, key.size() - (key.ends_with("\"") ? 2 : 1));
  const std::string path = join_path(block, key);
  if (find_leaf(block))
    throw ConfigError(fmt::format("unknown key '{}' ('{}' is a value, not a block of settings)", path, block));
  const std::vector<std::string> valid = children(block);
  if (auto near = key_in.size() <= 64 ? nearest(key_in, valid) : std::nullopt)
    throw ConfigError(fmt::format("unknown key '{}' — did you mean '{}'?", path, join_path(block, *near)));
  // The list stays one readable line: the first names, then how many more (docs/config.md has all).
  std::string list;
  size_t shown = 0;
  for (const std::string& name : valid) {
    if (list.size() + name.size() > 200) break;
    list += (list.empty() ? "" : ", ") + name;
    ++shown;
  }
  if (shown < valid.size()) list += fmt::format(", ... ({} more; docs/config.md lists every key)", valid.size() - shown);
  throw ConfigError(fmt::format("unknown key '{}' (valid keys {}: {})", path,
                                block.empty() ? "at the top level" : "in '" + block + "'", list));
}

std::string show(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) {
    text.resize(57);
    text += "...";
  }
  return text;
}

std::string join_path(const std::string& block, const std::string& key) {
  return block.empty() ? key : block + "." + key;
}

}  // namespace zt::config_detail
