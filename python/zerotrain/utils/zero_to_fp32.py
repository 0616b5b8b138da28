"""deepspeed.utils.zero_to_fp32. zerotrain's checkpoints are its own format (docs/checkpoint.md),
which the command line turns into fp32 weights: `zerotrain export DIR --out model.safetensors`
(any world size and stage, one tensor per parameter under the model's names)."""
from .. import _unsupported

_EXPORT = "run `zerotrain export CHECKPOINT_DIR --out model.safetensors` for the fp32 weights"

get_fp32_state_dict_from_zero_checkpoint = _unsupported.function(
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint", _EXPORT)
convert_zero_checkpoint_to_fp32_state_dict = _unsupported.function(
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict", _EXPORT)
convert_zero_checkpoint_to_state_dict = _unsupported.function(
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict", _EXPORT)
load_state_dict_from_zero_checkpoint = _unsupported.function(
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint", _EXPORT)
