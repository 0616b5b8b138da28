"""deepspeed.utils.module_utils: a submodule or attribute by its dotted name."""


def recursive_getattr(model, module_name):
    """model.a.b.c for module_name "a.b.c"."""
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name, module):
    """Sets model.a.b.c = module for module_name "a.b.c"."""
    *path, last = module_name.split(".")
    output = model
    for name in path:
        output = getattr(output, name)
    output.__setattr__(last, module)
