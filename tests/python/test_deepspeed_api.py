"""DeepSpeed's Python API as scripts and the Hugging Face libraries reach it, in one process on the
CPU: the accelerator, add_config_arguments, DeepSpeed's module names, the engine as a module with
DeepSpeed's queries, backward(scale_wrt_gas), the accumulation boundary, save_16bit_model and a
client lr_scheduler. Tiny models only."""
import argparse
import copy
import io
import logging
import math

import pytest
import torch

import zerotrain

deepspeed = zerotrain.install_as_deepspeed()


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def config(stage=0, accumulation=1, **extra):
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation, "gradient_clipping": 0.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
         "zero_optimization": {"stage": stage}}
    c.update(extra)
    return c


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def mse(out, y):
    return torch.nn.functional.mse_loss(out.float(), y)


def train_torch(model, optimizer, data, scheduler=None, accumulation=1):
    """torch's loop: the mean loss of each window's micro-batches, one optimizer step per window."""
    losses = []
    for i, (x, y) in enumerate(data):
        loss = mse(model(x), y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return losses


def train(engine, data):
    losses = []
    for x, y in data:
        loss = mse(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------- accelerator
def test_the_accelerator_is_the_cpu_the_python_package_trains_on():
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is deepspeed.get_accelerator()
    assert (acc.device_name(), acc.device_name(0), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_available() and acc.device_count() >= 1
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    acc.set_device(0)
    acc.synchronize()
    acc.manual_seed(3)
    a = torch.randn(4)
    acc.manual_seed_all(3)
    assert torch.equal(torch.randn(4), a)
    t = torch.ones(3)
    assert acc.pin_memory(t) is t  # DeepSpeed's CPU accelerator pins nothing
    assert acc.on_accelerator(t) and not acc.on_accelerator(torch.empty(1, device="meta"))
    assert acc.Stream is None and acc.Event is None
    with acc.stream(None):
        pass
    assert acc.max_memory_allocated() >= acc.memory_allocated() > 0
    assert acc.total_memory() > 0 and acc.available_memory() > 0
    acc.empty_cache()
    with pytest.raises(zerotrain.NotSupportedError, match="create_op_builder is not supported"):
        acc.create_op_builder("CPUAdamBuilder")


def test_a_package_that_trains_on_cuda_reports_cuda_where_torch_sees_a_gpu(monkeypatch):
    import zerotrain.accelerator as accelerator
    import zerotrain.engine as engine_module

    monkeypatch.setattr(accelerator, "_accelerator", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert type(accelerator.get_accelerator()).__name__ == "CPUAccelerator"  # the front end trains on the CPU
    monkeypatch.setattr(accelerator, "_accelerator", None)
    monkeypatch.setattr(engine_module, "TRAINING_DEVICE_TYPES", ("cpu", "cuda"))
    acc = accelerator.get_accelerator()
    assert (acc.device_name(), acc.device_name(1)) == ("cuda", "cuda:1")
    assert acc.communication_backend_name() == "nccl"
    assert acc.on_accelerator(torch.empty(1, device="meta")) is False


# ---------------------------------------------------------------------------------- arguments
def test_add_config_arguments_adds_deepspeeds_arguments_and_no_local_rank():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # what the common script defines itself
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--local_rank", "1", "--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.local_rank, args.deepspeed, args.deepspeed_config) == (1, True, "ds.json")
    assert (args.deepscale, args.deepscale_config) == (False, None)
    added = {s for a in parser._actions for s in a.option_strings} - {"-h", "--help", "--local_rank"}
    assert added == {"--deepspeed", "--deepspeed_config", "--deepscale", "--deepscale_config"}


def test_args_local_rank_and_the_engine_device_follow_the_launcher():
    args = argparse.Namespace(local_rank=-1, deepspeed_config=None)
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, config=config())
    assert engine.local_rank == args.local_rank == zerotrain.comm.get_local_rank()
    assert engine.device == torch.device("cpu")


# ---------------------------------------------------------------------------------- modules
def test_deepspeeds_module_names_import_and_answer():
    import deepspeed.runtime.zero.partition_parameters as pp
    from deepspeed.compression.helper import recursive_getattr, recursive_setattr
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES, WARMUP_LR
    from deepspeed.runtime.zero import partition_parameters

    assert pp is partition_parameters and deepspeed.runtime.zero is deepspeed.zero
    assert [(s.name, s.value) for s in pp.ZeroParamStatus] == [("AVAILABLE", 1), ("NOT_AVAILABLE", 2), ("INFLIGHT", 3)]
    assert pp.Init is deepspeed.zero.Init and pp.GatheredParameters is deepspeed.zero.GatheredParameters
    assert VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert WARMUP_LR == "WarmupLR"
    wrapped = pp.zero_wrapper_for_fp_tensor_constructor(torch.zeros, torch.bfloat16, torch.device("cpu"))
    assert wrapped(3).dtype == torch.bfloat16 and wrapped(3, dtype=torch.int64).dtype == torch.int64
    model = tiny_model()
    assert recursive_getattr(model, "0.weight") is model[0].weight
    recursive_setattr(model, "1", torch.nn.ReLU())
    assert isinstance(model[1], torch.nn.ReLU)


def test_logger_and_log_dist_follow_deepspeeds_rules():
    from deepspeed.utils import log_dist, logger

    assert logger is deepspeed.logger and logger.name == "DeepSpeed" and logger.level == logging.WARNING
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    try:
        log_dist("said", ranks=[0], level=logging.WARNING)
        log_dist("quiet", ranks=[0])  # INFO, below the logger's level
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        log_dist("not mine", ranks=[rank + 5], level=logging.WARNING)
    finally:
        logger.removeHandler(handler)
    # Before the job is joined every rank logs, as "rank -1"; after, the ranks listed only.
    assert out.getvalue() == (f"[Rank {rank}] said\n" if rank >= 0 else "[Rank -1] said\n[Rank -1] not mine\n")


def test_moe_groups_without_experts_are_the_groups_given():
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = tiny_model()
    groups = ({"params": iter(model[0].parameters()), "name": "a"}, {"params": model[2].parameters(), "name": "b"})
    got = split(groups)
    assert isinstance(got, list) and [g["name"] for g in got] == ["a", "b"]
    assert got[0]["params"] == list(model[0].parameters()) and got[1]["params"] == list(model[2].parameters())
    single = {"params": list(model.parameters()), "lr": 0.1}
    assert split(single) == [single]
    model[0].weight.allreduce = False  # what DeepSpeed's MoE layer marks its experts with
    with pytest.raises(zerotrain.NotSupportedError, match="expert-parallel.*not supported"):
        split({"params": list(model.parameters()), "name": "a"})


def test_zero_init_ignores_the_auto_values_hugging_face_leaves_and_transformers_context_works():
    transformers_deepspeed = pytest.importorskip("transformers.integrations.deepspeed",
                                                 reason="transformers is not installed (scripts/python_deps.sh)")
    hf_config = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                                       "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"}}
    assert deepspeed.zero.Init(config_dict_or_path=hf_config).threshold == 100000  # DeepSpeed's default
    hf_config["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    # modeling_utils' contexts for a model built under ZeRO-3, in its order.
    with transformers_deepspeed.prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=hf_config):
        layer = torch.nn.Linear(8, 16)
        positions = torch.arange(4, dtype=torch.float64)
    assert positions.dtype == torch.float64
    assert layer.weight.shape == (16, 8)
    with pytest.raises(zerotrain.ReleasedParameterError):
        layer.weight.sum()  # born sharded: the 10-element threshold made it a unit
    with deepspeed.zero.GatheredParameters(list(layer.parameters())):
        assert layer.weight.abs().sum() > 0


