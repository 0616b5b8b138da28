"""DeepSpeed's deepspeed.zero for zerotrain's engine: Init (modules born sharded),
GatheredParameters (whole parameters for a while, changes kept) and register_external_parameter.

Init shards each unit (the stage-3 unit of docs/python.md: a submodule that owns parameters
directly, has no descendant that does, and holds at least stage3_param_persistence_threshold
elements) as soon as its constructor returns: this rank keeps 1/world of the unit's parameters and
their storage is freed, so no rank ever holds the whole model. The parameters keep their shapes;
reading one before the engine adopts it raises torch's "data is not allocated" error, never a
silent zero. zerotrain.initialize adopts the shards (each unit gathered once, at construction) at
any stage. A module must initialise its parameters in its own constructor: values written to a
sharded parameter later need GatheredParameters(..., modifier_rank=r). transformers' models are
the exception made for them: their post_init writes the weights after the units are sharded, and
inside Init it runs on each module with that module's units (and its children's) gathered, or,
when it writes deeper than the children, again from the same random state with the module's whole
subtree gathered.
"""
import contextlib
import json
import sys
import weakref

import torch

from . import _C, _registry, _released, _unsupported, comm

DEFAULT_PERSISTENCE_THRESHOLD = 100000  # DeepSpeed's stage3_param_persistence_threshold

# Units built sharded and not yet adopted: module -> its unit shell (the C++ module holding the same
# parameter tensors, registered as a sharded block).
_pending = weakref.WeakKeyDictionary()
_pending_params = weakref.WeakKeyDictionary()  # module -> the parameters its shell holds
# register_external_parameter: module -> the parameters its forward reads that another module owns.
_external = weakref.WeakKeyDictionary()
# Pending unit shells gathered now: id(shell) -> how many GatheredParameters blocks hold it (an inner
# block over a unit already whole must neither refill it from the shards nor free it on leaving).
_gathered_depth = {}


def pending_unit_shell(module):
    return _pending.get(module)


def pending_parameters(module):
    return list(_pending_params.get(module, []))


def forget_pending(module):
    _pending.pop(module, None)
    _pending_params.pop(module, None)


def pending_is_current(module):
    """Whether the unit shell built for `module` under Init still holds its parameters: a parent
    that replaced them afterwards (a tied head's weight set to the embedding's) leaves the shell
    stale, and the old shards are dropped."""
    shell_params = _pending_params.get(module, [])
    current = _direct_parameters(module)
    if len(shell_params) == len(current) and all(a is b for a, b in zip(shell_params, current)):
        return True
    forget_pending(module)
    return False


def external_parameters(module):
    return list(_external.get(module, []))


def _direct_parameters(module):
    return [p for p in module._parameters.values() if p is not None]


def _has_parameter_descendant(module):
    return any(_direct_parameters(m) for name, m in module.named_modules() if m is not module)


