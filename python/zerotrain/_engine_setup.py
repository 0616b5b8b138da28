"""The steps of ZeroEngine's construction (engine.py) that need no engine: initialize's
configuration read (non-finite numbers refused), a client optimizer as the configuration's
"optimizer" block, the parameter groups, the optimizer object made from the configuration's block
for a scheduler callable, keep_in_fp32_modules "auto", the model's parameters checked, and the
notes on what the Python front end leaves out.
"""
import json
import math
import os
import sys

import torch

from . import _C, _registry, _released, comm, partition_parameters
from .ops._client import EngineOptimizer
from .ops.adam import FusedAdam
from .ops.lamb import FusedLamb

# torch.optim classes the engine has a kernel for: the configuration's optimizer type and params.
def _torch_optimizer_config(opt):
    g = opt.param_groups[0]
    if type(opt) is torch.optim.AdamW:
        if g.get("amsgrad"):
            raise ValueError("zerotrain.initialize: torch.optim.AdamW(amsgrad=True): the AMSGrad variant is not implemented")
        return "AdamW", {"lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
    if type(opt) is torch.optim.Adam:
        if g.get("amsgrad"):
            raise ValueError("zerotrain.initialize: torch.optim.Adam(amsgrad=True): the AMSGrad variant is not implemented")
        return "Adam", {"lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"],
                        "adam_w_mode": False}
    if type(opt) is torch.optim.SGD:
        return "SGD", {"lr": float(g["lr"]), "momentum": g["momentum"], "dampening": g["dampening"],
                       "nesterov": g["nesterov"], "weight_decay": g["weight_decay"]}
    return None


_SUPPORTED = ("zerotrain.ops.adam.FusedAdam, zerotrain.ops.adam.DeepSpeedCPUAdam, zerotrain.ops.lamb.FusedLamb, "
              "torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD")

# Per group, these two may differ (the engine's ParameterGroup); the others must be the same in
# every group.
_PER_GROUP = ("lr", "weight_decay")
_SHARED = ("betas", "eps", "bias_correction", "max_grad_norm", "max_coeff", "min_coeff", "momentum", "dampening",
           "nesterov", "amsgrad", "adam_w_mode")


def _optimizer_from_client(optimizer):
    """The configuration's "optimizer" block for a client optimizer; TypeError for one the engine lacks."""
    if isinstance(optimizer, EngineOptimizer):
        opt_type, params = optimizer.engine_type, optimizer.engine_params()
    elif isinstance(optimizer, torch.optim.Optimizer):
        mapped = _torch_optimizer_config(optimizer)
        if mapped is None:
            raise TypeError(f"zerotrain.initialize: optimizer {type(optimizer).__module__}.{type(optimizer).__name__} is not "
                            f"implemented by the engine; it runs {_SUPPORTED}, or the configuration's \"optimizer\" block")
        opt_type, params = mapped
    else:
        raise TypeError(f"zerotrain.initialize: expected a torch.optim.Optimizer for optimizer=, found {type(optimizer).__name__}")
    groups = optimizer.param_groups
    for i, g in enumerate(groups[1:], start=1):
        for key in _SHARED:
            if key in g and key in groups[0] and g[key] != groups[0][key]:
                raise ValueError(f"zerotrain.initialize: optimizer parameter group {i} has {key}={g[key]!r} where group 0 "
                                 f"has {groups[0][key]!r}: only lr and weight_decay may differ between groups")
    return {"type": opt_type, "params": params}


