"""deepspeed.runtime.lr_schedules: DeepSpeed's schedule names and scheduler classes.

The engine runs DeepSpeed's five schedules itself (the configuration's "scheduler" block, in C++).
An object of one of the classes below, handed to zerotrain.initialize(lr_scheduler=...), becomes
that block, as a client optimizer of zerotrain.ops becomes the "optimizer" block: the engine then
applies exactly that schedule at every optimizer step. The object itself only reports (get_lr());
it does not step on its own.
"""
from . import _unsupported

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

# The schedules' parameters: the configuration's scheduler.params keys.
LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"


def get_lr_from_config(config):
    """DeepSpeed's: the learning rate a scheduler block peaks at, and an error text ('' when none)."""
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    kind, params = config["type"], config["params"]
    if kind not in VALID_LR_SCHEDULES:
        return None, f"{kind} is not a valid LR schedule"
    if kind == LR_RANGE_TEST:
        return params[LR_RANGE_TEST_MIN_LR], ""
    if kind == ONE_CYCLE:
        return params[CYCLE_MAX_LR], ""
    if kind == WARMUP_COSINE_LR:
        return None, f"{WARMUP_COSINE_LR} scales the optimizer learning rate by a ratio, so its params define no lr"
    return params[WARMUP_MAX_LR], ""


class EngineSchedule:
    """One of DeepSpeed's schedules, for the engine to run (see the module's docstring)."""

    kind = None

    def __init__(self, optimizer, params, last_batch_iteration):
        name = type(self).__name__
        if last_batch_iteration != -1:
            raise ValueError(f"{name}(last_batch_iteration={last_batch_iteration}): the engine's schedule starts at "
                             "its own step count (restored by load_checkpoint); leave it at -1")
        for key, value in params.items():
            if isinstance(value, (list, tuple)):
                raise ValueError(f"{name}({key}={value!r}): one value for every parameter group is supported, as in "
                                 "the configuration's \"scheduler\" block")
        self.optimizer = optimizer
        self.params = {k: v for k, v in params.items() if v is not None}  # None: the engine's default, DeepSpeed's
        self._engine = None

    def config_block(self):
        """The configuration's "scheduler" block this object stands for."""
        return {"type": self.kind, "params": dict(self.params)}

    def get_lr(self):
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__} runs inside zerotrain's engine: hand it to "
                               "zerotrain.initialize(lr_scheduler=...)")
        return self._engine.get_lr()

    get_last_lr = get_lr

    def step(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__} runs inside zerotrain's engine, which steps it at every optimizer "
                           "step (engine.step())")

    def state_dict(self):
        # The schedule is a function of the engine's step count, which its checkpoints restore.
        return {"last_batch_iteration": (self._engine.global_steps - self._engine.skipped_steps - 1)
                if self._engine is not None else -1}

    def load_state_dict(self, state_dict):
        return None  # nothing of its own: load_checkpoint restores the step count the schedule follows


class LRRangeTest(EngineSchedule):
    kind = LR_RANGE_TEST

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
                 lr_range_test_staircase=False, last_batch_iteration=-1):
        super().__init__(optimizer, dict(lr_range_test_min_lr=lr_range_test_min_lr,
                                         lr_range_test_step_size=lr_range_test_step_size,
                                         lr_range_test_step_rate=lr_range_test_step_rate,
                                         lr_range_test_staircase=lr_range_test_staircase), last_batch_iteration)


class OneCycle(EngineSchedule):
    kind = ONE_CYCLE

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.,
                 last_batch_iteration=-1):
        super().__init__(optimizer, dict(cycle_min_lr=cycle_min_lr, cycle_max_lr=cycle_max_lr,
                                         decay_lr_rate=decay_lr_rate, cycle_first_step_size=cycle_first_step_size,
                                         cycle_second_step_size=cycle_second_step_size,
                                         cycle_first_stair_count=cycle_first_stair_count,
                                         cycle_second_stair_count=cycle_second_stair_count,
                                         decay_step_size=decay_step_size, cycle_momentum=cycle_momentum,
                                         cycle_min_mom=cycle_min_mom, cycle_max_mom=cycle_max_mom,
                                         decay_mom_rate=decay_mom_rate), last_batch_iteration)


class WarmupLR(EngineSchedule):
    kind = WARMUP_LR

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        # warmup_max_lr None: the optimizer's lr, in DeepSpeed's class and in the engine alike.
        super().__init__(optimizer, dict(warmup_min_lr=warmup_min_lr, warmup_max_lr=warmup_max_lr,
                                         warmup_num_steps=warmup_num_steps, warmup_type=warmup_type),
                         last_batch_iteration)


class WarmupDecayLR(EngineSchedule):
    kind = WARMUP_DECAY_LR

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, dict(total_num_steps=total_num_steps, warmup_min_lr=warmup_min_lr,
                                         warmup_max_lr=warmup_max_lr, warmup_num_steps=warmup_num_steps,
                                         warmup_type=warmup_type), last_batch_iteration)


class WarmupCosineLR(EngineSchedule):
    kind = WARMUP_COSINE_LR

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, dict(total_num_steps=total_num_steps, warmup_min_ratio=warmup_min_ratio,
                                         warmup_num_steps=warmup_num_steps, cos_min_ratio=cos_min_ratio,
                                         warmup_type=warmup_type), last_batch_iteration)


_ARGS = "give the schedule in the configuration's \"scheduler\" block"
add_tuning_arguments = _unsupported.function("deepspeed.runtime.lr_schedules.add_tuning_arguments", _ARGS)
get_config_from_args = _unsupported.function("deepspeed.runtime.lr_schedules.get_config_from_args", _ARGS)
parse_arguments = _unsupported.function("deepspeed.runtime.lr_schedules.parse_arguments", _ARGS)
override_params = _unsupported.function("deepspeed.runtime.lr_schedules.override_params", _ARGS)
