"""The engine a script drives: DeepSpeed's DeepSpeedEngine interface over zerotrain's C++ engine.

The module's parameters and buffers are handed to the C++ engine as they are (the same tensors);
it moves their storage into its flat arenas in place, so `engine.module` stays an ordinary module.
forward runs in Python; backward, the gradient reduction, the optimizer step and checkpoints run in
C++ (docs/python.md).
"""
import contextlib
import json
import os
import sys

import torch

from . import _C, _registry, _released, _units, comm
from . import zero as _zero
from .ops._client import EngineOptimizer

# torch.optim classes the engine has a kernel for: the configuration's optimizer type and params.
def _torch_optimizer_config(opt):
    g = opt.param_groups[0]
    if type(opt) is torch.optim.AdamW:
        if g.get("amsgrad"):
            raise ValueError("zerotrain.initialize: torch.optim.AdamW(amsgrad=True): the AMSGrad variant is not implemented")
        return "AdamW", {"lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"]}
    if type(opt) is torch.optim.Adam:
        if g.get("amsgrad"):
            raise ValueError("zerotrain.initialize: torch.optim.Adam(amsgrad=True): the AMSGrad variant is not implemented")
        return "Adam", {"lr": float(g["lr"]), "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"],
                        "adam_w_mode": False}
    if type(opt) is torch.optim.SGD:
        return "SGD", {"lr": float(g["lr"]), "momentum": g["momentum"], "dampening": g["dampening"],
                       "nesterov": g["nesterov"], "weight_decay": g["weight_decay"]}
    return None


_SUPPORTED = ("zerotrain.ops.adam.FusedAdam, zerotrain.ops.adam.DeepSpeedCPUAdam, zerotrain.ops.lamb.FusedLamb, "
              "torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD")

# Per group, these two may differ (the engine's ParameterGroup); the others must be the same in
# every group.
_PER_GROUP = ("lr", "weight_decay")
_SHARED = ("betas", "eps", "bias_correction", "max_grad_norm", "max_coeff", "min_coeff", "momentum", "dampening",
           "nesterov", "amsgrad", "adam_w_mode")


def _optimizer_from_client(optimizer):
    """The configuration's "optimizer" block for a client optimizer; TypeError for one the engine lacks."""
    if isinstance(optimizer, EngineOptimizer):
        opt_type, params = optimizer.engine_type, optimizer.engine_params()
    elif isinstance(optimizer, torch.optim.Optimizer):
        mapped = _torch_optimizer_config(optimizer)
        if mapped is None:
            raise TypeError(f"zerotrain.initialize: optimizer {type(optimizer).__module__}.{type(optimizer).__name__} is not "
                            f"implemented by the engine; it runs {_SUPPORTED}, or the configuration's \"optimizer\" block")
        opt_type, params = mapped
    elif callable(optimizer):
        raise TypeError("zerotrain.initialize: an optimizer factory (callable) is not supported: pass an optimizer object "
                        f"({_SUPPORTED}) or use the configuration's \"optimizer\" block")
    else:
        raise TypeError(f"zerotrain.initialize: expected a torch.optim.Optimizer for optimizer=, found {type(optimizer).__name__}")
    groups = optimizer.param_groups
    for i, g in enumerate(groups[1:], start=1):
        for key in _SHARED:
            if key in g and key in groups[0] and g[key] != groups[0][key]:
                raise ValueError(f"zerotrain.initialize: optimizer parameter group {i} has {key}={g[key]!r} where group 0 "
                                 f"has {groups[0][key]!r}: only lr and weight_decay may differ between groups")
    return {"type": opt_type, "params": params}


