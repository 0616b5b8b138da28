"""deepspeed.compression: DeepSpeed 0.19 removed its compression library and keeps this package for
the two helpers scripts imported from it (deepspeed.compression.helper)."""
from . import helper  # noqa: F401
