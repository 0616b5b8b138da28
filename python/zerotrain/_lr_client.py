"""A client learning-rate scheduler: initialize(lr_scheduler=...) with a torch scheduler object, a
callable that makes one from the optimizer, or one of DeepSpeed's schedule classes
(zerotrain.lr_schedules), as DeepSpeed takes them.

- One of DeepSpeed's schedule classes becomes the configuration's "scheduler" block: the engine
  runs that schedule itself.
- Any other scheduler is the script's: engine.step() steps it after every optimizer step that was
  applied (not after a skipped fp16 step), as DeepSpeed does, with step(lr_kwargs)'s keywords, and
  its state_dict() goes into save_checkpoint's client state and comes back with load_checkpoint.
  The learning rate it writes into the optimizer's parameter groups is the one the next step
  applies, group by group, as in DeepSpeed: step() hands them to the engine
  (Engine::set_learning_rates) before the step.
"""
import base64
import io

import torch

from . import _C
from .lr_schedules import EngineSchedule

STATE_KEY = "zerotrain.lr_scheduler"  # save_checkpoint's client_state entry that holds its state_dict()


def resolve(lr_scheduler, basic_optimizer):
    """The scheduler object: a callable is called with the optimizer, as DeepSpeed calls it."""
    if lr_scheduler is None:
        return None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        made = lr_scheduler(basic_optimizer)
        if made is None:
            return None
        lr_scheduler = made
    if not (hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")):
        raise TypeError(f"zerotrain.initialize: expected lr_scheduler to be a torch.optim.lr_scheduler object or a "
                        f"callable making one from the optimizer, found {type(lr_scheduler).__name__}")
    return lr_scheduler


def runs_in_engine(scheduler):
    return isinstance(scheduler, EngineSchedule)


def save_state(scheduler):
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def load_state(scheduler, text, optimizer):
    """Restores the scheduler, and the optimizer's learning rates it had set (what DeepSpeed's
    checkpoint restores with the optimizer's own state)."""
    state = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    scheduler.load_state_dict(state)
    last = getattr(scheduler, "get_last_lr", None)
    if optimizer is not None and last is not None:
        for group, lr in zip(optimizer.param_groups, last()):
            group["lr"] = lr