def _parameter_groups(model, model_parameters, optimizer):
    """The trainable parameters the script hands over, checked against the model, and the groups
    with hyperparameters of their own as [(names, lr or None, weight_decay or None)]."""
    named = list(model.named_parameters())
    by_id = {id(p): n for n, p in named}
    given, groups = [], []

    def take(params, where):
        params = [params] if torch.is_tensor(params) else list(params)
        for p in params:
            if not torch.is_tensor(p):
                raise TypeError(f"zerotrain.initialize: {where}: expected tensors or groups of them, found {type(p).__name__}")
            if id(p) not in by_id:
                raise ValueError(f"zerotrain.initialize: {where} holds a tensor of shape {tuple(p.shape)} that is not a "
                                 "parameter of the model")
        given.extend(params)
        return [by_id[id(p)] for p in params]

    if optimizer is not None:
        for i, g in enumerate(optimizer.param_groups):
            names = take(g["params"], "the optimizer's parameter groups")
            if i > 0:
                groups.append((names, float(g["lr"]) if "lr" in g else None,
                               float(g["weight_decay"]) if "weight_decay" in g else None))
    elif model_parameters is not None:
        for item in model_parameters:
            if isinstance(item, dict):
                shared = sorted(k for k in item if k in _SHARED)
                if shared:
                    raise ValueError(f"zerotrain.initialize: a model_parameters group sets {', '.join(shared)}: only lr "
                                     "and weight_decay may be set per group; give the others in the configuration's "
                                     "\"optimizer\" block")
                names = take(item["params"], "model_parameters")
                if any(k in item for k in _PER_GROUP):
                    groups.append((names, float(item["lr"]) if "lr" in item else None,
                                   float(item["weight_decay"]) if "weight_decay" in item else None))
            else:
                take(item, "model_parameters")
    else:
        given = [p for _, p in named if p.requires_grad]
    chosen = {id(p) for p in given}
    left_out = [n for n, p in named if p.requires_grad and id(p) not in chosen]
    if left_out:
        raise ValueError(f"zerotrain.initialize: {len(left_out)} parameter(s) of the model require a gradient but are not in "
                         f"model_parameters (the first: {left_out[0]!r}); set requires_grad=False on the ones to freeze")
    trainable = {n for n, p in named if p.requires_grad}  # frozen ones in a group are not the optimizer's
    groups = [([n for n in names if n in trainable], lr, wd) for names, lr, wd in groups]
    return named, [g for g in groups if g[0]]


_NOTED = set()


def _note_once(key, text):
    if key in _NOTED or comm.get_rank() != 0:
        return
    _NOTED.add(key)
    print(f"zerotrain: note: {text}", file=sys.stderr, flush=True)


def _load_config(config, args):
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        raise ValueError("zerotrain.initialize: expected a configuration: config= (a path or a dict) or "
                         "args.deepspeed_config")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"zerotrain.initialize: cannot read the configuration {path}: {e.strerror}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"zerotrain.initialize: the configuration {path} is not JSON: {e}") from None
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a copy, and non-JSON values refused here
    raise TypeError(f"zerotrain.initialize: expected config to be a path or a dict, found {type(config).__name__}")


class EngineOptimizerView:
    """What initialize returns as the optimizer: the engine runs the step, so this only reports."""

    def __init__(self, engine, basic):
        self._engine = engine
        self.basic = basic

    @property
    def param_groups(self):
        return [{"params": [p for _, p in self._engine._named_parameters if p.requires_grad],
                 "lr": self._engine.get_lr()[0]}]

    @property
    def loss_scale(self):
        return self._engine._engine.loss_scale

    def step(self, closure=None):
        raise RuntimeError("the optimizer runs inside zerotrain's engine: call engine.step()")

    def zero_grad(self, set_to_none=True):
        self._engine.zero_grad()


class EngineLRScheduler:
    """The configuration's "scheduler", which the engine applies at each step; reports only."""

    def __init__(self, engine, kind):
        self._engine = engine
        self.kind = kind

    def get_lr(self):
        return self._engine.get_lr()

    def get_last_lr(self):
        return self._engine.get_lr()

    def step(self, *args, **kwargs):
        raise RuntimeError("the learning-rate schedule runs inside zerotrain's engine (it steps with engine.step())")


