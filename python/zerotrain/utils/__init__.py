"""DeepSpeed's deepspeed.utils: the fp32 master weights of an engine's parameters, stage-3 leaf
modules, DeepSpeed's logger and log_dist, the data-parallel groups and small helpers."""
from .. import _registry, _unsupported
from . import groups, logging, module_utils, zero_to_fp32  # noqa: F401
from .logging import log_dist, log_dist_once, logger, print_dist, set_log_level_from_string  # noqa: F401
from .module_utils import recursive_getattr, recursive_setattr  # noqa: F401


class RepeatingLoader:
    """Iterates over `loader` for ever, starting it again whenever it is exhausted."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


def safe_get_full_fp32_param(param):
    """The fp32 master values of `param`, whole (a collective: every rank calls it, in the same order);
    None for a tensor no engine trains."""
    found = _registry.engine_of(param)
    if found is None:
        return None
    engine, name = found
    return engine._engine.master_parameter(name)


def safe_set_full_fp32_param(param, value):
    """Replaces the fp32 master values of `param` (and its working copy) with `value` on every rank (a
    collective). Reads and rewrites the rank's state once: meant for set-up, not every step."""
    found = _registry.engine_of(param)
    if found is None:
        raise ValueError("safe_set_full_fp32_param: the tensor is not a parameter an engine trains")
    engine, name = found
    engine._engine.set_master_parameter(name, value)


# ---------------------------------------------------------------------------- stage-3 leaf modules
# DeepSpeed's deepspeed.utils.set_z3_leaf_modules and relatives: a module flagged as a leaf is one
# stage-3 unit with every parameter of its subtree, gathered as a whole before its forward (for a
# mixture of experts, whose experts run in an order that changes from batch to batch, or a
# subtree too finely divided to gather piece by piece). The flag is the attribute DeepSpeed uses,
# `_z3_leaf`, so that code setting it either way is understood; zerotrain.initialize reads it at
# stage 3 (docs/python.md "Stage 3: units").

def z3_leaf_module(module):
    """Whether `module` is flagged as a stage-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def set_z3_leaf_module(module, flag):
    module._z3_leaf = bool(flag)


def get_z3_leaf_modules(model):
    """The modules of `model` flagged as leaves, in module order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _matches_class(module, wanted):
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(model, classes, flag, raise_if_not_found, function):
    if isinstance(classes, (str, type)):
        classes = [classes]
    classes = list(classes)
    for c in classes:
        if not isinstance(c, (str, type)):
            raise TypeError(f"zerotrain.utils.{function}: expected module classes or class names, found "
                            f"{type(c).__name__} {c!r}")
    matched = [m for m in model.modules() if any(_matches_class(m, c) for c in classes)]
    for m in matched:
        m._z3_leaf = flag
    if not matched and raise_if_not_found:
        names = [c.__name__ if isinstance(c, type) else c for c in classes]
        raise ValueError(f"zerotrain.utils.{function}: expected a module of class {', '.join(names)} in the model, "
                         "found none")
    return matched


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found=True):
    """Flags every module of `model` that is an instance of one of `leaf_module_classes` (classes, or
    names: the class's own name or its module-qualified name) as a stage-3 leaf; returns them.
    Call before zerotrain.initialize."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found, "set_z3_leaf_modules")


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found=True):
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found, "unset_z3_leaf_modules")


def set_z3_leaf_modules_by_name(model, module_names, flag=True, raise_if_not_found=True):
    """Flags the modules named (as in model.named_modules()); returns (matched, missing names)."""
    modules = dict(model.named_modules())
    matched, missing = [], []
    for name in ([module_names] if isinstance(module_names, str) else module_names):
        if name in modules:
            modules[name]._z3_leaf = flag
            matched.append(modules[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"zerotrain.utils.set_z3_leaf_modules_by_name: expected modules named {missing} in the "
                         "model, found none of that name")
    return matched, missing


def set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag=True, raise_if_not_found=True):
    """Flags the modules whose name in model.named_modules() ends with one of the suffixes; returns
    (matched, suffixes that matched nothing)."""
    matched, missing, seen = [], [], set()
    named = list(model.named_modules())
    for suffix in ([module_name_suffixes] if isinstance(module_name_suffixes, str) else module_name_suffixes):
        hit = False
        for name, m in named:
            if name.endswith(suffix):
                m._z3_leaf = flag
                hit = True
                if id(m) not in seen:
                    seen.add(id(m))
                    matched.append(m)
        if not hit:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"zerotrain.utils.set_z3_leaf_modules_by_suffix: expected module names ending with "
                         f"{missing} in the model, found none")
    return matched, missing


def z3_leaf_parameter(param):
    """Whether `param` belongs to a stage-3 leaf module: DeepSpeed's flag on the parameter, which
    zerotrain does not set (its leaves are flagged on the module, `_z3_leaf`)."""
    return hasattr(param, "ds_z3_leaf_module")


# The optimizer state and gradients of one parameter: the C++ engine offers the fp32 masters only
# (master_parameter / set_master_parameter), so these are not reachable from Python.
_STATE = "the engine exposes a parameter's fp32 master values only (safe_get_full_fp32_param)"
for _name in ("safe_get_full_grad", "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
              "safe_set_full_grad", "safe_get_local_fp32_param", "safe_get_local_grad",
              "safe_get_local_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
              "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "get_full_hp_param",
              "get_full_hp_grad", "set_full_hp_param", "set_full_hp_grad", "get_hp_fragment_mapping",
              "map_to_flat_opt_states", "link_hp_params",
              "lazy_init_hp_params_optimizer_state"):
    globals()[_name] = _unsupported.function(f"deepspeed.utils.{_name}", _STATE)
tensor_fragment = _unsupported.cls("deepspeed.utils.tensor_fragment", _STATE)
fragment_address = _unsupported.cls("deepspeed.utils.fragment_address", _STATE)
OnDevice = _unsupported.cls("deepspeed.utils.OnDevice", "build the model on the CPU in its own dtype, or under "
                            "zerotrain.zero.Init")
instrument_w_nvtx = _unsupported.function("deepspeed.utils.instrument_w_nvtx")
get_numactl_cmd = _unsupported.function("deepspeed.utils.get_numactl_cmd")
del _name
