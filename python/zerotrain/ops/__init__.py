"""Client optimizers with DeepSpeed's names. Handed to zerotrain.initialize(optimizer=...), each says
which of the engine's fused kernels runs and with which hyperparameters; the engine (C++) runs the
step over its own flat partitions. Used on their own, outside an engine, they refuse to step."""
from . import adam, lamb  # noqa: F401
