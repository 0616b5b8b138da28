"""Activation checkpointing (deepspeed.checkpointing.checkpoint): the engine's recomputation, which
keeps only the function's inputs and runs it again in backward with the random-number generators
of the first run, so dropout draws the same masks."""
import functools

import torch

from . import _C, _unsupported


def checkpoint(function, *args):
    """function(*args) with only `args` kept for backward. `function` must return one tensor and
    compute the same values when run again (it may draw random numbers). The trainable parameters it
    reads are found when it is a torch.nn.Module, a method of one, or a functools.partial of either
    (as transformers' layers pass themselves), so that a block whose input needs no gradient still
    trains its weights. For a transformers model:
    model._set_gradient_checkpointing(True, zerotrain.checkpointing.checkpoint)."""
    tensors = []
    for a in args:
        if not torch.is_tensor(a):
            raise TypeError(f"zerotrain.checkpointing.checkpoint: expected tensor arguments, found {type(a).__name__} "
                            "(bind other arguments into the function, e.g. with functools.partial)")
        tensors.append(a)
    owner = function
    while isinstance(owner, functools.partial):  # transformers: partial(layer.forward, layer, **kwargs)
        owner = owner.args[0] if owner.args and isinstance(owner.args[0], torch.nn.Module) else owner.func
    if not isinstance(owner, torch.nn.Module):
        owner = getattr(owner, "__self__", None)
    params = [p for p in owner.parameters() if p.requires_grad] if isinstance(owner, torch.nn.Module) else []
    return _C.checkpoint(function, tensors, params)


def is_configured():
    return True


def non_reentrant_checkpoint(function, *args):
    """DeepSpeed's other implementation of checkpoint(), with the same meaning: this one."""
    return checkpoint(function, *args)


# DeepSpeed's activation-checkpointing settings: zerotrain's recomputation keeps the function's
# inputs whole on this rank and recomputes with the first run's random numbers; it has no
# partitioned, CPU or contiguous copies to configure and no model-parallel random-number tracker.
_SETTINGS = "the engine's recomputation has no settings (zerotrain.checkpointing.checkpoint)"
configure = _unsupported.function("deepspeed.checkpointing.configure", _SETTINGS)
reset = _unsupported.function("deepspeed.checkpointing.reset", _SETTINGS)
set_num_layers = _unsupported.function("deepspeed.checkpointing.set_num_layers", _SETTINGS)
partition_activations_in_checkpoint = _unsupported.function(
    "deepspeed.checkpointing.partition_activations_in_checkpoint", _SETTINGS)
get_cuda_rng_tracker = _unsupported.function("deepspeed.checkpointing.get_cuda_rng_tracker",
                                             "zerotrain trains data-parallel only")
model_parallel_cuda_manual_seed = _unsupported.function("deepspeed.checkpointing.model_parallel_cuda_manual_seed",
                                                        "zerotrain trains data-parallel only")