# ---------------------------------------------------------------------------------- the engine
def test_the_engine_is_a_module_wrapping_the_model():
    model = tiny_model()
    model.note = "the model's own attribute"
    engine, _, _, _ = deepspeed.initialize(model=model, config=config())
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert [p for p in engine.parameters()] == [p for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == ["module." + n for n, _ in model.named_parameters()]
    assert list(engine.state_dict()) == ["module." + k for k in model.state_dict()]
    assert engine.note == "the model's own attribute"  # DeepSpeedEngine's fall-through to the model
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        engine.nothing_here
    engine.eval()
    assert not model.training and not engine.training
    engine.train()
    assert model.training
    assert (engine.fp16_enabled(), engine.bf16_enabled(), engine.bfloat16_enabled()) == (False, False, False)
    assert engine.zero_optimization_stage() == 0 and not engine.zero_optimization()
    assert engine.optimizer_name() == "AdamW" and engine.optimizer_params()["lr"] == 1e-2
    assert engine.get_batch_info() == (4, 4, 1) and engine.steps_per_print() == 10
    assert isinstance(engine.optimizer, deepspeed.DeepSpeedOptimizer)
    with pytest.raises(zerotrain.NotSupportedError, match="DeepSpeedEngine.offload_states is not supported"):
        engine.offload_states()


def test_steps_per_print_infinity_means_never_as_in_deepspeed(capsys):
    every, _, _, _ = deepspeed.initialize(model=tiny_model(), config=config(steps_per_print=1))
    train(every, batches(2))
    assert "step=2" in capsys.readouterr().out
    never, _, _, _ = deepspeed.initialize(model=tiny_model(), config=config(steps_per_print=float("inf")))
    train(never, batches(3))
    assert "step=" not in capsys.readouterr().out and never.steps_per_print() > 2 ** 62
    with pytest.raises(zerotrain.ConfigError, match=r"^gradient_clipping: expected a finite number, found nan$"):
        deepspeed.initialize(model=tiny_model(), config=config(gradient_clipping=float("nan")))


def test_bf16_queries_and_was_step_applied():
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(1, accumulation=2, bf16={"enabled": True}))
    assert engine.bf16_enabled() and engine.bfloat16_enabled() and not engine.fp16_enabled()
    assert engine.communication_data_type == torch.bfloat16
    assert not engine.was_step_applied()
    for i, (x, y) in enumerate(batches(4)):
        engine.backward(mse(engine(x.bfloat16()), y))
        engine.step()
        assert engine.was_step_applied() == (i % 2 == 1)


