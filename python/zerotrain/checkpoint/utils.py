"""deepspeed.checkpoint.utils: the helpers libraries call on state dicts, with DeepSpeed's meaning
(Accelerate clones a state dict with clone_tensors_for_torch_save before saving it)."""
import torch

from .. import _unsupported


def clone_tensors_for_torch_save(item, device=torch.device("cpu")):
    """A copy of item with every tensor in it (nested in lists, tuples and dicts) detached and
    cloned onto device, so that saving it writes only those tensors' elements, never a larger
    storage they view."""
    if torch.is_tensor(item):
        device = torch.device(device)
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


_OWN_FILES = "zerotrain's checkpoints name their files in their own layout (docs/python.md)"
get_model_ckpt_name_for_rank = _unsupported.function("deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank", _OWN_FILES)
get_zero_ckpt_name_for_rank = _unsupported.function("deepspeed.checkpoint.utils.get_zero_ckpt_name_for_rank", _OWN_FILES)
get_layer_ckpt_name_for_rank = _unsupported.function("deepspeed.checkpoint.utils.get_layer_ckpt_name_for_rank", _OWN_FILES)