def _parameter_groups(model, model_parameters, optimizer):
    """The trainable parameters the script hands over, checked against the model, and the groups
    with hyperparameters of their own as [(names, lr or None, weight_decay or None)]."""
    named = list(model.named_parameters())
    by_id = {id(p): n for n, p in named}
    given, groups = [], []

    def take(params, where):
        params = [params] if torch.is_tensor(params) else list(params)
        for p in params:
            if not torch.is_tensor(p):
                raise TypeError(f"zerotrain.initialize: {where}: expected tensors or groups of them, found {type(p).__name__}")
            if id(p) not in by_id:
                raise ValueError(f"zerotrain.initialize: {where} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model")
        given.extend(params)
        return [by_id[id(p)] for p in params]

    if optimizer is not None:
        for i, g in enumerate(optimizer.param_groups):
            names = take(g["params"], "the optimizer's parameter groups")
            if i > 0:
                groups.append((names, float(g["lr"]) if "lr" in g else None,
                               float(g["weight_decay"]) if "weight_decay" in g else None))
    elif model_parameters is not None:
        for item in model_parameters:
            if isinstance(item, dict):
                shared = sorted(k for k in item if k in _SHARED)
                if shared:
                    raise ValueError(f"zerotrain.initialize: a model_parameters group sets {', '.join(shared)}: only lr "
                                     "and weight_decay may be set per group; give the others in the configuration's "
                                     "\"optimizer\" block")
                names = take(item["params"], "model_parameters")
                if any(k in item for k in _PER_GROUP):
                    groups.append((names, float(item["lr"]) if "lr" in item else None,
                                   float(item["weight_decay"]) if "weight_decay" in item else None))
            else:
                take(item, "model_parameters")
    else:
        given = [p for _, p in named if p.requires_grad]
    chosen = {id(p) for p in given}
    left_out = [n for n, p in named if p.requires_grad and id(p) not in chosen]
    if left_out:
        raise ValueError(f"zerotrain.initialize: {len(left_out)} parameter(s) of the model require a gradient but are not in "
                         f"model_parameters (the first: {left_out[0]!r}); set requires_grad=False on the ones to freeze")
    trainable = {n for n, p in named if p.requires_grad}  # frozen ones in a group are not the optimizer's
    groups = [([n for n in names if n in trainable], lr, wd) for names, lr, wd in groups]
    return named, [g for g in groups if g[0]]


def _basic_optimizer_from_config(resolved, named, groups):
    """The optimizer object DeepSpeed builds from the configuration's "optimizer" block (its
    basic_optimizer), for a scheduler callable to be handed: the model's trainable parameters in
    the engine's groups, with the configuration's hyperparameters. The engine runs the step."""
    kind = json.loads(resolved.get("optimizer.type", "null"))
    if not kind:
        return None
    value = {k[len("optimizer.params."):]: json.loads(v) for k, v in resolved.items() if k.startswith("optimizer.params.")}
    grouped = {n for names, _, _ in groups for n in names}
    param_groups = [{"params": [p for n, p in named if p.requires_grad and n not in grouped]}]
    for names, lr, weight_decay in groups:
        by_name = dict(named)
        group = {"params": [by_name[n] for n in names]}
        if lr is not None:
            group["lr"] = lr
        if weight_decay is not None:
            group["weight_decay"] = weight_decay
        param_groups.append(group)
    common = dict(lr=value["lr"], betas=tuple(value["betas"]), eps=value["eps"], weight_decay=value["weight_decay"],
                  bias_correction=value["bias_correction"])
    if kind in ("Adam", "AdamW"):
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; "AdamW" always is.
        return FusedAdam(param_groups, adam_w_mode=kind == "AdamW" or value["adam_w_mode"], **common)
    if kind == "Lamb":
        return FusedLamb(param_groups, max_grad_norm=value["max_grad_norm"], max_coeff=value["max_coeff"],
                         min_coeff=value["min_coeff"], **common)
    return EngineOptimizer(param_groups, dict(lr=value["lr"], momentum=value["momentum"], dampening=value["dampening"],
                                              nesterov=value["nesterov"], weight_decay=value["weight_decay"]))


_NOTED = set()


def _resolve_keep_in_fp32(model, config, checked):
    """data_types.keep_in_fp32_modules "auto" (the default) as DeepSpeed resolves it: the buffers
    that the model's transformers lists name (_keep_in_fp32_modules_strict, and under fp16
    _keep_in_fp32_modules too) stay in fp32, as patterns the engine matches on full buffer names."""
    fp16 = checked.get("fp16.enabled", "false") == "true"
    if not fp16 and checked.get("bf16.enabled", "false") != "true":
        return
    setting = config.get("data_types", {}).get("keep_in_fp32_modules", "auto")
    if setting != "auto":
        return
    patterns = set()
    for path, child in model.named_modules():
        names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
        if fp16:
            names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
        patterns |= {f"{path}.*{name}" if path else name for name in names}
    if patterns:
        config.setdefault("data_types", {})["keep_in_fp32_modules"] = sorted(patterns)