def test_was_step_applied_is_false_for_a_skipped_fp16_step():
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(
        0, fp16={"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2, "hysteresis": 1}))
    x, y = batches(1)[0]
    engine.backward(mse(engine(x.half()), y))
    engine.step()
    assert engine.skipped_steps == 1 and not engine.was_step_applied()


# 41: the smallest count whose float reciprocal times the count is not 1.
@pytest.mark.parametrize("accumulation", [4, 3, 41])
def test_backward_without_scale_wrt_gas_takes_the_loss_as_divided_by_the_script(accumulation):
    data = batches(2 * accumulation)
    a, b = tiny_model(), tiny_model()
    ea, _, _, _ = deepspeed.initialize(model=a, config=config(0, accumulation=accumulation))
    eb, _, _, _ = deepspeed.initialize(model=b, config=config(0, accumulation=accumulation))
    for x, y in data:
        loss = mse(ea(x), y)
        # DeepSpeed returns the loss it differentiated
        assert torch.equal(ea.backward(loss), loss / accumulation)
        ea.step()
        mine = mse(eb(x), y) / accumulation  # the Hugging Face Trainer divides by the accumulation itself
        assert eb.backward(mine, scale_wrt_gas=False) is mine
        eb.step()
    assert ea.global_steps == eb.global_steps == 2
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)  # the same gradients bit for bit, whatever the count


def test_the_accumulation_boundary_set_before_each_backward_as_accelerate_sets_it():
    data = batches(6)
    model, reference = tiny_model(), tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(2, accumulation=3))
    losses = []
    for i, (x, y) in enumerate(data):
        boundary = (i + 1) % 3 == 0
        engine.set_gradient_accumulation_boundary(boundary)  # Accelerate: before every backward
        assert engine.is_gradient_accumulation_boundary() == boundary
        loss = mse(engine(x), y)
        engine.backward(loss)
        losses.append(loss.item())
        if boundary:  # Accelerate steps only when it synchronises
            engine.step()
    want = train_torch(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0), data,
                       accumulation=3)
    assert losses == pytest.approx(want, rel=1e-5) and engine.global_steps == 2
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(mse(engine(data[0][0]), data[0][1]))
    engine.backward(mse(engine(data[1][0]), data[1][1]))
    with pytest.raises(zerotrain.EngineError, match=r"set_gradient_accumulation_boundary\(false\) on micro-step 3 "
                                                    r"of a window of gradient_accumulation_steps 3"):
        engine.backward(mse(engine(data[2][0]), data[2][1]))  # the window ends here: it cannot grow
    assert engine.global_steps == 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_boundary_set_early_ends_the_window_there_as_accelerate_does_at_an_epochs_end(stage):
    """An epoch of 5 micro-batches with 3 accumulation steps: Accelerate synchronises after the
    5th, a window of 2. As in DeepSpeed, that step applies the 2 micro-batches' gradients, each
    loss divided by 3, and the next window starts afresh."""
    data = batches(8)
    model, reference = tiny_model(), tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage, accumulation=3))
    boundaries = [False, False, True, False, True, False, False, True]  # windows of 3, 2, 3
    losses = []
    for (x, y), boundary in zip(data, boundaries):
        engine.set_gradient_accumulation_boundary(boundary)
        loss = mse(engine(x), y)
        engine.backward(loss)
        losses.append(loss.item())
        if boundary:
            engine.step()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for (x, y), boundary in zip(data, boundaries):
        loss = mse(reference(x), y)
        (loss / 3).backward()
        want.append(loss.item())
        if boundary:
            ref_opt.step()
            ref_opt.zero_grad()
    assert engine.global_steps == 3 and losses == pytest.approx(want, rel=1e-5)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name