class Init:
    """with zerotrain.zero.Init(config_dict_or_path=config): model = MyModel()

    Every argument DeepSpeed's Init takes is accepted; those that would change what is built are
    refused when set (remote_device other than None/"cpu", an mpu, dtype other than fp32)."""

    _active = None

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if module is not None:
            raise ValueError("zerotrain.zero.Init(module=...): sharding an already built module is not supported; "
                             "build it inside the `with` block")
        if remote_device not in (None, "cpu"):
            raise ValueError(f"zerotrain.zero.Init(remote_device={remote_device!r}): only 'cpu' is supported here "
                             "(the engine's offload_param moves shards to NVMe when it is built)")
        if mpu is not None or zero_param_parallel_group is not None or data_parallel_group is not None:
            raise ValueError("zerotrain.zero.Init: process groups other than the whole job are not supported")
        if dtype not in (None, torch.float32):
            raise ValueError(f"zerotrain.zero.Init(dtype={dtype}): the engine makes the 16-bit copy itself; build in fp32")
        if zero_quantized_weights or zero_quantized_nontrainable_weights or param_swapper is not None:
            raise ValueError("zerotrain.zero.Init: quantized weights and parameter swappers are not supported")
        self.enabled = enabled
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        self.threshold = DEFAULT_PERSISTENCE_THRESHOLD
        if cfg is not None:
            if not isinstance(cfg, dict):
                with open(cfg) as f:
                    cfg = json.load(f)
            # "auto" is what Hugging Face leaves for its Trainer to fill (HfDeepSpeedConfig hands Init the
            # configuration before that): as DeepSpeed's Init, such a key is ignored here and the
            # default holds.
            zero = {k: v for k, v in (cfg.get("zero_optimization", {}) or {}).items() if v != "auto"}
            self.threshold = int(zero.get("stage3_param_persistence_threshold",
                                          zero.get("param_persistence_threshold", DEFAULT_PERSISTENCE_THRESHOLD)))
        self._construction = None
        self._patched = []
        self._attributes = []  # (class, name, original) replaced while the block runs
        self._depth = {}

    def __enter__(self):
        if not self.enabled:
            return self
        if Init._active is not None:
            raise RuntimeError("zerotrain.zero.Init: already inside another zero.Init")
        comm.init_distributed()
        c = comm.communicator()
        self._construction = _C.ShardedConstruction(c.rank, c.world_size)
        Init._active = self
        self._patch(torch.nn.Module)
        self._patch_transformers()
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        for cls, original in reversed(self._patched):
            _restore_patch(cls, original)
        self._patched = []
        for cls, name, original in reversed(self._attributes):
            setattr(cls, name, original)
        self._attributes = []
        Init._active = None
        self._construction = None  # the shards outlive it until an engine adopts them
        return False

    # Every module class's own __init__ runs inside a wrapper that shards the instance once its
    # outermost constructor returns (a subclass's body runs after super().__init__()).
    def _patch(self, root):
        classes, stack = [], [root]
        while stack:
            cls = stack.pop()
            classes.append(cls)
            stack.extend(cls.__subclasses__())
        for cls in dict.fromkeys(classes):
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(original)
                self._patched.append((cls, original))
        original_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        init = self

        def init_subclass(cls, **kwargs):
            if original_subclass is not None:
                original_subclass.__func__(cls, **kwargs)
            if Init._active is init and "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                cls.__init__ = init._wrap(original)
                init._patched.append((cls, original))

        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._patched.append((_SubclassHook, original_subclass))

    def _wrap(self, original):
        init = self

        def __init__(module, *args, **kwargs):
            init._patch_transformers()  # transformers may be imported inside the block
            key = id(module)
            init._depth[key] = init._depth.get(key, 0) + 1
            try:
                original(module, *args, **kwargs)
            finally:
                init._depth[key] -= 1
                outermost = init._depth[key] == 0
                if outermost:
                    del init._depth[key]
            if outermost and Init._active is init:
                init._shard(module)

        __init__.__wrapped__ = original
        return __init__

    # transformers' models initialise their weights in post_init, at the end of their constructor,
    # after the units inside have been sharded: PreTrainedModel._initialize_weights(module) runs on
    # one module at a time, in the order that the model built outside Init uses, and writes that
    # module's parameters and its direct children's (an attention's output projection, say). Run it
    # with those units whole, keeping rank 0's values: every rank draws the same random numbers as
    # it would outside Init, so the weights are those of the model built without it.
    def _patch_transformers(self):
        if any(name == "_initialize_weights" for _, name, _ in self._attributes):
            return
        modeling = sys.modules.get("transformers.modeling_utils")
        base = getattr(modeling, "PreTrainedModel", None)
        original = base.__dict__.get("_initialize_weights") if isinstance(base, type) else None
        if original is None:
            return

        def _initialize_weights(model, module, *args, **kwargs):
            if getattr(module, "_is_hf_initialized", False):
                return original(model, module, *args, **kwargs)

            def run_with(members):
                shells = [(_pending[m], _pending_params[m]) for m in members if m in _pending and pending_is_current(m)]
                with _gathered_pending(shells, modifier_rank=0):
                    return original(model, module, *args, **kwargs)

            # An _init_weights that reaches deeper than the direct children (a grandchild's weight)
            # meets a released parameter. Then it runs again with the module's whole subtree gathered,
            # from the same random state, so that it draws what it would have drawn outside Init. Every
            # rank runs the same code on the same shapes, so every rank fails and retries together.
            rng = torch.get_rng_state()
            try:
                return run_with((module, *module.children()))
            except RuntimeError as error:
                if not _is_released_parameter_error(error):
                    raise
            torch.set_rng_state(rng)
            return run_with(tuple(module.modules()))

        _initialize_weights.__wrapped__ = original
        base._initialize_weights = _initialize_weights
        self._attributes.append((base, "_initialize_weights", original))

    def _shard(self, module):
        params = _direct_parameters(module)
        if not params or module in _pending or _has_parameter_descendant(module):
            return
        if sum(p.numel() for p in params if p.requires_grad) < max(self.threshold, 1):
            return
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
            return  # kept whole: the engine refuses such parameters itself with a clear message
        named = [(name, p) for name, p in module._parameters.items() if p is not None]
        shell = _C.make_module_shell(named, [])
        _C.mark_block(shell)
        _pending[module] = shell
        _pending_params[module] = [p for _, p in named]
        # Each parameter keeps the block's shard and where it lies in it: a parameter that outlives
        # its module (replaced by a resize, say) is still gathered from it.
        shard, total, rank, world = _C.pending_shard(shell)
        offset = 0
        for _, p in named:
            p.__dict__["_zt_shard"] = (shard, offset, total, rank, world)
            offset += p.numel()
            _released.release(p, _released.WHY_INIT)


