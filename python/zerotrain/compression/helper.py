"""deepspeed.compression.helper: recursive_getattr and recursive_setattr, which DeepSpeed 0.19 keeps
here for the scripts that import them from this module (they live in deepspeed.utils.module_utils)."""
from ..utils.module_utils import recursive_getattr, recursive_setattr  # noqa: F401

__all__ = ["recursive_getattr", "recursive_setattr"]