def _note_once(key, text):
    if key in _NOTED or comm.get_rank() != 0:
        return
    _NOTED.add(key)
    print(f"zerotrain: note: {text}", file=sys.stderr, flush=True)


def _load_config(config, args):
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("zerotrain.initialize: expected a configuration: config= (a path or a dict) or "
                         "args.deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"zerotrain.initialize: cannot read the configuration {path}: {e.strerror}") from None
        try:
            return _finite(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"zerotrain.initialize: the configuration {path} is not JSON: {e}") from None
    if isinstance(config, dict):
        return _finite(json.loads(json.dumps(config)))  # a copy, and non-JSON values refused here
    raise TypeError(f"zerotrain.initialize: expected config to be a path or a dict, found {type(config).__name__}")


def _finite(config):
    """steps_per_print: inf is DeepSpeed's "never report" (Accelerate writes it); JSON, which the C++
    parser reads, has no infinity, so it becomes the largest count, which never comes either. Any
    other infinity or NaN is refused here, naming its key."""
    if isinstance(config, dict) and config.get("steps_per_print") == math.inf:
        config["steps_per_print"] = sys.maxsize

    def check(value, path):
        if isinstance(value, float) and not math.isfinite(value):
            raise _C.ConfigError(f"{path}: expected a finite number, found {value}")
        for key, item in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
            check(item, f"{path}.{key}" if path else str(key))

    check(config, "")
    return config


def _check_parameters(model):
    """Refuses a model whose parameters another live engine holds, or that have no values."""
    for name, p in model.named_parameters():
        if _registry.engine_of(p) is not None:
            raise ValueError(f"zerotrain.initialize: the model's parameter {name!r} is held by another engine that is "
                             "still alive (it would train nothing once this one took the parameters); call "
                             "destroy() on that engine first to hand the module over")
        if _released.is_released(p) and "_zt_shard" not in p.__dict__:
            raise ValueError(f"zerotrain.initialize: the model's parameter {name!r} has no values: "
                             f"{_released.why(p)}")


def _note_unread_blocks(model, config):
    """Notes the configuration's blocks that only the command line reads, and DeepSpeed's reporting
    that zerotrain does not produce."""
    own = [k for k in ("model", "data", "train") if k in config
           and not (k == "model" and getattr(model, "cpp_module", None) is not None)]  # zerotrain.models read it
    if own:
        _note_once("own-blocks", f"the configuration's {', '.join(own)} block(s) are read by the zerotrain command "
                                 "line only (from Python, train.retain_freed_memory alone); the script's own model "
                                 "and loop are used")
    reporting = [k for k in ("tensorboard", "wandb", "comet")
                 if isinstance(config.get(k), dict) and config[k].get("enabled")]
    if reporting:
        _note_once("reporting", f"{', '.join(reporting)}: DeepSpeed reports zerotrain does not produce; ignored")


def _mark_stage3(named_parameters, choice, threshold):
    """Stage 3 once the engine holds the parameters: the ones in no unit marked persistent (whole on
    every rank), and a note of how many are sharded."""
    in_units = {id(p) for u in choice.units for p in choice.members[u]}
    partition_parameters.mark_stage3(named_parameters,
                                     {id(p) for _, p in named_parameters if id(p) not in in_units})
    units = choice.units
    trainable = [p for _, p in named_parameters if p.requires_grad]
    total = sum(p.numel() for p in trainable)
    sharded = sum(p.numel() for u in units for p in choice.members[u] if p.requires_grad)
    if not units:
        _note_once("stage3-units", "stage 3: no submodule qualifies as a unit to shard (stage3_param_persistence_"
                                   f"threshold {threshold}): every rank keeps all {total} parameters whole; "
                                   "gradients and optimizer states are partitioned")
    else:
        _note_once("stage3-units", f"stage 3: {len(units)} units sharded ({sharded} of {total} trainable "
                                   "parameters); the rest are kept whole on every rank")
