"""Activation checkpointing (deepspeed.checkpointing.checkpoint): the engine's recomputation, which
keeps only the function's inputs and runs it again in backward with the random-number generators
of the first run, so dropout draws the same masks."""
import functools

import torch

from . import _C


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