def test_optimizer_callable_makes_the_client_optimizer_from_the_parameters():
    model, reference = tiny_model(), tiny_model()
    made = []

    def make(params):
        made.append(torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1))
        return made[-1]

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=make, config=config())
    assert engine.client_optimizer is made[0] and engine.optimizer_name() == "AdamW"
    data = batches(3)
    want = train_torch(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), data)
    assert train(engine, data) == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------- 16-bit files
def test_save_16bit_model_writes_the_module_in_its_training_dtype(tmp_path):
    model = tiny_model()
    model[2].bias.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad],
                                           config=config(1, bf16={"enabled": True}))
    x, y = batches(1)[0]
    engine.backward(mse(engine(x.bfloat16()), y))
    engine.step()
    assert engine.save_16bit_model(tmp_path, "m.bin")
    saved = torch.load(tmp_path / "m.bin", weights_only=True)
    assert list(saved) == list(model.state_dict())
    for name, value in model.state_dict().items():
        assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], value), name
    assert engine.save_16bit_model(tmp_path / "sub", exclude_frozen_parameters=True)
    assert "2.bias" not in torch.load(tmp_path / "sub" / "pytorch_model.bin", weights_only=True)


def test_save_16bit_model_at_stage_3_gathers_the_units_only_when_asked(tmp_path):
    model = tiny_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(zero_optimization=zero))
    train(engine, batches(2))
    assert not engine.save_16bit_model(tmp_path)  # DeepSpeed's default: stage 3 saves nothing
    assert not (tmp_path / "pytorch_model.bin").exists()

    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(zero_optimization=dict(
        zero, stage3_gather_16bit_weights_on_model_save=True)))
    train(engine, batches(2))
    assert engine.save_16bit_model(tmp_path)
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert list(saved) == list(model.state_dict())
    for name, p in model.named_parameters():
        assert saved[name].dtype == torch.float32  # training in fp32: the fp32 values
        assert torch.equal(saved[name], zerotrain.utils.safe_get_full_fp32_param(p)), name
    assert engine._zero3_consolidated_16bit_state_dict().keys() == saved.keys()


