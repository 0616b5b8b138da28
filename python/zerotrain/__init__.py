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

from . import _C
from ._errors import CommError, ConfigError, DataError, EngineError  # noqa: F401
from ._released import ReleasedParameterError  # noqa: F401
from . import checkpointing, comm, models, ops, utils, zero  # noqa: F401
from .comm import init_distributed
from .engine import DeepSpeedEngine, ZeroEngine  # noqa: F401
from .ops import adam, lamb  # noqa: F401

__version__ = "0.1.0"


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader, lr_scheduler).

    The configuration (config=, config_params= or args.deepspeed_config; a path or a dict) goes
    through the same checks as the command line's. A client optimizer (zerotrain.ops or
    torch.optim's Adam, AdamW, SGD) replaces the configuration's "optimizer" block; the engine
    runs it with its fused kernels."""
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
    engine = ZeroEngine(model, cfg, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=None
                        if lr_scheduler is None else lr_scheduler)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=comm.get_world_size(),
                                                      rank=comm.get_rank())
        loader = torch.utils.data.DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def add_config_arguments(parser):
    """DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config."""
    group = parser.add_argument_group("zerotrain", "zerotrain configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable the engine (kept for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the DeepSpeed JSON configuration file")
    group.add_argument("--local_rank", type=int, default=-1, help="set by launchers; read from LOCAL_RANK otherwise")
    return parser


def install_as_deepspeed():
    """Makes `import deepspeed` (and deepspeed.comm, .ops.adam, .ops.lamb, .utils, .checkpointing)
    resolve to zerotrain in this process, for scripts and libraries that import DeepSpeed by name."""
    import importlib

    package = sys.modules[__name__]
    sys.modules["deepspeed"] = package
    for sub in ("comm", "ops", "ops.adam", "ops.lamb", "utils", "checkpointing", "zero"):
        sys.modules["deepspeed." + sub] = importlib.import_module(__name__ + "." + sub)
    return package


__all__ = ["initialize", "init_distributed", "add_config_arguments", "install_as_deepspeed", "ZeroEngine",
           "DeepSpeedEngine", "ConfigError", "DataError", "CommError", "EngineError", "ReleasedParameterError", "comm",
           "ops", "utils", "checkpointing", "zero"]
