"""zerotrain for PyTorch scripts: DeepSpeed's API over zerotrain's C++ ZeRO engine.

    import zerotrain as deepspeed        # or zerotrain.install_as_deepspeed()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config="ds_config.json")
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

What is supported and what is not yet: docs/python.md.
"""
import sys

import torch  # noqa: F401  (loads libtorch before the extension that links it)

from . import _build_info

if torch.__version__.split("+")[0] != _build_info.TORCH_VERSION:
    raise ImportError(f"zerotrain was built against torch {_build_info.TORCH_VERSION}, but this environment imports "
                      f"torch {torch.__version__} from {torch.__file__}: rebuild zerotrain in this environment "
                      "(pip install . in its source tree)")

from . import _C  # noqa: E402
from ._errors import CommError, ConfigError, DataError, EngineError  # noqa: F401
from ._released import ReleasedParameterError  # noqa: F401
from ._unsupported import NotSupportedError  # noqa: F401
from . import _unsupported, accelerator, checkpointing, comm, compression, lr_schedules, models, moe, ops  # noqa: F401
from . import partition_parameters, runtime, utils, zero  # noqa: F401
from .accelerator import get_accelerator  # noqa: F401
from .comm import init_distributed
from .engine import DeepSpeedEngine, DeepSpeedOptimizer, ZeroEngine  # noqa: F401
from .engine import DeepSpeedOptimizerCallable, DeepSpeedSchedulerCallable  # noqa: F401
from .ops import adam, lamb  # noqa: F401
from .utils import OnDevice, log_dist, logger  # noqa: F401

__version__ = "0.1.0"
# DeepSpeed's version names: this package's own version (DeepSpeed's git fields say "unknown" when
# it is not built from a checkout, as here).
version = __version__
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
git_hash = git_branch = "unknown"

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's default MASTER_PORT
MUON_OPTIMIZER = "muon"  # DeepSpeed's optimizer type name; the engine does not run it (a ConfigError)
DeepSpeedConfigError = ConfigError  # what a bad configuration raises


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The configuration (config=, config_params= or args.deepspeed_config; a path or a dict) goes
    through the same checks as the command line's. A client optimizer (zerotrain.ops or
    torch.optim's Adam, AdamW, SGD, or a callable making one from the parameters) replaces the
    configuration's "optimizer" block; the engine runs it with its fused kernels. A client
    lr_scheduler (a torch scheduler, or a callable making one from the optimizer) is stepped by
    engine.step() at each optimizer step, as DeepSpeed steps it (docs/python.md)."""
    from .engine import _load_config

    if model is None:
        raise ValueError("zerotrain.initialize: expected model=, a torch.nn.Module")
    if mpu is not None or mesh_param is not None:
        raise ValueError("zerotrain.initialize: model parallelism (mpu=, mesh_param=) is not supported")
    if config is not None and config_params is not None:
        raise ValueError("zerotrain.initialize: give config= or config_params=, not both")
    if dist_init_required is False and not comm.is_initialized() and not torch.distributed.is_initialized():
        raise ValueError("zerotrain.initialize: dist_init_required=False, but no process group is initialised")
    init_distributed()
    cfg = _load_config(config if config is not None else config_params, args)
    engine = ZeroEngine(model, cfg, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                        args=args)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=comm.get_world_size(),
                                                      rank=comm.get_rank())
        loader = torch.utils.data.DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                             sampler=sampler, collate_fn=collate_fn)
    engine.training_dataloader = loader  # DeepSpeed's engine attribute
    return engine, engine.optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments, exactly those of DeepSpeed 0.19: --deepspeed,
    --deepspeed_config and their deprecated spellings --deepscale, --deepscale_config. No
    --local_rank: scripts that take one define it themselves (the launchers set LOCAL_RANK too)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def install_as_deepspeed():
    """Makes `import deepspeed` and every DeepSpeed module scripts and libraries import by name
    (deepspeed.comm, .zero, .runtime.zero.partition_parameters, .accelerator, .utils.logging, ...:
    the table in _deepspeed_names.py) resolve to zerotrain in this process."""
    from . import _deepspeed_names

    package = sys.modules[__name__]
    _deepspeed_names.register(package)
    return package


# DeepSpeed's top-level names for what zerotrain does not do: each raises NotSupportedError when used.
init_inference = _unsupported.function("deepspeed.init_inference", "zerotrain trains; it has no inference engine")
default_inference_config = _unsupported.function("deepspeed.default_inference_config",
                                                 "zerotrain trains; it has no inference engine")
tp_model_init = _unsupported.function("deepspeed.tp_model_init", "zerotrain trains data-parallel only")
set_autotp_mode = _unsupported.function("deepspeed.set_autotp_mode", "zerotrain trains data-parallel only")
replace_transformer_layer = _unsupported.function("deepspeed.replace_transformer_layer",
                                                  "zerotrain has no kernel injection")
DeepSpeedConfig = _unsupported.cls("deepspeed.DeepSpeedConfig", "initialize reads the configuration itself")
DeepSpeedDataLoader = _unsupported.cls("deepspeed.DeepSpeedDataLoader",
                                       "initialize(training_data=...) returns a torch DataLoader over this rank's share")
PipelineModule = _unsupported.cls("deepspeed.PipelineModule", "zerotrain has no pipeline parallelism")
PipelineEngine = _unsupported.cls("deepspeed.PipelineEngine", "zerotrain has no pipeline parallelism")
DualPipeVEngine = _unsupported.cls("deepspeed.DualPipeVEngine", "zerotrain has no pipeline parallelism")
DualPipeVModule = _unsupported.cls("deepspeed.DualPipeVModule", "zerotrain has no pipeline parallelism")
load_ds_config = _unsupported.function("deepspeed.load_ds_config", "zerotrain trains data-parallel only")
merge_tp_model_init_into_config = _unsupported.function("deepspeed.merge_tp_model_init_into_config",
                                                        "zerotrain trains data-parallel only")
record_tp_model_init_args = _unsupported.function("deepspeed.record_tp_model_init_args",
                                                  "zerotrain trains data-parallel only")
DeepSpeedHybridEngine = _unsupported.cls("deepspeed.DeepSpeedHybridEngine", "zerotrain has no inference engine")
InferenceEngine = _unsupported.cls("deepspeed.InferenceEngine", "zerotrain has no inference engine")
DeepSpeedInferenceConfig = _unsupported.cls("deepspeed.DeepSpeedInferenceConfig", "zerotrain has no inference engine")
DeepSpeedTransformerLayer = _unsupported.cls("deepspeed.DeepSpeedTransformerLayer",
                                             "zerotrain has no fused transformer kernels")
DeepSpeedTransformerConfig = _unsupported.cls("deepspeed.DeepSpeedTransformerConfig",
                                              "zerotrain has no fused transformer kernels")


__all__ = ["initialize", "init_distributed", "add_config_arguments", "install_as_deepspeed", "get_accelerator",
           "ZeroEngine", "DeepSpeedEngine", "ConfigError", "DataError", "CommError", "EngineError",
           "ReleasedParameterError", "NotSupportedError", "comm", "ops", "utils", "checkpointing", "zero", "accelerator",
           "lr_schedules", "moe", "compression", "runtime", "logger", "log_dist"]
