"""Stage 3's units for a Python module: which submodules' parameters are sharded and gathered
together, and the forward wrappers that gather them (docs/python.md "Stage 3").

A unit is a submodule that owns parameters directly and has no descendant that does (a Linear, an
Embedding, a LayerNorm), with at least stage3_param_persistence_threshold trainable elements. Its
parameters are one block of the engine (zerotrain/blocks.h): gathered just before its forward,
released after, gathered again before its backward, prefetched along the recorded order. Every
other parameter is persistent: whole on every rank. A submodule that uses a unit's parameters as
its own (a head tied to an embedding) runs with that unit gathered. A parameter used directly by
a module that is not a unit (a container's own nn.Parameter), or a module whose parameters belong
to several units, makes the units involved persistent: their forward would otherwise read
parameters that are not there.
"""
import torch
import torch.utils._pytree as pytree

from . import _C


def choose_units(model, threshold, built_sharded=(), external=None):
    """(units, users): unit paths in module order, and {module path: [unit paths]} for every module
    whose forward must run with units gathered (the unit itself included). `built_sharded`: paths
    of units built under zero.Init, units whatever the threshold; `external`: {module path:
    [parameters]} from register_external_parameter."""
    modules = dict(model.named_modules())
    owner = {}  # id(parameter) -> path of the first module that owns it directly
    direct = {}  # module path -> its direct parameters
    for path, m in modules.items():
        params = [p for p in m._parameters.values() if p is not None]
        if params:
            direct[path] = params
            for p in params:
                owner.setdefault(id(p), path)
    has_param_descendant = set()
    for path in direct:
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            has_param_descendant.add(".".join(parts[:i]))
    candidates = {path for path in direct if path not in has_param_descendant and path == owner[id(direct[path][0])]}
    candidates = {path for path in candidates if all(owner[id(p)] == path for p in direct[path])}
    excluded = set()
    for path, params in direct.items():
        owners = {owner[id(p)] for p in params}
        if path in has_param_descendant or len(owners) > 1:
            excluded |= owners
    for path in built_sharded:
        if path not in candidates or path in excluded:
            raise ValueError(f"zerotrain: '{path}' was built sharded under zerotrain.zero.Init, but another module reads "
                             "its parameters directly (a container's own use, or a module whose parameters belong to "
                             "several units); build the model without zero.Init, or gather them with "
                             "register_external_parameter")
    units = []
    for path in modules:  # module order
        if path not in candidates or path in excluded:
            continue
        trainable = sum(p.numel() for p in direct[path] if p.requires_grad)
        if path in built_sharded or (trainable > 0 and trainable >= threshold):
            units.append(path)
    unit_set = set(units)
    users = {}
    for path, params in direct.items():
        owners = {owner[id(p)] for p in params}
        if len(owners) == 1 and next(iter(owners)) in unit_set:
            users.setdefault(path, []).append(next(iter(owners)))
    for path, params in (external or {}).items():
        for p in params:
            unit = owner.get(id(p))
            if unit in unit_set and unit not in users.get(path, []):
                users.setdefault(path, []).append(unit)
    return units, users


class UnitForwards:
    """Wraps the forward of each module that runs with a unit gathered; restore() undoes it."""

    def __init__(self, model, shell, users):
        self._wrapped = []
        modules = dict(model.named_modules())
        shells = {}
        for path, units in users.items():
            module = modules[path]
            had_own = "forward" in module.__dict__
            original = forward = module.forward
            for unit in units:  # the module's own unit innermost
                if unit not in shells:
                    shells[unit] = _C.shell_submodule(shell, unit)
                forward = _gathered_forward(forward, shells[unit])
            module.forward = forward
            self._wrapped.append((module, had_own, original))
        self.shells = shells

    def restore(self):
        for module, had_own, original in self._wrapped:
            if had_own:
                module.forward = original
            else:
                del module.forward
        self._wrapped = []


def _gathered_forward(original, unit_shell):
    def forward(*args, **kwargs):
        box = []

        def run():
            flat, spec = pytree.tree_flatten(original(*args, **kwargs))
            box.append((flat, spec))
            return [t for t in flat if torch.is_tensor(t)]

        outputs = iter(_C.run_unit(unit_shell, run))
        flat, spec = box[0]
        return pytree.tree_unflatten([next(outputs) if torch.is_tensor(t) else t for t in flat], spec)

    forward.__wrapped__ = original
    return forward