def _is_released_parameter_error(error):
    """The error for a parameter whose storage a sharded unit has released (ours, or torch's)."""
    return isinstance(error, _released.ReleasedParameterError) or "data is not allocated" in str(error)


def adopted(params):
    """The engine holds these parameters now: they are ordinary parameters again."""
    for p in params:
        p.__dict__.pop("_zt_shard", None)
        _released.restore(p)


def orphans(params):
    """Parameters built sharded whose module's shards are gone (the module was replaced and
    collected): each still holds its shard, gathered by gather_orphans."""
    live = {id(q) for held in _pending_params.values() for q in held}
    return [p for p in params if _released.is_released(p) and "_zt_shard" in p.__dict__ and id(p) not in live]


def gather_orphans(params, communicator):
    """Gives each parameter its storage back, filled from every rank's shard (a collective, in the
    order given, the same on every rank)."""
    with torch.no_grad():
        for p in params:
            shard, offset, total, rank, world = p.__dict__["_zt_shard"]
            if world != communicator.world_size or rank != communicator.rank:
                raise RuntimeError(f"GatheredParameters: a parameter was sharded as rank {rank} of {world}, this process is "
                                   f"rank {communicator.rank} of {communicator.world_size}")
            if world > 1:
                parts = [torch.empty_like(shard) for _ in range(world)]
                torch.distributed.all_gather(parts, shard)
                whole = torch.cat(parts)
            else:
                whole = shard
            p.untyped_storage().resize_(p.numel() * p.element_size())
            _released.restore(p)
            p.view(-1).copy_(whole[offset:offset + p.numel()])


def reshard_orphans(params):
    """Keeps this rank's part of what each gathered orphan holds now and frees its storage again."""
    with torch.no_grad():
        for p in params:
            shard, offset, total, rank, world = p.__dict__["_zt_shard"]
            size = shard.numel()
            lo, hi = max(rank * size, offset), min((rank + 1) * size, offset + p.numel(), total)
            if lo < hi:
                shard[lo - rank * size:hi - rank * size].copy_(p.detach().view(-1)[lo - offset:hi - offset])
            p.untyped_storage().resize_(0)
            _released.release(p, _released.WHY_INIT)


class _SubclassHook:
    """Restores torch.nn.Module.__init_subclass__ when Init exits (see Init._patch)."""

    @staticmethod
    def restore(original):
        if original is None:
            if "__init_subclass__" in torch.nn.Module.__dict__:
                del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = original


def _restore_patch(cls, original):
    if cls is _SubclassHook:
        _SubclassHook.restore(original)
    else:
        cls.__init__ = original



