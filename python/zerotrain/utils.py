"""DeepSpeed's deepspeed.utils helpers for the fp32 master weights of an engine's parameters."""
from . import _registry


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
