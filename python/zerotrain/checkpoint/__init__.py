"""deepspeed.checkpoint: DeepSpeed's tools over its own checkpoint layout (reshaping Megatron 3-D
checkpoints, universal checkpoints). zerotrain's checkpoints have a layout of their own, resharded
on load at any world size, so those tools are not supported by name; the tensor helpers that
libraries call on state dicts (utils) are."""
from .. import _unsupported
from . import utils  # noqa: F401
from .utils import get_layer_ckpt_name_for_rank, get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank  # noqa: F401

_OWN_LAYOUT = "zerotrain's checkpoints have their own layout and reshard on load (docs/python.md)"
DeepSpeedCheckpoint = _unsupported.cls("deepspeed.checkpoint.DeepSpeedCheckpoint", _OWN_LAYOUT)
ZeROCheckpoint = _unsupported.cls("deepspeed.checkpoint.ZeROCheckpoint", _OWN_LAYOUT)
reshape_meg_2d_parallel = _unsupported.function("deepspeed.checkpoint.reshape_meg_2d_parallel", _OWN_LAYOUT)
merge_state = _unsupported.function("deepspeed.checkpoint.merge_state", _OWN_LAYOUT)
model_3d_desc = _unsupported.cls("deepspeed.checkpoint.model_3d_desc", _OWN_LAYOUT)
get_model_3d_descriptor = _unsupported.function("deepspeed.checkpoint.get_model_3d_descriptor", _OWN_LAYOUT)
enable_universal_checkpoint = _unsupported.function("deepspeed.checkpoint.enable_universal_checkpoint", _OWN_LAYOUT)
SubparamShape = _unsupported.cls("deepspeed.checkpoint.SubparamShape", _OWN_LAYOUT)