@contextlib.contextmanager
def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """The whole values of `params` (a parameter or a list) for the body of the `with`. With
    modifier_rank r, what rank r writes into them is kept: broadcast to every rank and written
    into the engine's fp32 masters (or, before the engine exists, into the shards). A collective:
    every rank enters and leaves it with the same parameters."""
    if not enabled:
        yield
        return
    params = [params] if torch.is_tensor(params) else [p for p in params if p is not None]
    if not params:
        yield
        return
    engines = {id(found[0]): found for found in (_registry.engine_of(p) for p in params) if found is not None}
    if len({id(f[0]) for f in engines.values()}) > 1:
        raise ValueError("GatheredParameters: the parameters belong to more than one engine")
    engine = next(iter(engines.values()))[0] if engines else None
    if engine is not None:
        with engine._gathered(params, modifier_rank):
            yield
        return
    # Before an engine: units built sharded under Init, and parameters that outlived their unit.
    wanted = {id(p) for p in params}
    shells = [(shell, _pending_params.get(module, [])) for module, shell in list(_pending.items())
              if any(id(q) in wanted for q in _pending_params.get(module, []))]
    alone = orphans(params)
    c = comm.communicator() if alone else None
    gathered = []
    try:
        for p in alone:
            gather_orphans([p], c)
            gathered.append(p)
        with _gathered_pending(shells, modifier_rank, params):
            yield
    finally:
        reshard_orphans(gathered)


@contextlib.contextmanager
def _gathered_pending(shells, modifier_rank, params=None):
    """Units built sharded, whole for the body: [(shell, its parameters)]. With modifier_rank, what
    that rank holds on leaving (in those parameters and in `params`) is broadcast and kept."""
    params = list(params or [])
    held_by = {id(shell): held for shell, held in shells}
    for _, held in shells:
        params += [p for p in held if not any(p is q for q in params)]
    c = comm.communicator() if (shells or modifier_rank is not None) else None
    entered = []
    try:
        for shell, _ in shells:
            if _gathered_depth.get(id(shell), 0) == 0:
                _C.gather_pending(shell, c)
                for p in held_by[id(shell)]:
                    _released.restore(p)
            _gathered_depth[id(shell)] = _gathered_depth.get(id(shell), 0) + 1
            entered.append(shell)
        yield
        if modifier_rank is not None and c is not None and c.world_size > 1:
            for p in params:
                torch.distributed.broadcast(p.data, modifier_rank)
    finally:
        for shell in entered:
            _gathered_depth[id(shell)] -= 1
            if _gathered_depth[id(shell)] == 0:
                del _gathered_depth[id(shell)]
                _C.reshard_pending(shell)
                for p in held_by[id(shell)]:
                    _released.release(p, _released.WHY_INIT)


def register_external_parameter(module, parameter):
    """Declares that module's forward reads `parameter`, which another module owns, so that at
    stage 3 it runs with that parameter's unit gathered. Call before zerotrain.initialize."""
    if not isinstance(module, torch.nn.Module) or not torch.is_tensor(parameter):
        raise TypeError("register_external_parameter(module, parameter): expected a torch.nn.Module and a tensor")
    if _registry.engine_of(parameter) is not None:
        raise RuntimeError("register_external_parameter: call it before zerotrain.initialize (the engine decides "
                           "which module runs with which unit when it is built)")
    _external.setdefault(module, [])
    if not any(q is parameter for q in _external[module]):
        _external[module].append(parameter)


def unregister_external_parameter(module, parameter):
    if module in _external:
        _external[module] = [q for q in _external[module] if q is not parameter]


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """DeepSpeed's: the model's parameters gathered whole for the body (generation runs many short
    forwards), and the model (an engine, or a module) itself yielded."""
    with GatheredParameters(list(model.parameters())):
        yield model


# The names DeepSpeed's deepspeed.zero also holds (defined with the rest of partition_parameters).
from .partition_parameters import DeepSpeedTensorOverride, ZeroParamStatus, ZeroParamType  # noqa: E402,F401

DeepSpeedZeRoOffload = _unsupported.cls("deepspeed.zero.DeepSpeedZeRoOffload", "the engine offloads parameters "
                                        "itself (zero_optimization.offload_param)")
TiledLinear = _unsupported.cls("deepspeed.zero.TiledLinear", "zerotrain's stage-3 units are whole submodules")
TiledLinearReturnBias = _unsupported.cls("deepspeed.zero.TiledLinearReturnBias",
                                         "zerotrain's stage-3 units are whole submodules")
