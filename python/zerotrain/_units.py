"""Stage 3's units for a Python module: which submodules' parameters are sharded and gathered
together, and the forward wrappers that gather them (docs/python.md "Stage 3").

A unit is a submodule that owns parameters directly and has no descendant that does (a Linear, an
Embedding, a LayerNorm), with at least stage3_param_persistence_threshold trainable elements. Its
parameters are one block of the engine (zerotrain/zero/blocks.h): gathered just before its forward,
released after, gathered again before its backward, prefetched along the recorded order. Every
other parameter is persistent: whole on every rank. A submodule that uses a unit's parameters as
its own (a head tied to an embedding) runs with that unit gathered. A parameter used directly by
a module that is not a unit (a container's own nn.Parameter), or a module whose parameters belong
to several units, makes the units involved persistent: their forward would otherwise read
parameters that are not there.

A module flagged as a leaf (zero_optimization.leaf_module, or zerotrain.utils.set_z3_leaf_modules:
DeepSpeed's `_z3_leaf`) is one unit instead, holding every parameter of its subtree: gathered
before its forward as a whole, with no unit inside it. The persistence threshold applies to the
subtree's total.
"""
import torch
import torch.utils._pytree as pytree

from . import _C, utils

# DeepSpeed 0.19.8's zero_optimization.leaf_module.classes when the configuration leaves it out:
# its mixture-of-experts blocks, whose experts run in an order that changes from batch to batch.
DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
_LEAF_KEYS = ("classes", "names", "name_suffixes")


def leaf_config(zero):
    """zero_optimization.leaf_module as DeepSpeed reads it: {classes, names, name_suffixes}, each a
    string or a list of strings; classes default to DeepSpeed's MoE blocks, the others to none.
    Returns (the three lists, which of them the configuration set)."""
    value = zero.get("leaf_module") if isinstance(zero, dict) else None
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError("zero_optimization.leaf_module: expected an object with classes, names and name_suffixes, "
                         f"found {type(value).__name__} {json_text(value)}")
    unknown = sorted(k for k in value if k not in _LEAF_KEYS)
    if unknown:
        raise ValueError(f"zero_optimization.leaf_module: expected the keys classes, names and name_suffixes, found "
                         f"{', '.join(repr(k) for k in unknown)}")
    out = {"classes": list(DEFAULT_LEAF_CLASSES), "names": [], "name_suffixes": []}
    for key in _LEAF_KEYS:
        if key not in value:
            continue
        given = [value[key]] if isinstance(value[key], str) else value[key]
        if not isinstance(given, list) or not all(isinstance(v, str) for v in given):
            raise ValueError(f"zero_optimization.leaf_module.{key}: expected a string or a list of strings, found "
                             f"{json_text(value[key])}")
        out[key] = list(dict.fromkeys(given))
    customized = [k for k in _LEAF_KEYS if k in value and out[k] != (DEFAULT_LEAF_CLASSES if k == "classes" else [])]
    return out, customized