# ---------------------------------------------------------------------------------- lr schedulers
def test_a_client_scheduler_is_stepped_after_each_applied_step_and_saved_with_the_checkpoint(tmp_path):
    data = batches(8)
    model, reference = tiny_model(), tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)  # keeps the rate here
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                  config=config(0, accumulation=2))
    assert returned is scheduler and engine.lr_scheduler is scheduler
    got = train(engine, data[:4])
    assert scheduler.last_epoch == 2  # once per optimizer step, not per micro-step
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    want = train_torch(reference, ref_opt, data, torch.optim.lr_scheduler.StepLR(ref_opt, 100, 0.5), accumulation=2)
    assert got == pytest.approx(want[:4], rel=1e-5)
    engine.save_checkpoint(tmp_path, client_state={"epoch": 1})

    model2 = tiny_model(seed=3)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler2 = torch.optim.lr_scheduler.StepLR(optimizer2, step_size=100, gamma=0.5)
    engine2, _, _, _ = deepspeed.initialize(model=model2, optimizer=optimizer2, lr_scheduler=scheduler2,
                                            config=config(0, accumulation=2))
    _, client_state = engine2.load_checkpoint(tmp_path)
    assert client_state == {"epoch": 1}  # the scheduler's state is zerotrain's own entry
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert train(engine2, data[4:]) == pytest.approx(want[4:], rel=1e-5)
    assert scheduler2.last_epoch == 4


def test_a_scheduler_callable_gets_the_optimizer_made_from_the_configuration():
    seen = []

    def make(optimizer):
        seen.append(optimizer)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    model = tiny_model()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, lr_scheduler=make, config=config(0))
    basic = seen[0]
    assert isinstance(basic, torch.optim.Optimizer) and engine.basic_optimizer is basic
    assert [p for g in basic.param_groups for p in g["params"]] == list(model.parameters())
    assert basic.param_groups[0]["lr"] == 1e-2 and optimizer.param_groups is basic.param_groups
    train(engine, batches(3))
    assert scheduler.last_epoch == 3 and engine.get_lr() == [1e-2]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_scheduler_that_moves_the_rate_drives_every_group_per_step_and_resumes(tmp_path, stage):
    """The Hugging Face Trainer's kind of schedule: a linear warm-up from 0 then a linear decay
    (transformers.get_linear_schedule_with_warmup is this LambdaLR), two parameter groups with
    rates of their own: every step applies the rates the scheduler set, as torch does, and a
    resume continues them."""
    data = batches(8)
    shape = lambda step: min(1.0, step / 2) * max(0.0, (8 - step) / 6)  # noqa: E731 warm-up 2, decay to 8

    def groups(model):
        return [{"params": [model[0].weight, model[0].bias], "lr": 1e-2},
                {"params": [model[2].weight, model[2].bias], "lr": 3e-2}]

    def make_engine(seed):
        model = tiny_model(seed)
        optimizer = torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, shape)
        engine, _, _, returned = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                      config=config(stage, accumulation=2))
        assert returned is scheduler
        return engine, scheduler

    reference = tiny_model()
    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, weight_decay=0.0)
    want = train_torch(reference, ref_opt, data, torch.optim.lr_scheduler.LambdaLR(ref_opt, shape), accumulation=2)
    engine, scheduler = make_engine(0)
    assert engine.get_lr() == [0.0, 0.0]  # the warm-up's first rate
    got = train(engine, data[:4])
    assert scheduler.last_epoch == 2 and engine.get_lr() == [pytest.approx(1e-2 * shape(2)), pytest.approx(3e-2 * shape(2))]
    assert got == pytest.approx(want[:4], rel=1e-5)
    engine.save_checkpoint(tmp_path)

    engine2, scheduler2 = make_engine(3)
    engine2.load_checkpoint(tmp_path)
    assert scheduler2.state_dict() == scheduler.state_dict()
    assert train(engine2, data[4:]) == pytest.approx(want[4:], rel=1e-5)
    final = {n: p.detach().clone() for n, p in reference.named_parameters()}
    with deepspeed.zero.GatheredParameters(list(engine2.module.parameters())):
        for n, p in engine2.module.named_parameters():
            assert torch.allclose(p, final[n], rtol=1e-5, atol=1e-7), n


