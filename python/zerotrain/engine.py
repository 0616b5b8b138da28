"""The engine a script drives: DeepSpeed's DeepSpeedEngine interface over zerotrain's C++ engine.

The module's parameters and buffers are handed to the C++ engine as they are (the same tensors);
it moves their storage into its flat arenas in place, so `engine.module` stays an ordinary module.
forward runs in Python; backward, the gradient reduction, the optimizer step and checkpoints run in
C++ (docs/python.md).
"""
import contextlib
import json
import os
import shutil
from typing import Callable, Dict, Iterable, Union

import torch

from . import _C, _lr_client, _registry, _released, _units, comm
from . import zero as _zero
from ._engine_setup import _basic_optimizer_from_config, _check_parameters, _mark_stage3, _note_once
from ._engine_setup import _note_unread_blocks, _optimizer_from_client, _parameter_groups, _resolve_keep_in_fp32
from ._engine_setup import _load_config  # noqa: F401  (zerotrain.initialize reads it from here)
from ._engine_surface import EngineConfigQueries
from .accelerator import get_accelerator

# The device types whose parameters the Python front end hands to the engine (CUDA when the
# extension was built with the engine's CUDA path); the accelerator (zerotrain.accelerator)
# reports the device zerotrain trains on from this list.
TRAINING_DEVICE_TYPES = ("cpu", "cuda") if _C.built_with_cuda() else ("cpu",)

# DeepSpeed's types for initialize's callables: an optimizer made from the parameters, a scheduler
# made from the optimizer.
DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], Dict[str, Iterable]]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class DeepSpeedOptimizer:
    """DeepSpeed's base of the optimizers its engine returns from initialize: an isinstance check
    on what zerotrain.initialize returns as the optimizer finds it."""


class EngineOptimizerView(DeepSpeedOptimizer):
    """What initialize returns as the optimizer: the engine runs the step, so this only reports.
    Its param_groups are the basic optimizer's (the client's, or the one made from the
    configuration), whose "lr" a client scheduler sets and the engine's schedule updates."""

    def __init__(self, engine, basic):
        self._engine = engine
        self.basic = basic

    @property
    def param_groups(self):
        if self.basic is not None:
            return self.basic.param_groups
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


