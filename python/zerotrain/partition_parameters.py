"""deepspeed.runtime.zero.partition_parameters: the module Init, GatheredParameters and
register_external_parameter live in under DeepSpeed (zerotrain.zero here), with the names
transformers reaches in it when it builds a model under ZeRO-3 (integrations/deepspeed.py
prevent_arange_dtype_change swaps zero_wrapper_for_fp_tensor_constructor and compares with
_orig_torch_arange) and the parameter states.

zerotrain's Init builds in the model's own dtype on the CPU and changes no tensor constructor
(the engine makes the 16-bit copy itself), so the wrapper below is DeepSpeed's function for
whoever calls it, not something Init runs.
"""
from enum import Enum

import torch

class ZeroParamType(Enum):
    NORMAL = 1       # a parameter whole on every rank
    PARTITIONED = 2  # split over the data-parallel ranks
    REMOTE = 3       # held by one rank only


class DeepSpeedTensorOverride(Enum):
    dtype = 1   # Init's tensor constructors make floating-point tensors in its dtype
    device = 2  # and on its device


class ZeroParamStatus(Enum):
    AVAILABLE = 1      # whole and ready on every rank
    NOT_AVAILABLE = 2  # partitioned or remote on some rank
    INFLIGHT = 3       # being gathered


class ZeroParameter(torch.nn.Parameter):
    """A parameter trained by a ZeRO stage-3 engine, with the attributes DeepSpeed gives its own
    (what libraries read: TRL asks ds_status before gathering a head it uses outside the head's
    forward, transformers counts ds_numel). zerotrain keeps a parameter's shape while it is
    partitioned and empties its storage instead, so the status is read from the storage."""

    @property
    def ds_status(self):
        whole = self.untyped_storage().nbytes() >= self.numel() * self.element_size()
        return ZeroParamStatus.AVAILABLE if whole else ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_numel(self):
        return self.numel()

    @property
    def ds_shape(self):
        return self.shape

    @property
    def ds_persist(self):
        return self.__dict__.get("_zt_persist", False)


def mark_stage3(named_parameters, persistent):
    """Gives the engine's parameters DeepSpeed's stage-3 attributes (ZeroParameter): ds_id in
    registration order; persistent: the ids of those kept whole on every rank."""
    for index, (_, p) in enumerate(named_parameters):
        if type(p) is torch.nn.Parameter:
            p.__class__ = ZeroParameter
        p.__dict__["ds_id"] = index
        p.__dict__["_zt_persist"] = id(p) in persistent


# After the enums: zerotrain.zero imports them back from this module, as deepspeed.zero holds them too.
from .accelerator import get_accelerator  # noqa: E402,F401  (transformers reads it here, as in DeepSpeed's module)
from .zero import GatheredParameters, Init, register_external_parameter, unregister_external_parameter  # noqa: E402,F401

_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """`fn` (a tensor constructor) making its tensors on `target_device` when no device is given,
    and floating-point ones in `target_fp_dtype`."""

    def wrapped_fn(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped_fn
