// The key table's DeepSpeed top level: batch and loop keys, data types, and the feature blocks.
#include "config/schema_keys.h"

namespace zt::config_detail::keys {

// The batch and loop keys of DeepSpeed's top level, and its "data_types" block.
void add_top_level_keys(std::vector<Leaf>& t) {
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
  {
    Leaf buffers = nullable_string("data_types.buffer_dtype", {"fp32", "fp16", "bf16"});
    buffers.assign = [](TrainConfig& c, const json& v) { c.buffer_dtype = v.is_string() ? v.get<std::string>() : ""; };
    t.push_back(std::move(buffers));
  }
  t.push_back(make("data_types.keep_in_fp32_modules", Kind::AutoOrStringList, "auto", [](TrainConfig& c, const json& v) {
    c.keep_in_fp32_buffers.clear();
    if (v.is_array())
      for (const auto& pattern : v) c.keep_in_fp32_buffers.push_back(pattern.get<std::string>());
  }));
}

// DeepSpeed's feature blocks zerotrain does not implement or that cannot change its run, and
// DeepSpeed's "checkpoint" block.
void add_feature_block_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
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
  // Tensor parallelism: the ranks per tensor group (docs/tensor_parallel.md); 0 and 1 mean none.
  t.push_back(integer("tensor_parallel.autotp_size", 0, 0, 1 << 16, [](TrainConfig& c, const json& v) {
    c.tensor_parallel = std::max<int>(1, v.get<int>());
  }));
  t.push_back(reserved(boolean("tensor_parallel.tp_overlap_comm", false, none),
                       "overlapping the tensor group's all-reduces with the next layer's computation"));
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
}

}  // namespace zt::config_detail::keys