class ZeroEngine(EngineConfigQueries, torch.nn.Module):
    """DeepSpeed's engine interface: engine(*inputs), backward(loss), step(). Like DeepSpeed's
    engine it is a torch.nn.Module wrapping the model as `module` (engine.parameters(),
    named_parameters() with the "module." prefix, state_dict(), train()/eval()), and an attribute
    it does not have is looked up on the model. Not thread-safe; every rank calls
    backward/step/save/load the same number of times in the same order (collectives)."""

    def __init__(self, model, config, optimizer=None, model_parameters=None, lr_scheduler=None, args=None):
        torch.nn.Module.__init__(self)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zerotrain.initialize: expected model to be a torch.nn.Module, found {type(model).__name__}")
        if optimizer is not None and callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            # DeepSpeed's optimizer callable: made from the parameters handed over (all of them when none).
            optimizer = optimizer(list(model.parameters()) if model_parameters is None else list(model_parameters))
        _check_parameters(model)
        for p in model.parameters():
            if p.device.type not in TRAINING_DEVICE_TYPES:
                built = ("this zerotrain was built without CUDA (build it where nvcc is found, or with "
                         "-DZT_CUDA=ON)" if p.device.type == "cuda" else "it trains on " +
                         " or ".join(TRAINING_DEVICE_TYPES))
                raise ValueError(f"zerotrain.initialize: the model has a parameter on {p.device}; {built}")
        config = dict(config)
        self.config = json.loads(json.dumps(config))  # DeepSpeed's engine.config: the configuration given
        basic = None
        if optimizer is not None:
            if "optimizer" in config:
                _note_once("client-optimizer", "the client optimizer replaces the configuration's \"optimizer\" block, "
                                               "as in DeepSpeed")
            config["optimizer"] = _optimizer_from_client(optimizer)
            basic = optimizer
        _note_unread_blocks(model, config)
        self._named_parameters, groups = _parameter_groups(model, model_parameters, optimizer)
        self.module = model
        self.client_optimizer = optimizer
        self._communicator = comm.communicator()
        checked = _C.check_config(json.dumps(config), [], self._communicator.world_size)["resolved"]
        if basic is None:
            basic = _basic_optimizer_from_config(checked, self._named_parameters, groups)
        self.basic_optimizer = basic
        scheduler, groups = self._take_scheduler(model, config, lr_scheduler, basic, groups)
        checked = _C.check_config(json.dumps(config), [], self._communicator.world_size)["resolved"]
        # The command line's heap policy (train.retain_freed_memory, default "bounded"): freed tensor
        # blocks kept for reuse instead of page-faulted in again every step.
        _C.apply_heap_policy(json.loads(checked.get("train.retain_freed_memory", '"bounded"')),
                             int(checked.get("zero_optimization.stage", "0")) == 3)
        cpp_module = getattr(model, "cpp_module", None)  # zerotrain.models: the C++ module itself
        _resolve_keep_in_fp32(model, config, checked)
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
        choice, threshold = self._choose_units(model, config, checked, stage, cpp_module, modules, built_sharded)
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
            _mark_stage3(self._named_parameters, choice, threshold)
        self._attach_optimizer_and_scheduler(scheduler, basic, resolved)
        self._init_loop_state(resolved, args)
        _registry.register(self, self._named_parameters)

    def _take_scheduler(self, model, config, lr_scheduler, basic, groups):
        """initialize's lr_scheduler (or the callable making one from `basic`): one of DeepSpeed's
        schedules becomes the configuration's "scheduler" block, which the engine runs; any other is
        the client scheduler that step() steps, setting the rates of `basic`'s groups. Returns (the
        scheduler, the parameter groups)."""
        scheduler = _lr_client.resolve(lr_scheduler, basic)
        self._client_scheduler = None
        if _lr_client.runs_in_engine(scheduler):  # one of DeepSpeed's schedules: the engine runs it
            if "scheduler" in config:
                _note_once("client-schedule", "the client lr_scheduler replaces the configuration's \"scheduler\" "
                                              "block, as in DeepSpeed")
            config["scheduler"] = scheduler.config_block()
        elif scheduler is not None:
            if "scheduler" in config:
                _note_once("client-scheduler", "the client lr_scheduler is used instead of the configuration's "
                                               "\"scheduler\" block, as in DeepSpeed")
                del config["scheduler"]
            if basic is None:
                raise ValueError("zerotrain.initialize: a client lr_scheduler needs an optimizer to set the rates of: "
                                 "give optimizer= or the configuration's \"optimizer\" block")
            self._client_scheduler = scheduler
            # The rate the scheduler has set by now is the configuration's (what the engine reports
            # before its first step); step() hands the scheduler's rates over before each step.
            config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = float(basic.param_groups[0]["lr"])
            self._named_parameters, groups = _parameter_groups(model, None, basic)
        return scheduler, groups

    def _choose_units(self, model, config, checked, stage, cpp_module, modules, built_sharded):
        """Flags the configuration's leaf modules and, at stage 3 for a Python model, chooses the
        units; a unit built sharded that now lies inside a leaf is gathered whole and leaves
        `built_sharded`. Returns (the UnitChoice or None, the persistence threshold)."""
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
        return choice, threshold

    def _attach_optimizer_and_scheduler(self, scheduler, basic, resolved):
        """The optimizer and lr_scheduler that initialize returns, and where each step's rates come
        from."""
        self.optimizer = EngineOptimizerView(self, basic)
        if self._client_scheduler is not None:
            self.lr_scheduler = self._client_scheduler
        elif _lr_client.runs_in_engine(scheduler):
            scheduler._engine = self
            self.lr_scheduler = scheduler
        else:
            self.lr_scheduler = EngineLRScheduler(self, resolved.get("scheduler.type", "")) \
                if resolved.get("scheduler.type", "").strip('"') else None
        # A client optimizer's parameter groups are the optimizer's, as in DeepSpeed (whose ZeRO
        # optimizer steps the client's): a rate written into them (by a scheduler that only the
        # script steps, as Accelerate does with one DeepSpeed does not know, or by the script itself)
        # is the one the next step applies, unless a schedule runs inside the engine.
        self._rates_from_groups = self._client_scheduler is not None or (
            self.client_optimizer is not None and self.lr_scheduler is None)
        if self._client_scheduler is None and self.lr_scheduler is not None and basic is not None:
            for group in basic.param_groups:  # the schedule's first rate, in every group as DeepSpeed's
                group["lr"] = self._engine.learning_rate

    def _init_loop_state(self, resolved, args):
        """What the training loop reads and reports between steps, and DeepSpeed's engine attributes."""
        self._fp16 = resolved.get("fp16.enabled", "false") == "true"
        self._betas = (json.loads(resolved.get("optimizer.params.betas", "[0.9, 0.999]"))
                       if resolved.get("optimizer.type", "").strip('"') != "SGD" else None)
        # DeepSpeed's reporting keys (steps_per_print, wall_clock_breakdown, csv_monitor,
        # flops_profiler, comms_logger) are honoured by the C++ engine itself; its lines come back
        # here to be printed through sys.stdout.
        self._report_lines = self._engine.collect_report_lines()
        self._last = None
        self._step_applied = False
        self._boundary_override = None  # set_gradient_accumulation_boundary's value
        # DeepSpeed's engine attributes: the launcher's local rank (written back to args.local_rank
        # as DeepSpeed does) and the device it trains on.
        self.local_rank = comm.get_local_rank()
        if args is not None and hasattr(args, "local_rank"):
            args.local_rank = self.local_rank
        self.device = torch.device(get_accelerator().device_name(self.local_rank))
        self._backward_since_step = False
        self.micro_steps = 0  # step() calls, as DeepSpeed counts them
        self.training_dataloader = None  # initialize's, when it is given training_data
        self._window_ended = False  # a backward since the last step() ended the accumulation window
        self._micro_step = 0  # backward() calls into the current accumulation window
        self._inside_no_sync = False

    # ------------------------------------------------------------------ the loop
    def forward(self, *inputs, **kwargs):
        """The module's forward (engine(*inputs) calls it through torch.nn.Module's __call__)."""
        engine = self._live()._engine
        engine.note_forward_start()
        try:
            return self.module(*inputs, **kwargs)
        finally:
            engine.note_forward_end()

    def __getattr__(self, name):
        """As DeepSpeedEngine: what the engine does not have, the wrapped model may (model.config, a
        method of the model's own)."""
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """DeepSpeed's backward: the gradient of loss / gradient_accumulation_steps, or of the loss as
        it is with scale_wrt_gas=False (for a script, the Hugging Face Trainer among them, that
        divides it itself). Returns the loss so divided, as DeepSpeed does."""
        if retain_graph:
            raise ValueError("engine.backward(retain_graph=True) is not supported")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward: expected a scalar loss tensor")
        engine = self._live()._engine
        accumulation = engine.gradient_accumulation_steps
        wanted = self._boundary_override
        if wanted is not None and bool(wanted) != engine.next_backward_is_boundary:
            # True early ends the window with this backward (Accelerate at an epoch's end); False where
            # the window ends anyway is refused by the engine (a window never grows past the count).
            engine.set_gradient_accumulation_boundary(bool(wanted))
        if self._inside_no_sync and engine.next_backward_is_boundary:
            raise _C.EngineError(
                "engine.backward() inside engine.no_sync() on the last micro-step of an accumulation window "
                f"(gradient_accumulation_steps {accumulation}): the optimizer step that "
                "follows needs this window's gradients reduced over the ranks; run the window's last backward "
                "outside no_sync")
        ends_window = engine.next_backward_is_boundary
        try:
            # Divided by gradient_accumulation_steps in the engine, as DeepSpeed divides it (loss / steps),
            # or taken as the script divided it.
            engine.backward(loss, divide_by_accumulation=scale_wrt_gas)
        finally:
            self._print_reports()
        self._backward_since_step = True
        self._window_ended = self._window_ended or ends_window
        self._micro_step = 0 if ends_window else self._micro_step + 1
        return loss / accumulation if scale_wrt_gas else loss

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's: whether the next backward() ends the accumulation window (Accelerate calls it
        before every backward, with its sync_gradients). True before the window's count ends it early
        (that backward reduces, the next step() applies; each loss is still divided by
        gradient_accumulation_steps, as in DeepSpeed); False where the window ends anyway is refused
        by backward(). is_gradient_accumulation_boundary() reports it."""
        self._boundary_override = is_boundary

    def step(self, lr_kwargs=None):
        """Applies the optimizer on the window's last micro-step (a no-op on the others), then steps a
        client lr_scheduler (with lr_kwargs) when the step was applied, as DeepSpeed does."""
        if lr_kwargs and self._client_scheduler is None:
            raise ValueError("engine.step(lr_kwargs=...) is for a client lr_scheduler; the configuration's schedule "
                             "follows the engine's step count")
        if self._inside_no_sync:
            raise _C.EngineError("engine.step() inside engine.no_sync(): call it after the with block, as DeepSpeed "
                                 "requires")
        if not self._backward_since_step:
            raise _C.EngineError("engine.step() called without a backward() since the last step")
        engine = self._live()._engine
        if self._rates_from_groups and self._window_ended:  # this step applies the optimizer
            # The rates the groups hold now are the ones this step applies, group by group.
            engine.set_learning_rates([float(g["lr"]) for g in self.basic_optimizer.param_groups])
        try:
            self._last = engine.step()
        finally:
            self._print_reports()
        self._backward_since_step = False
        self._window_ended = False
        self.micro_steps += 1
        self._step_applied = self._last.stepped
        if self._step_applied:
            if self._rates_from_groups:
                # The optimizer stepped (inside the engine): torch's schedulers check for that, also
                # one the script steps itself.
                self.basic_optimizer._opt_called = True
            if self._client_scheduler is not None:
                self._client_scheduler.step(**(lr_kwargs or {}))
            elif self.basic_optimizer is not None and self.lr_scheduler is not None:
                # The engine's schedule sets every group's rate for the next step, as DeepSpeed's do.
                for group in self.basic_optimizer.param_groups:
                    group["lr"] = engine.learning_rate
        return None

    def was_step_applied(self):
        """Whether the last step() updated the parameters (False between boundaries and for a step
        skipped for an fp16 overflow)."""
        return self._step_applied

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

    # ------------------------------------------------------------------ what the loop asks
    @property
    def global_steps(self):
        return self._live()._engine.global_step

    @property
    def global_samples(self):
        """Samples trained on over every rank: a train_batch_size per optimizer step, skipped ones too."""
        return self.global_steps * self.train_batch_size()

    @property
    def skipped_steps(self):
        return self._live()._engine.skipped_steps

    def get_lr(self):
        """The learning rate of the next step: each parameter group's as a client scheduler set it,
        else the engine's."""
        if self._rates_from_groups:
            return [g["lr"] for g in self.basic_optimizer.param_groups]
        return [self._live()._engine.learning_rate]

    def _momentum(self):
        return [tuple(self._betas)] if self._betas is not None else [0.0]

    def get_mom(self):
        return self._momentum()

    def get_global_grad_norm(self):
        return self._last.grad_norm if self._last is not None and self._last.stepped else None

    def is_gradient_accumulation_boundary(self):
        """Whether the next backward() ends the accumulation window: set_gradient_accumulation_boundary's
        value when one was given (DeepSpeed's), else the engine's count."""
        if self._boundary_override is not None:
            return self._boundary_override
        return self._live()._engine.next_backward_is_boundary

    def gradient_accumulation_steps(self):
        return self._live()._engine.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self):
        return self._live()._engine.train_micro_batch_size_per_gpu

    def train_batch_size(self):
        return self._live()._engine.train_batch_size

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
        save_dir/latest at it. client_state: a dict of JSON values, returned by load_checkpoint. A
        client lr_scheduler's state_dict() is saved with it."""
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
        if _lr_client.STATE_KEY in state:
            raise ValueError(f"engine.save_checkpoint: client_state key {_lr_client.STATE_KEY!r} is zerotrain's own")
        if self._client_scheduler is not None:
            state[_lr_client.STATE_KEY] = json.dumps(_lr_client.save_state(self._client_scheduler))
        self._save_replacing(os.fspath(save_dir), tag, state)
        return True

    def _save_replacing(self, save_dir, tag, state):
        """DeepSpeed writes save_dir/tag over what is there (the Trainer saves checkpoint-N again when
        a resumed run reaches N); the engine never writes into an existing checkpoint. So an
        existing save_dir/tag is first moved aside to save_dir/.replaced-<tag>, removed once the new
        one is published and put back if the save fails: at every moment one whole checkpoint of
        that tag exists on disk."""
        final = os.path.join(save_dir, tag)
        aside = os.path.join(save_dir, f".replaced-{tag}")
        rank = self._communicator.rank
        # One folder that every rank writes into: a script that names it per rank (from each rank's
        # clock, say) is told so before anything is written, where DeepSpeed would scatter the
        # checkpoint over the folders, loadable only once merged by hand. The gather is also where
        # every rank is done with save_dir/tag (a load, a previous save) before it moves.
        given = [None] * self.world_size
        comm.all_gather_object(given, (save_dir, tag))
        if len(set(given)) > 1:
            shown = "; ".join(f"rank {r}: {d!r}, tag {t!r}" for r, (d, t) in enumerate(given[:4]))
            raise ValueError(f"engine.save_checkpoint: the ranks gave different folders or tags ({shown}); a zerotrain "
                             "checkpoint is one folder every rank writes into: give every rank the same save_dir and "
                             "tag (e.g. made on rank 0 and sent with deepspeed.comm.broadcast_object_list)")
        moved = torch.tensor([0])
        if rank == 0 and os.path.isdir(final):
            if os.path.exists(aside):
                shutil.rmtree(aside)  # what an earlier interrupted replacement left, superseded since
            os.replace(final, aside)
            moved[0] = 1
        comm.broadcast(moved, src=0)
        try:
            self._live()._engine.save_checkpoint(save_dir, tag, state)
        except BaseException:
            if rank == 0 and moved.item() and not os.path.exists(final):
                os.replace(aside, final)
            raise
        if rank == 0 and moved.item():
            shutil.rmtree(aside, ignore_errors=True)
        script = os.path.join(save_dir, "zero_to_fp32.py")
        if rank == 0 and not os.path.exists(script):  # as DeepSpeed copies its converter beside the tags
            from .utils import zero_to_fp32

            with open(script + ".partial", "w") as f:
                f.write(zero_to_fp32.SCRIPT)
            os.replace(script + ".partial", script)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False):
        """Reads load_dir/tag (default: load_dir/latest), saved at any world size and stage; returns
        (path, client_state), or (None, None) when load_dir holds no checkpoint (as DeepSpeed). A
        client lr_scheduler's state comes back with it (load_lr_scheduler_states=False keeps the
        scheduler as it is)."""
        if not load_lr_scheduler_states and self._client_scheduler is None:
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
        client_state = {k: json.loads(v) for k, v in state.items()}
        scheduler_state = client_state.pop(_lr_client.STATE_KEY, None)
        if self._client_scheduler is not None and load_lr_scheduler_states and not load_module_only:
            if scheduler_state is None:
                _note_once("no-scheduler-state", "the checkpoint holds no lr_scheduler state (saved without a client "
                                                 "lr_scheduler); the scheduler is left as it is")
            else:
                _lr_client.load_state(self._client_scheduler, scheduler_state, self.basic_optimizer)
        return os.path.join(load_dir, str(tag)), client_state

    # ------------------------------------------------------------------ 16-bit model files
    def module_state_dict(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """The module's state_dict() (its working dtype), without frozen parameters on request. At
        stage 3 the units' parameters hold no values outside their forward: save_16bit_model and
        _zero3_consolidated_16bit_state_dict gather them."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters(prefix=prefix.rstrip(".")):
                if not p.requires_grad:
                    state.pop(name, None)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """Stage 3: the whole state_dict on rank 0 (None on the others), each unit gathered in turn so
        that no rank holds more than one unit gathered beyond the persistent parameters. Every rank
        calls it (collectives)."""
        if not self.zero_optimization_partition_weights():
            raise ValueError("this function requires ZeRO-3 mode")
        engine = self._live()._engine
        engine.apply_pending_update()  # a delayed update still running belongs in the values
        values = {}
        shells = self._unit_forwards.shells if self._unit_forwards is not None else {}
        for path, shell in shells.items():
            engine.hold_blocks([shell])
            try:
                for p in self._unit_members.get(path, []):
                    values[id(p)] = p.detach().clone()
            finally:
                engine.release_held_blocks()
        if self.global_rank != 0:
            return None
        state = self.module.state_dict(keep_vars=True)
        frozen = {id(p) for p in self.module.parameters() if not p.requires_grad}
        for name, tensor in list(state.items()):
            if exclude_frozen_parameters and id(tensor) in frozen:
                del state[name]
            else:  # a tied parameter is one tensor under both names, as in DeepSpeed's
                if id(tensor) not in values:
                    values[id(tensor)] = tensor.detach().clone()
                state[name] = values[id(tensor)]
        return state

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin", exclude_frozen_parameters=False):
        """DeepSpeed's: rank 0 writes the model's state_dict (16-bit with bf16/fp16, else fp32) with
        torch.save to save_dir/save_filename. At stage 3 the units are gathered for it, and only when
        zero_optimization.stage3_gather_16bit_weights_on_model_save is set (DeepSpeed's default is not
        to): otherwise nothing is written and it returns False. Every rank calls it."""
        path = os.path.join(os.fspath(save_dir), save_filename)
        if self.zero_optimization_partition_weights():
            if not self.zero_gather_16bit_weights_on_model_save():
                _note_once("no-16bit-save", f"did not save the model {path}: stage3_gather_16bit_weights_on_model_save "
                                            "is false (DeepSpeed's default)")
                return False
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        else:
            self._live()._engine.apply_pending_update()  # a delayed update still running belongs in the file
            state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            torch.save(state, path)
        return True

    def save_fp16_model(self, save_dir, save_filename="pytorch_model.bin"):
        """DeepSpeed's former name of save_16bit_model."""
        return self.save_16bit_model(save_dir, save_filename)

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