def test_deepspeeds_schedule_objects_become_the_engines_schedule():
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    schedule = {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_max_lr": 1e-2,
                                                    "warmup_num_steps": 3, "warmup_type": "linear"}}
    by_config, _, _, _ = deepspeed.initialize(model=tiny_model(), config=config(0, scheduler=schedule))
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    client = WarmupDecayLR(optimizer, total_num_steps=6, warmup_max_lr=1e-2, warmup_num_steps=3, warmup_type="linear")
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=client,
                                                  config=config(0))
    assert returned is client and engine.scheduler_name() == "WarmupDecayLR"
    data = batches(5)
    rates, want = [], []
    for e, out in ((engine, rates), (by_config, want)):
        for x, y in data:
            out.append(e.get_lr()[0])
            e.backward(mse(e(x), y))
            e.step()
    assert rates == want and rates[0] == 0.0 and max(rates) == pytest.approx(1e-2)
    assert client.get_lr() == engine.get_lr()
    with pytest.raises(RuntimeError, match="steps it at every optimizer step"):
        client.step()
    assert not math.isnan(rates[-1])


# ---------------------------------------------------------------------------------- small helpers
def test_comm_collectives_on_one_rank_are_torch_distributeds():
    from deepspeed import comm as dist

    dist.init_distributed()
    t = torch.arange(4.0)
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, t)
    assert torch.equal(out, t)
    dist.reduce_scatter_tensor(out, t * 2)
    assert torch.equal(out, t * 2)
    dist.all_to_all_single(out, t + 1)
    assert torch.equal(out, t + 1)
    objects = [None]
    dist.all_gather_object(objects, {"rank": dist.get_rank()})
    assert objects == [{"rank": 0}]
    handle = dist.all_reduce_coalesced([t.clone(), t.clone()], async_op=True)
    assert handle.wait() and handle.is_completed()
    assert dist.get_world_group() is torch.distributed.group.WORLD and dist.get_all_ranks_from_group() == [0]
    assert dist.get_global_rank(dist.get_world_group(), 0) == 0
    assert dist.get_world_size_from_launcher() == dist.get_world_size() == 1
    assert dist.has_all_gather_into_tensor() and dist.has_reduce_scatter_tensor() and dist.is_available()
    from deepspeed.utils import groups

    assert (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()) == (1, 0)
    assert (groups.get_model_parallel_world_size(), groups.get_tensor_model_parallel_rank()) == (1, 0)


