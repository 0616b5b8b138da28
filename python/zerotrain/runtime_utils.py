"""deepspeed.runtime.utils: the helpers of DeepSpeed's that scripts import from here
(see_memory_usage, move_to_device), with DeepSpeed's meaning. The module's other names are
DeepSpeed's engine internals: each resolves and raises NotSupportedError when used."""
import gc
import resource

import torch

from . import _unsupported
from .utils.logging import logger


def see_memory_usage(message, force=False):
    """Logs message with this process's memory: the peak resident set of the host and, on a GPU,
    the device's allocated and reserved bytes, as DeepSpeed prints them. Does nothing unless force
    (DeepSpeed's default), and only on rank 0."""
    if not force:
        return
    from . import comm

    rank = comm.get_rank() if comm.is_initialized() else 0
    if rank != 0:
        return
    gc.collect()
    line = f"{message} | host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gb = 2**30
        line += (f" | device allocated {torch.cuda.memory_allocated() / gb:.2f} GB, max "
                 f"{torch.cuda.max_memory_allocated() / gb:.2f} GB, reserved {torch.cuda.memory_reserved() / gb:.2f} GB")
        torch.cuda.reset_peak_memory_stats()
    logger.info(line)


def move_to_device(item, device, criterion_func=None):
    """Moves the tensors in item (nested in lists, tuples and dicts) that criterion_func accepts to
    device by replacing their data in place, and copies the others there, as DeepSpeed does;
    returns item's new form."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    value = _unsupported.function(f"deepspeed.runtime.utils.{name}", "one of DeepSpeed's engine internals")
    globals()[name] = value
    return value
