// The key table's ZeRO: partitioning and reduction, DeepSpeed's variants of ZeRO, offload to the
// CPU and NVMe, and the asynchronous I/O engine of the NVMe tiers.
#include "config/schema_keys.h"

namespace zt::config_detail::keys {

// The "zero_optimization" block's reduction and partitioning keys.
void add_zero_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
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
}

// The "zero_optimization" keys of DeepSpeed's variants of ZeRO (ZeRO++, MiCS) and of its stage-3
// internals.
void add_zero_variant_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
  const std::string Z = "zero_optimization.";
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
}

// The offload blocks and sizes of ZeRO-Offload and ZeRO-Infinity.
void add_offload_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
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
    // DeepSpeed 0.19 pins by default: a copy from pageable memory blocks the host until the GPU
    // has caught up, which takes the overlap away from prefetch and the delayed update.
    t.push_back(boolean(block + ".pin_memory", true,
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
}

// The "aio" block.
void add_aio_keys(std::vector<Leaf>& t) {
  auto none = nullptr;
  // The asynchronous I/O engine of the nvme tiers (DeepSpeed's "aio" block and defaults).
  t.push_back(integer("aio.block_size", 1 << 20, 1, 1LL << 30, ZT_FIELD(aio.block_size)));
  t.push_back(integer("aio.queue_depth", 8, 1, 1 << 16, ZT_FIELD(aio.queue_depth)));
  t.push_back(integer("aio.thread_count", 1, 1, 1 << 10, ZT_FIELD(aio.thread_count)));
  t.push_back(boolean("aio.single_submit", false, ZT_FIELD(aio.single_submit)));
  t.push_back(boolean("aio.overlap_events", true, ZT_FIELD(aio.overlap_events)));
  t.push_back(reserved(boolean("aio.use_gds", false, none),
                       "GPUDirect Storage (the nvme tiers read and write through host memory)"));
}

}  // namespace zt::config_detail::keys