def test_the_small_helpers_scripts_use():
    from deepspeed.moe.utils import configure_moe_param_groups, has_moe_layers, is_moe_param
    from deepspeed.runtime.lr_schedules import get_lr_from_config
    from deepspeed.utils import RepeatingLoader, set_log_level_from_string, z3_leaf_parameter

    assert list(zip(range(5), RepeatingLoader([1, 2]))) == [(0, 1), (1, 2), (2, 1), (3, 2), (4, 1)]
    set_log_level_from_string("info")
    assert deepspeed.logger.level == logging.INFO
    set_log_level_from_string("warning")
    model = tiny_model()
    assert has_moe_layers(model) == (False, 0) and not is_moe_param(model[0].weight)
    assert not z3_leaf_parameter(model[0].weight)
    assert configure_moe_param_groups(list(model.parameters())) == [{"params": list(model.parameters()),
                                                                      "name": "dense-params"}]
    assert get_lr_from_config({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1}}) == (0.1, "")
    assert get_lr_from_config({"type": "Nope", "params": {}})[0] is None
    acc = deepspeed.get_accelerator()
    assert acc.pin_empty(2, 3, dtype=torch.bfloat16).shape == (2, 3) and acc.create_graph() is None
    assert acc.pin_empty_like(torch.ones(4, dtype=torch.float16)).dtype == torch.float16


def test_unwrap_model_for_generation_gathers_a_stage_3_model_for_its_forwards():
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0}))
    x = batches(1)[0][0]
    want = engine(x).detach()
    with deepspeed.zero.unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine
        assert model[0].weight.abs().sum() > 0  # whole for the body
        assert torch.equal(unwrapped(x).detach(), want)
        assert torch.equal(unwrapped(x).detach(), want)
    train(engine, batches(1))  # training goes on after it


# ---------------------------------------------------------------------------------- two ranks
def test_a_deepspeed_script_runs_unchanged_on_two_ranks(tmp_path):
    import launching

    save = tmp_path / "model"
    got, _ = launching.launch(tmp_path, "deepspeed_script_run.py", "script", {"save": str(save)})
    seen = got["collectives"]
    assert seen["send_recv"] == [11.0, 11.0] and seen["batch_isend_irecv"] == 101.0
    assert seen["gather"] == [0.5, 1.5] and seen["scatter"] == 7.0 and seen["reduce"] == 3.0
    assert seen["reduce_scatter_tensor"] == 3.0  # rank 0's half of [1, 2] + [2, 4]
    assert seen["all_gather_object"] == [{"rank": 0}, {"rank": 1}] and seen["broadcast_object_list"] == [{"from": 1}]
    assert got["local_rank"] == 0 and got["scheduler_steps"] == 3
    # Rank 0's file holds every parameter whole (gathered from both ranks' shards) and the buffers.
    assert got["saved"] and got["keys"] == got["want_keys"]
    assert all(got["equal"].values()), got["equal"]
    assert got["elements"] == 8 * 32 + 32 + 32 * 8 + 8 + 8 + 8


def test_a_script_that_makes_its_own_process_group_runs_under_zerotrain_launch_and_torchrun(tmp_path):
    """torch.distributed.init_process_group() in the script itself, before deepspeed.initialize:
    under `zerotrain launch` (whose rank 0 holds MASTER_PORT's socket) as under torchrun."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import launching

    got, _ = launching.launch(tmp_path, "own_process_group.py", "zerotrain-launch", {"leave_group": True})
    assert got["world"] == 2 and got["all_reduce"] == 3.0 and got["steps"] == 3
    # A Gloo group the script left alive (Accelerate on the CPU leaves its own) is ended by
    # zerotrain's exit handler, before the interpreter's teardown could abort in its threads.
    with open(tmp_path / "zerotrain-launch.json.exit") as f:
        assert json.load(f) == {"group_alive_at_exit": False, "engines_holding_the_communicator": 0}
    out = tmp_path / "torchrun.json"
    script = os.path.join(launching.SCRIPTS, "own_process_group.py")
    with socket.socket() as probe:  # a free port (torchrun's --master_port 0 waits for ever)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(port), script, "{}", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out) as f:
        under_torchrun = json.load(f)
    # The same training either way: the launchers only start the ranks.
    assert under_torchrun["losses"] == got["losses"] and under_torchrun["summed"] == got["summed"]
