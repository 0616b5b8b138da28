"""Where each DeepSpeed module a script or library imports by name lives in zerotrain, for
install_as_deepspeed(). DeepSpeed's layout has more levels than zerotrain's (the same zero module
is deepspeed.zero and deepspeed.runtime.zero), so the names are a table rather than a copy of its
directory tree."""
import importlib
import sys

from . import _unsupported

# DeepSpeed's module name -> zerotrain's module that implements it.
MODULES = {
    "deepspeed.accelerator": "zerotrain.accelerator",
    "deepspeed.accelerator.real_accelerator": "zerotrain.accelerator",
    "deepspeed.checkpoint": "zerotrain.checkpoint",
    "deepspeed.checkpoint.utils": "zerotrain.checkpoint.utils",
    "deepspeed.checkpointing": "zerotrain.checkpointing",
    "deepspeed.comm": "zerotrain.comm",
    "deepspeed.comm.comm": "zerotrain.comm",
    "deepspeed.compression": "zerotrain.compression",
    "deepspeed.compression.helper": "zerotrain.compression.helper",
    "deepspeed.launcher": "zerotrain.launcher",
    "deepspeed.launcher.runner": "zerotrain.launcher",
    "deepspeed.moe": "zerotrain.moe",
    "deepspeed.moe.layer": "zerotrain.moe.layer",
    "deepspeed.moe.utils": "zerotrain.moe.utils",
    "deepspeed.ops": "zerotrain.ops",
    "deepspeed.ops.adam": "zerotrain.ops.adam",
    "deepspeed.ops.lamb": "zerotrain.ops.lamb",
    "deepspeed.runtime": "zerotrain.runtime",
    "deepspeed.runtime.engine": "zerotrain.engine",
    "deepspeed.runtime.lr_schedules": "zerotrain.lr_schedules",
    "deepspeed.runtime.utils": "zerotrain.runtime_utils",
    "deepspeed.runtime.zero": "zerotrain.zero",
    "deepspeed.runtime.zero.partition_parameters": "zerotrain.partition_parameters",
    "deepspeed.utils": "zerotrain.utils",
    "deepspeed.utils.groups": "zerotrain.utils.groups",
    "deepspeed.utils.logging": "zerotrain.utils.logging",
    "deepspeed.utils.module_utils": "zerotrain.utils.module_utils",
    "deepspeed.utils.zero_to_fp32": "zerotrain.utils.zero_to_fp32",
    "deepspeed.zero": "zerotrain.zero",
}

# DeepSpeed's subsystems zerotrain has no part of: importable, each name in them not supported.
UNSUPPORTED_MODULES = {
    "deepspeed.inference": "zerotrain trains; it has no inference engine",
    "deepspeed.module_inject": "zerotrain has no kernel injection or tensor parallelism",
    "deepspeed.ops.adagrad": "the engine runs Adam, AdamW, LAMB and SGD",
    "deepspeed.ops.lion": "the engine runs Adam, AdamW, LAMB and SGD",
    "deepspeed.ops.transformer": "zerotrain has no fused transformer kernels",
    "deepspeed.pipe": "zerotrain has no pipeline parallelism",
    "deepspeed.runtime.pipe": "zerotrain has no pipeline parallelism",
    "deepspeed.runtime.sequence_parallel": "zerotrain has no sequence parallelism",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "zerotrain has no sequence parallelism",
}


def _set_parent_attribute(name, module):
    """`import deepspeed.a.b` then `deepspeed.a.b.x` needs b as an attribute of a, which the import
    system sets only for modules it loads itself."""
    parent, _, child = name.rpartition(".")
    # vars(), not hasattr(): a module whose __getattr__ answers every name (an unsupported one, the
    # companion's) would otherwise keep what it made up for the child.
    if parent in sys.modules and child not in vars(sys.modules[parent]):
        setattr(sys.modules[parent], child, module)


def register(package):
    """Makes `package` (zerotrain, or the companion distribution's deepspeed module) answer as
    deepspeed. Refused when a real DeepSpeed is imported already: its modules and zerotrain's would
    be mixed in one process."""
    present = sys.modules.get("deepspeed")
    if present is not None and present is not package and getattr(present, "zerotrain_version", None) is None \
            and present.__name__ != "zerotrain":
        raise ImportError(f"zerotrain cannot stand in for DeepSpeed in this process: DeepSpeed "
                          f"{getattr(present, '__version__', '?')} from {getattr(present, '__file__', '?')} is imported "
                          "already (install_as_deepspeed() must run before anything imports deepspeed)")
    sys.modules["deepspeed"] = package
    made = {}
    for name in sorted(UNSUPPORTED_MODULES):
        made[name] = sys.modules.get(name) or _unsupported.module(name, UNSUPPORTED_MODULES[name])
    for name, target in sorted(MODULES.items()):
        made[name] = importlib.import_module(target)
    for name in sorted(made, key=lambda n: n.count(".")):  # parents first
        sys.modules[name] = made[name]
        _set_parent_attribute(name, made[name])
