"""DeepSpeedEngine's configuration queries and the engine methods zerotrain does not implement, as
a base class of the engine (engine.py keeps the training loop).

Each query answers from the configuration the engine resolved (the C++ parser's values, defaults
filled in: DeepSpeed's), so engine.zero_overlap_comm() is what the engine runs with.
"""
import json

import torch

from . import _unsupported

# DeepSpeedEngine method -> the resolved configuration key it returns.
_CONFIG_VALUES = {
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "memory_breakdown": "memory_breakdown",
    "gradient_clipping": "gradient_clipping",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "dump_state": "dump_state",
    "dataloader_drop_last": "dataloader_drop_last",
    "managed_gradient_accumulation": "managed_gradient_accumulation",
    "log_level": "log_level",
    "fp16_enabled": "fp16.enabled",
    "bfloat16_enabled": "bf16.enabled",
    "fp16_auto_cast": "fp16.auto_cast",
    # The configured static scale, 0 for the dynamic scaler (the current scale: optimizer.loss_scale).
    "loss_scale": "fp16.loss_scale",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "load_universal_checkpoint": "checkpoint.load_universal",
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    "zero_optimization_stage": "zero_optimization.stage",
    "zero_reduce_scatter": "zero_optimization.reduce_scatter",
    "zero_overlap_comm": "zero_optimization.overlap_comm",
    "zero_contiguous_gradients": "zero_optimization.contiguous_gradients",
    "zero_reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "zero_allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "zero_allgather_partitions": "zero_optimization.allgather_partitions",
    "zero_round_robin_gradients": "zero_optimization.round_robin_gradients",
    "zero_multi_rank_bucket_allreduce": "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_sub_group_size": "zero_optimization.sub_group_size",
    "zero_elastic_checkpoint": "zero_optimization.elastic_checkpoint",
    "zero_load_from_fp32_weights": "zero_optimization.load_from_fp32_weights",
    "zero_legacy_stage1": "zero_optimization.legacy_stage1",
    "zero_ignore_unused_parameters": "zero_optimization.ignore_unused_parameters",
    "zero_max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_model_persistence_threshold": "zero_optimization.stage3_model_persistence_threshold",
    "zero_module_granularity_threshold": "zero_optimization.stage3_module_granularity_threshold",
    "zero_gather_16bit_weights_on_model_save": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_allgather_sequential": "zero_optimization.stage3_allgather_sequential",
    "zero_hpz_partition_size": "zero_optimization.zero_hpz_partition_size",
    "zero_quantized_weights": "zero_optimization.zero_quantized_weights",
    "zero_quantized_nontrainable_weights": "zero_optimization.zero_quantized_nontrainable_weights",
    "zero_quantized_gradients": "zero_optimization.zero_quantized_gradients",
    "zero_log_trace_cache_warnings": "zero_optimization.log_trace_cache_warnings",
    "zero_save_muon_momentum_buffer_in_memory": "zero_optimization.save_muon_momentum_buffer_in_memory",
    "is_sanity_checks_enabled": "zero_optimization.enable_sanity_checks",
    "zero_partial_offload": "zero_optimization.offload_optimizer.ratio",
    "super_offload": "zero_optimization.offload_optimizer.super_offload",
    "cpuadam_cores_perc": "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    "flops_profiler_enabled": "flops_profiler.enabled",
    "flops_profiler_recompute_fwd_factor": "flops_profiler.recompute_fwd_factor",
    "flops_profiler_profile_step": "flops_profiler.profile_step",
    "flops_profiler_module_depth": "flops_profiler.module_depth",
    "flops_profiler_top_modules": "flops_profiler.top_modules",
    "flops_profiler_detailed": "flops_profiler.detailed",
    "flops_profiler_output_file": "flops_profiler.output_file",
}