def json_text(value):
    import json

    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def apply_leaf_config(model, zero):
    """Flags the modules zero_optimization.leaf_module names as leaves (as DeepSpeed does when its
    engine is built); returns (the modules flagged, one note per entry that matched nothing, for
    the entries the configuration set)."""
    cfg, customized = leaf_config(zero)
    matched, notes = [], []
    if cfg["classes"]:
        matched += utils.set_z3_leaf_modules(model, cfg["classes"], raise_if_not_found=False)
    if cfg["names"]:
        found, missing = utils.set_z3_leaf_modules_by_name(model, cfg["names"], raise_if_not_found=False)
        matched += found
        if missing and "names" in customized:
            notes.append(f"zero_optimization.leaf_module.names: no module is named {', '.join(missing)}")
    if cfg["name_suffixes"]:
        found, missing = utils.set_z3_leaf_modules_by_suffix(model, cfg["name_suffixes"], raise_if_not_found=False)
        matched += found
        if missing and "name_suffixes" in customized:
            notes.append(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {', '.join(missing)}")
    matched = list({id(m): m for m in matched}.values())
    if not matched and customized:
        notes.append("zero_optimization.leaf_module matched no module of the model; units are chosen as usual")
    return matched, notes


class UnitChoice:
    """What choose_units decides: `units` (paths, module order), `members` ({unit: its parameters}),
    `users` ({module path: [unit paths]}: every module whose forward must run with units gathered,
    innermost first) and `absorbed` (units built sharded under zero.Init that now lie inside a leaf:
    to be made whole again, since the leaf is their unit)."""

    def __init__(self, units, members, users, absorbed):
        self.units, self.members, self.users, self.absorbed = units, members, users, absorbed


def choose_units(model, threshold, built_sharded=(), external=None):
    """The stage-3 units of `model`. `built_sharded`: paths of units built under zero.Init, units
    whatever the threshold; `external`: {module path: [parameters]} from
    register_external_parameter."""
    modules = dict(model.named_modules())
    owner, direct = _parameter_owners(modules)
    leaves = _outermost_leaves(modules)

    def leaf_of(path):
        for leaf in leaves:
            if _inside(path, leaf):
                return leaf
        return None

    def group_of(path):  # the unit a module's own parameters would belong to
        leaf = leaf_of(path)
        return path if leaf is None else leaf

    group = {pid: group_of(path) for pid, path in owner.items()}
    members = {}
    for path, params in direct.items():
        for p in params:
            g = group[id(p)]
            if not any(q is p for q in members.setdefault(g, [])):
                members[g].append(p)

    has_param_descendant = set()
    for path in direct:
        parts = path.split(".") if path else []
        for i in range(len(parts)):
            has_param_descendant.add(".".join(parts[:i]))
    candidates = {leaf for leaf in leaves if members.get(leaf)}
    candidates |= {path for path, params in direct.items() if leaf_of(path) is None and path not in has_param_descendant
                   and all(owner[id(p)] == path for p in params)}
    excluded = set()
    for path, params in direct.items():
        groups = {group[id(p)] for p in params}
        # Inside a leaf a container's own parameters are gathered with the rest of the subtree.
        if (path in has_param_descendant and leaf_of(path) is None) or len(groups) > 1:
            excluded |= groups
    # In module order: gathering them is a collective, issued in the same order on every rank.
    absorbed = [path for path in modules if path in built_sharded and leaf_of(path) is not None]
    for path in built_sharded:
        if path in absorbed:
            continue
        if path not in candidates or path in excluded:
            raise ValueError(f"zerotrain: '{path}' was built sharded under zerotrain.zero.Init, but another module reads "
                             "its parameters directly (a container's own use, or a module whose parameters belong to "
                             "several units); build the model without zero.Init, or gather them with "
                             "register_external_parameter")
    units = []
    for path in modules:  # module order
        if path not in candidates or path in excluded:
            continue
        trainable = sum(p.numel() for p in members[path] if p.requires_grad)
        if path in built_sharded or (trainable > 0 and trainable >= threshold):
            units.append(path)
    users = _unit_users(set(units), leaves, direct, group, external)
    return UnitChoice(units, {u: members[u] for u in units}, users, absorbed)


def _parameter_owners(modules):
    """For {path: module}: ({id(parameter): path of the first module that owns it directly},
    {module path: its direct parameters})."""
    owner = {}
    direct = {}
    for path, m in modules.items():
        params = [p for p in m._parameters.values() if p is not None]
        if params:
            direct[path] = params
            for p in params:
                owner.setdefault(id(p), path)
    return owner, direct


def _outermost_leaves(modules):
    """The leaves among {path: module}: flagged modules not inside another leaf (DeepSpeed stops at
    the outermost one), in module order."""
    leaves = []
    for path, m in modules.items():
        if utils.z3_leaf_module(m) and not any(_inside(path, leaf) for leaf in leaves):
            if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                raise ValueError(f"zerotrain: the stage-3 leaf '{path}' is a {type(m).__name__}, whose forward never runs, "
                                 "so its parameters would never be gathered; flag the modules it holds, or the module "
                                 "that runs them")
            leaves.append(path)
    return leaves


def _unit_users(unit_set, leaves, direct, group, external):
    """UnitChoice.users: {module path: [unit paths]}, innermost first, for the units in `unit_set`;
    `group`: {id(parameter): the path of the module that owns it, or of the leaf around that one}."""
    users = {}

    def use(path, unit):
        if unit in unit_set and not _inside(path, unit) and unit not in users.get(path, []):
            users.setdefault(path, []).append(unit)

    for leaf in leaves:
        if leaf in unit_set:
            users[leaf] = [leaf]
    for path, params in direct.items():
        groups = {group[id(p)] for p in params}
        if len(groups) == 1:
            unit = next(iter(groups))
            if unit == path:
                if unit in unit_set and unit not in users.get(path, []):
                    users.setdefault(path, []).insert(0, unit)
            else:
                use(path, unit)  # a tied user; inside its own leaf the leaf's gather covers it
    for path, params in (external or {}).items():
        for p in params:
            use(path, group.get(id(p)))
    return users


def _inside(path, ancestor):
    """Whether module `path` is `ancestor` or lies in its subtree ("" is the root)."""
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


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
                    shells[unit] = shell if unit == "" else _C.shell_submodule(shell, unit)
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