class ZeroEngine:
    """DeepSpeed's engine interface: engine(*inputs), backward(loss), step(). Not thread-safe; every
    rank calls backward/step/save/load the same number of times in the same order (collectives)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, lr_scheduler=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zerotrain.initialize: expected model to be a torch.nn.Module, found {type(model).__name__}")
        if lr_scheduler is not None:
            raise TypeError("zerotrain.initialize: a client lr_scheduler is not supported: the engine applies the "
                            "configuration's \"scheduler\" block (DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                            "OneCycle, LRRangeTest)")
        for name, p in model.named_parameters():
            if _registry.engine_of(p) is not None:
                raise ValueError(f"zerotrain.initialize: the model's parameter {name!r} is held by another engine that is "
                                 "still alive (it would train nothing once this one took the parameters); call "
                                 "destroy() on that engine first to hand the module over")
            if _released.is_released(p) and "_zt_shard" not in p.__dict__:
                raise ValueError(f"zerotrain.initialize: the model's parameter {name!r} has no values: "
                                 f"{_released.why(p)}")
        for p in model.parameters():
            if p.device.type != "cpu":
                raise ValueError(f"zerotrain.initialize: the model has a parameter on {p.device}; the Python front end "
                                 "trains on the CPU for now")
        config = dict(config)
        basic = None
        if optimizer is not None:
            if "optimizer" in config:
                _note_once("client-optimizer", "the client optimizer replaces the configuration's \"optimizer\" block, "
                                               "as in DeepSpeed")
            config["optimizer"] = _optimizer_from_client(optimizer)
            basic = optimizer
        own = [k for k in ("model", "data", "train") if k in config
               and not (k == "model" and getattr(model, "cpp_module", None) is not None)]  # zerotrain.models read it
        if own:
            _note_once("own-blocks", f"the configuration's {', '.join(own)} block(s) are read by the zerotrain command "
                                     "line only (from Python, train.retain_freed_memory alone); the script's own model "
                                     "and loop are used")
        reporting = [k for k in ("tensorboard", "wandb", "comet")
                     if isinstance(config.get(k), dict) and config[k].get("enabled")]
        if reporting:
            _note_once("reporting", f"{', '.join(reporting)}: DeepSpeed reports zerotrain does not produce; ignored")
        self._named_parameters, groups = _parameter_groups(model, model_parameters, optimizer)
        self.module = model
        self.basic_optimizer = basic
        self._communicator = comm.communicator()
        checked = _C.check_config(json.dumps(config), [], self._communicator.world_size)["resolved"]
        # The command line's heap policy (train.retain_freed_memory, default "bounded"): freed tensor
        # blocks kept for reuse instead of page-faulted in again every step.
        _C.apply_heap_policy(json.loads(checked.get("train.retain_freed_memory", '"bounded"')),
                             int(checked.get("zero_optimization.stage", "0")) == 3)
        cpp_module = getattr(model, "cpp_module", None)  # zerotrain.models: the C++ module itself
        stage = int(checked.get("zero_optimization.stage", "0"))
        buffers = list(model.named_buffers())
        modules = dict(model.named_modules())
        built_sharded = {path: _zero.pending_unit_shell(m) for path, m in modules.items()
                         if _zero.pending_unit_shell(m) is not None and _zero.pending_is_current(m)}
        # Built sharded, but their unit is gone (replaced, as a resize replaces an embedding): made
        # whole here, and trained as any parameter is.
        orphans = _zero.orphans([p for _, p in self._named_parameters])
        if orphans:
            _zero.gather_orphans(orphans, self._communicator)
            _zero.adopted(orphans)
        self._unit_forwards = None
        self._unit_members = {}
        choice = None
        threshold = 0
        if cpp_module is None:
            # DeepSpeed flags the configuration's leaf modules at every stage; they matter at stage 3.
            _, leaf_notes = _units.apply_leaf_config(model, config.get("zero_optimization"))
            for text in leaf_notes:
                _note_once("leaf:" + text, text)
        if stage == 3 and cpp_module is None:
            threshold = int(checked.get("zero_optimization.stage3_param_persistence_threshold", "0"))
            external = {path: _zero.external_parameters(m) for path, m in modules.items() if _zero.external_parameters(m)}
            choice = _units.choose_units(model, threshold, set(built_sharded), external)
            for path in choice.absorbed:
                # Built sharded as a unit of its own; its leaf is its unit now, sharded by the engine
                # from whole values: this unit is whole on every rank until then.
                _C.gather_pending(built_sharded.pop(path), self._communicator)
                _zero.adopted(_zero.pending_parameters(modules[path]))
                _zero.forget_pending(modules[path])
        self._shell = cpp_module if cpp_module is not None else _C.make_module_shell(self._named_parameters, buffers,
                                                                                       built_sharded)
        if choice is not None:
            fresh = [u for u in choice.units if u not in built_sharded]
            if "" in fresh:  # the whole model is one leaf
                _C.mark_block(self._shell)
            _C.mark_units(self._shell, [u for u in fresh if u != ""])
            self._unit_forwards = _units.UnitForwards(model, self._shell, choice.users)
            self._unit_members = choice.members
        try:
            self._engine = _C.Engine(self._shell, json.dumps(config), [], self._communicator, groups)
        except BaseException:
            if self._unit_forwards is not None:
                self._unit_forwards.restore()
            raise
        _C.heap_setup_done()
        for path in built_sharded:  # adopted: the engine holds them now
            _zero.adopted(_zero.pending_parameters(modules[path]))
            _zero.forget_pending(modules[path])
        resolved = self._engine.config_json
        if choice is not None:
            units = choice.units
            trainable = [p for _, p in self._named_parameters if p.requires_grad]
            total = sum(p.numel() for p in trainable)
            sharded = sum(p.numel() for u in units for p in choice.members[u] if p.requires_grad)
            if not units:
                _note_once("stage3-units", "stage 3: no submodule qualifies as a unit to shard (stage3_param_persistence_"
                                           f"threshold {threshold}): every rank keeps all {total} parameters whole; "
                                           "gradients and optimizer states are partitioned")
            else:
                _note_once("stage3-units", f"stage 3: {len(units)} units sharded ({sharded} of {total} trainable "
                                           "parameters); the rest are kept whole on every rank")
        self.optimizer = EngineOptimizerView(self, basic)
        self.lr_scheduler = EngineLRScheduler(self, resolved.get("scheduler.type", "")) \
            if resolved.get("scheduler.type", "").strip('"') else None
        self._fp16 = resolved.get("fp16.enabled", "false") == "true"
        self._betas = (json.loads(resolved.get("optimizer.params.betas", "[0.9, 0.999]"))
                       if resolved.get("optimizer.type", "").strip('"') != "SGD" else None)
        # DeepSpeed's reporting keys (steps_per_print, wall_clock_breakdown, csv_monitor,
        # flops_profiler, comms_logger) are honoured by the C++ engine itself; its lines come back
        # here to be printed through sys.stdout.
        self._report_lines = self._engine.collect_report_lines()
        self._last = None
        self._backward_since_step = False
        self._micro_step = 0  # backward() calls into the current accumulation window
        self._inside_no_sync = False
        _registry.register(self, self._named_parameters)

    # ------------------------------------------------------------------ the loop
    def __call__(self, *inputs, **kwargs):
        engine = self._live()._engine
        engine.note_forward_start()
        try:
            return self.module(*inputs, **kwargs)
        finally:
            engine.note_forward_end()

    forward = __call__

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        if not scale_wrt_gas:
            raise ValueError("engine.backward(scale_wrt_gas=False): the engine always divides the loss by "
                             "gradient_accumulation_steps")
        if retain_graph:
            raise ValueError("engine.backward(retain_graph=True) is not supported")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward: expected a scalar loss tensor")
        if self._inside_no_sync and self._live()._engine.next_backward_is_boundary:
            raise _C.EngineError(
                "engine.backward() inside engine.no_sync() on the last micro-step of an accumulation window "
                f"(gradient_accumulation_steps {self._engine.gradient_accumulation_steps}): the optimizer step that "
                "follows needs this window's gradients reduced over the ranks; run the window's last backward "
                "outside no_sync")
        try:
            self._live()._engine.backward(loss)
        finally:
            self._print_reports()
        self._backward_since_step = True
        self._micro_step = (self._micro_step + 1) % self._engine.gradient_accumulation_steps
        return loss

    def step(self, lr_kwargs=None):
        if lr_kwargs:
            raise ValueError("engine.step(lr_kwargs=...) is not supported: the schedule comes from the configuration")
        if self._inside_no_sync:
            raise _C.EngineError("engine.step() inside engine.no_sync(): call it after the with block, as DeepSpeed "
                                 "requires")
        if not self._backward_since_step:
            raise _C.EngineError("engine.step() called without a backward() since the last step")
        try:
            self._last = self._live()._engine.step()
        finally:
            self._print_reports()
        self._backward_since_step = False
        return None

    def _print_reports(self):
        for line in self._report_lines.take():
            print(line, flush=True)

    def flops_report(self):
        """The flops profiler's measurement of flops_profiler.profile_step (a dict: FLOPs and seconds
        per phase, achieved and peak FLOP/s, FLOPs per operator, the printed text), or None."""
        return self._live()._engine.flops_report

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's no_sync: the backward passes inside the block do not reduce gradients over the
        ranks; they accumulate locally until a backward outside it. At stages 0 and 1 the engine
        reduces a window's gradients once, on its last micro-step, so micro-steps before it run
        inside no_sync exactly as outside; the last one must run outside (its reduction feeds the
        optimizer step). Stages 2 and 3 reduce every micro-step to partition the gradients, so
        no_sync is refused there, as DeepSpeed refuses it."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise _C.EngineError(f"engine.no_sync() at ZeRO stage {stage}: stages 2 and 3 partition the gradients by "
                                 "reducing them on every micro-step, so the reduction cannot be skipped (DeepSpeed "
                                 "refuses it too); use it at stage 0 or 1")
        if self._inside_no_sync:
            raise _C.EngineError("engine.no_sync() entered inside engine.no_sync(): reentry is not supported")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def zero_grad(self):
        """Gradients are zeroed by every optimizer step; between steps there is nothing to zero."""
        if self._backward_since_step or self._micro_step != 0:
            raise _C.EngineError("engine.zero_grad() inside an accumulation window would drop its gradients; the engine "
                                 "zeroes them itself after each optimizer step")

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    # ------------------------------------------------------------------ what the loop asks
    @property
    def global_steps(self):
        return self._live()._engine.global_step

    @property
    def skipped_steps(self):
        return self._live()._engine.skipped_steps

    def get_lr(self):
        return [self._live()._engine.learning_rate]

    def _momentum(self):
        return [tuple(self._betas)] if self._betas is not None else [0.0]

    def get_mom(self):
        return self._momentum()

    def get_global_grad_norm(self):
        return self._last.grad_norm if self._last is not None and self._last.stepped else None

    def is_gradient_accumulation_boundary(self):
        return self._live()._engine.next_backward_is_boundary

    def gradient_accumulation_steps(self):
        return self._live()._engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self):
        return self._live()._engine.train_micro_batch_size_per_gpu

    def train_batch_size(self):
        return self._live()._engine.train_batch_size

    @property
    def loss_scale(self):
        return self._live()._engine.loss_scale

    @property
    def global_rank(self):
        return self._communicator.rank

    @property
    def world_size(self):
        return self._communicator.world_size

    def zero_optimization_stage(self):
        return int(self._live()._engine.config_json.get("zero_optimization.stage", "0"))

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Writes save_dir/tag (default global_step<N>) in the command line's format and points
        save_dir/latest at it. client_state: a dict of JSON values, returned by load_checkpoint."""
        if not save_latest:
            raise ValueError("engine.save_checkpoint(save_latest=False) is not supported: a checkpoint is published by "
                             "pointing save_dir/latest at it")
        if exclude_frozen_parameters:
            raise ValueError("engine.save_checkpoint(exclude_frozen_parameters=True) is not supported: checkpoints keep "
                             "frozen parameters so that a resume is exact")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        state = {}
        for key, value in (client_state or {}).items():
            try:
                state[str(key)] = json.dumps(value)
            except TypeError:
                raise TypeError(f"engine.save_checkpoint: client_state[{key!r}] is a {type(value).__name__}; expected "
                                "JSON values (numbers, strings, lists, dicts)") from None
        self._live()._engine.save_checkpoint(os.fspath(save_dir), tag, state)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Reads load_dir/tag (default: load_dir/latest), saved at any world size and stage; returns
        (path, client_state), or (None, None) when load_dir holds no checkpoint (as DeepSpeed)."""
        if not load_lr_scheduler_states:
            raise ValueError("engine.load_checkpoint(load_lr_scheduler_states=False) is not supported: the schedule is a "
                             "function of the restored step count")
        if not load_module_strict:
            raise ValueError("engine.load_checkpoint(load_module_strict=False) is not supported: every parameter must "
                             "be in the checkpoint")
        load_dir = os.fspath(load_dir)
        if tag is None and not os.path.exists(os.path.join(load_dir, "latest")):
            _note_once("no-latest", f"no checkpoint found in {load_dir} (no 'latest'); nothing loaded")
            return None, None
        reset = load_module_only or not load_optimizer_states
        state = self._live()._engine.load_checkpoint(load_dir, "" if tag is None else str(tag), reset)
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        return os.path.join(load_dir, str(tag)), {k: json.loads(v) for k, v in state.items()}

    # ------------------------------------------------------------------ GatheredParameters
    @contextlib.contextmanager
    def _gathered(self, params, modifier_rank):
        """zero.GatheredParameters for parameters this engine trains (or keeps frozen)."""
        engine = self._live()._engine
        names = {id(p): n for n, p in self._named_parameters}
        shells = self._unit_forwards.shells if self._unit_forwards is not None else {}
        units = {}
        for path, shell in shells.items():
            if any(q is p for q in self._unit_members.get(path, []) for p in params):
                units[path] = shell
        engine.hold_blocks(list(units.values()))
        values = {}
        try:
            yield
            if modifier_rank is not None:
                for p in params:
                    values[id(p)] = p.detach().float().clone()
        finally:
            engine.release_held_blocks()
        if modifier_rank is None:
            return
        if self.world_size > 1:
            for p in params:
                torch.distributed.broadcast(values[id(p)], modifier_rank)
        trained = {names[id(p)]: values[id(p)] for p in params if id(p) in names and p.requires_grad}
        if trained:
            engine.set_master_parameters(trained)
        with torch.no_grad():
            for p in params:
                if not p.requires_grad:  # frozen: whole on every rank, the broadcast value is it
                    p.copy_(values[id(p)].to(p.dtype))

    # ------------------------------------------------------------------ lifetime
    def destroy(self):
        """Releases the engine's state. At stages 0-2 the module keeps its current values; at stage 3
        its units' parameters go with the engine (as in DeepSpeed: save or export first)."""
        if self._engine is not None:
            self._engine.apply_pending_update()
            # At stage 3 the units' forwards stay wrapped: their parameters went with the engine, and
            # running one now raises an error that says so instead of reading memory that is gone.
            self._engine = None
            for _, p in self._named_parameters:
                if p.numel() > 0 and p.untyped_storage().nbytes() == 0:
                    _released.release(p, _released.WHY_DESTROYED)

    def _live(self):
        if self._engine is None:
            raise _C.EngineError("this engine was destroyed")
        return self


DeepSpeedEngine = ZeroEngine