# DeepSpeedEngine methods for what zerotrain does not do, each with why.
_NOT_SUPPORTED = {
    "set_train_batch_size": "the batch sizes are fixed when the engine is built",
    "set_train_micro_batch_size": "the batch sizes are fixed when the engine is built",
    "set_data_post_process_func": "zerotrain has no data-efficiency pipeline",
    "set_custom_curriculum_learning_schedule": "zerotrain has no curriculum learning",
    "random_ltd_initialize": "zerotrain has no random layer-token drop",
    "get_sequence_parallel_group": "zerotrain trains data-parallel only",
    "print_forward_breakdown": "wall_clock_breakdown prints the engine's own breakdown",
    "allreduce_gradients": "the engine reduces gradients itself inside backward() and step()",
    "allreduce_bucket": "the engine reduces gradients itself inside backward() and step()",
    "allreduce_and_copy": "the engine reduces gradients itself inside backward() and step()",
    "allreduce_no_retain": "the engine reduces gradients itself inside backward() and step()",
    "buffered_allreduce_fallback": "the engine reduces gradients itself inside backward() and step()",
    "sparse_allreduce_no_retain": "zerotrain has no sparse gradients",
    "sparse_allreduce_bucket": "zerotrain has no sparse gradients",
    "sparse_allreduce": "zerotrain has no sparse gradients",
    "sparse_all_gather": "zerotrain has no sparse gradients",
    "all_gather_scalar": "use zerotrain.comm.all_gather",
    "coalesce_grad_reduction": "the engine reduces gradients in its own buckets",
    "clip_fp32_gradients": "the engine clips by gradient_clipping inside step()",
    "get_wall_clock_timers": "wall_clock_breakdown prints the engine's own breakdown",
    "load_moe_state_dict": "zerotrain has no expert parallelism",
    "load_module_state_dict": "load_checkpoint restores the module with the rest of the state",
    "empty_partition_cache": "the engine releases stage-3 parameters itself after each use",
    "get_autosp_backend": "zerotrain does not compile the model",
    "get_autotp_backend": "zerotrain does not compile the model",
    "get_deepcompile_backend": "zerotrain does not compile the model",
    "get_deepspeed_compile_backend": "zerotrain does not compile the model",
    "compile": "zerotrain does not compile the model",
    "get_compile_time": "zerotrain does not compile the model",
    "register_compile_pass": "zerotrain does not compile the model",
    "offload_states": "offloading is set in the configuration (offload_optimizer, offload_param)",
    "reload_states": "offloading is set in the configuration (offload_optimizer, offload_param)",
    "collect_python_gc": "the engine leaves Python's garbage collector as it is",
    "deepspeed_io": "initialize(training_data=...) returns a torch DataLoader over this rank's share",
    "scale": "backward() scales the loss itself",
    "dynamic_loss_scale_args": "the loss scaler's settings are the configuration's fp16 block",
    "swap_tensor_config": "read the configuration's offload blocks",
    "aio_config": "read the configuration's aio block",
    "zenflow_config": "zerotrain has no ZenFlow",
    "get_data_types": "the engine's dtypes follow the configuration's bf16 and fp16 blocks",
    "get_optimizer_configuration": "read optimizer_name() and optimizer_params()",
    "get_type": "read optimizer_name()",
    "zero_offload_optimizer": "read the configuration's zero_optimization.offload_optimizer block",
    "zero_offload_param": "read the configuration's zero_optimization.offload_param block",
    "tensor_parallel_config": "zerotrain trains data-parallel only",
    "data_efficiency_config": "zerotrain has no data-efficiency pipeline",
    "data_sampling_config": "zerotrain has no data-efficiency pipeline",
    "curriculum_learning_config": "zerotrain has no curriculum learning",
    "random_ltd_config": "zerotrain has no random layer-token drop",
    "autotuning_start_profile_step": "zerotrain has no autotuner",
    "autotuning_end_profile_step": "zerotrain has no autotuner",
    "autotuning_metric_path": "zerotrain has no autotuner",
    "autotuning_model_info_path": "zerotrain has no autotuner",
    "autotuning_metric": "zerotrain has no autotuner",
    "autotuning_profile_model_info": "zerotrain has no autotuner",
    "compile_zero_optimization_stage": "zerotrain does not compile the model",
    "compile_autosp": "zerotrain does not compile the model",
    "compile_autotp": "zerotrain does not compile the model",
    "uses_parallelization_pass_only": "zerotrain does not compile the model",
    "is_deepcompile_enabled": "zerotrain does not compile the model",
    "is_deepcompile_active": "zerotrain does not compile the model",
    "torch_autocast_dtype": "the engine's dtypes follow the configuration's bf16 and fp16 blocks",
    "torch_autocast_lower_precision_safe_modules": "the engine's dtypes follow the configuration's bf16 and fp16 "
                                                   "blocks",
}

