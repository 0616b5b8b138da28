"""deepspeed.runtime: where DeepSpeed keeps its engine, schedules and ZeRO. The same zerotrain
modules answer under DeepSpeed's names (install_as_deepspeed registers deepspeed.runtime.<name>):
deepspeed.runtime.zero is zerotrain.zero, deepspeed.runtime.engine zerotrain.engine, and so on."""
from . import engine, lr_schedules, partition_parameters, zero  # noqa: F401