# DeepSpeed features that zerotrain does not have: their switches are off here.
_ALWAYS_OFF = ("checkpoint_serialization_enabled", "data_efficiency_enabled", "data_sampling_enabled",
               "curriculum_learning_enabled", "random_ltd_enabled", "autotuning_enabled", "torch_autocast_enabled",
               "optimizer_legacy_fusion")


def _config_value(key):
    def query(self):
        return json.loads(self._resolved()[key])

    query.__name__ = key.rsplit(".", 1)[-1]
    query.__doc__ = f"The configuration's {key}, as the engine resolved it."
    return query


def _off(self):
    return False


class EngineConfigQueries:
    """Base of ZeroEngine: DeepSpeedEngine's configuration queries and its unsupported methods."""

    def _resolved(self):
        return self._live()._engine.config_json

    def zero_optimization(self):
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self):
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self):
        return self.zero_optimization_stage() >= 3

    def is_first_weights_partition_group(self):
        return self.zero_optimization_partition_weights()

    def _offload_optimizer_device(self):
        return json.loads(self._resolved()["zero_optimization.offload_optimizer.device"])

    def zero_cpu_offload(self):
        return self._offload_optimizer_device() == "cpu"

    def zero_use_cpu_optimizer(self):
        return self._offload_optimizer_device() in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self):
        return self._offload_optimizer_device() == "nvme"

    def zero_compute_grad_norm(self):
        return True  # the engine computes the global norm at every step (get_global_grad_norm)

    def zero_parameter_alignment(self):
        return 1  # the engine's partitions hold whole elements, none padded to an alignment

    def dynamic_loss_scale(self):
        return json.loads(self._resolved()["fp16.loss_scale"]) == 0

    def initial_dynamic_scale(self):
        return 2 ** json.loads(self._resolved()["fp16.initial_scale_power"])

    def postscale_gradients(self):
        return not json.loads(self._resolved()["prescale_gradients"])

    def checkpoint_tag_validation_enabled(self):
        return json.loads(self._resolved()["checkpoint.tag_validation"]).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self):
        return json.loads(self._resolved()["checkpoint.tag_validation"]).upper() == "FAIL"

    def checkpoint_writer_enabled(self):
        return bool(json.loads(self._resolved()["checkpoint.writer"]))

    @property
    def communication_data_type(self):
        configured = json.loads(self._resolved()["communication_data_type"])
        if configured is not None:
            return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[configured]
        if self.fp16_enabled():
            return torch.float16
        if self.bfloat16_enabled():
            return torch.bfloat16
        return torch.float32

    def optimizer_name(self):
        """The client optimizer's class name, else the configuration's optimizer type (DeepSpeed's)."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return json.loads(self._resolved().get("optimizer.type", "null")) or None

    def optimizer_params(self):
        return self._block_params("optimizer")

    def scheduler_name(self):
        return json.loads(self._resolved().get("scheduler.type", "null")) or None

    def scheduler_params(self):
        return self._block_params("scheduler") if self.scheduler_name() else None

    def _block_params(self, block):
        prefix = block + ".params."
        return {k[len(prefix):]: json.loads(v) for k, v in self._resolved().items() if k.startswith(prefix)}

    def get_batch_info(self):
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def get_data_parallel_rank(self):
        return self.global_rank

    def get_tensor_parallel_rank(self):
        return 0  # one rank holds the whole model: data parallelism only

    get_model_parallel_rank = get_tensor_parallel_rank

    def autotp_size(self):
        return 1

    @staticmethod
    def is_map_style_dataset(obj):
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj):
        return isinstance(obj, torch.utils.data.IterableDataset)

    @property
    def is_compiled(self):
        return False  # zerotrain does not compile the model


for _name, _key in _CONFIG_VALUES.items():
    setattr(EngineConfigQueries, _name, _config_value(_key))
for _name in _ALWAYS_OFF:
    setattr(EngineConfigQueries, _name, _off)
for _name, _why in _NOT_SUPPORTED.items():
    setattr(EngineConfigQueries, _name, _unsupported.function(f"DeepSpeedEngine.{_name}", _why))
del _name, _key, _why

# The configuration key's short name: bf16.enabled (DeepSpeed's engine spells it bfloat16_enabled).
EngineConfigQueries.bf16_enabled = EngineConfigQueries.bfloat16_enabled
