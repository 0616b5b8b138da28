"""The Python package over the C++ engine, in one process (the two-rank runs against DeepSpeed are
in tests/oracle/run.sh). Tiny models only."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import zerotrain


def tiny_model(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(dropout), torch.nn.GELU(),
                               torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))


def config(stage=0, accumulation=1, **extra):
    c = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
         "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0}
    c.update(extra)
    return c


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train(engine, data):
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_torch(model, optimizer, data):
    """The plain PyTorch loop the engine replaces."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_trains_as_torch_adamw_does(stage):
    model = tiny_model()
    reference = copy.deepcopy(model)
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    data = batches(6)
    got = train(engine, data)
    want = train_torch(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0), data)
    assert got == pytest.approx(want, rel=1e-5)
    assert engine.global_steps == 6
    # The module's parameters are the engine's: what the module computes is what was trained.
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


def test_the_module_keeps_its_parameter_objects_and_sees_the_updates():
    model = tiny_model()
    before = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in before.items()}
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(2))
    train(engine, batches(1))
    for n, p in model.named_parameters():
        assert p is before[n]
        assert not torch.equal(p.detach(), values[n]), f"{n} did not change"
        full = zerotrain.utils.safe_get_full_fp32_param(p)
        assert torch.equal(full, p.detach()), n


def test_accumulation_steps_only_at_the_boundary():
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(1, accumulation=2, train_batch_size=8))
    assert engine.gradient_accumulation_steps() == 2
    assert not engine.is_gradient_accumulation_boundary()
    train(engine, batches(1))
    assert engine.global_steps == 0 and engine.get_global_grad_norm() is None
    with pytest.raises(zerotrain.EngineError, match="accumulation window"):
        engine.zero_grad()
    train(engine, batches(1, seed=2))
    assert engine.global_steps == 1 and engine.get_global_grad_norm() > 0


def test_client_optimizers_map_onto_the_engine_and_others_are_refused():
    model = tiny_model()
    reference = copy.deepcopy(model)
    opt = zerotrain.ops.adam.FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.1)
    engine, _, _, _ = zerotrain.initialize(model=model, optimizer=opt, config=config(0))
    data = batches(4)
    got = train(engine, data)
    want = train_torch(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1), data)
    assert got == pytest.approx(want, rel=1e-5)
    with pytest.raises(RuntimeError, match="inside zerotrain's engine"):
        opt.step()

    other = tiny_model()
    with pytest.raises(TypeError, match=r"torch\.optim\.adagrad\.Adagrad is not implemented.*FusedAdam"):
        zerotrain.initialize(model=other, optimizer=torch.optim.Adagrad(other.parameters()), config=config(0))


def test_bad_input_is_one_clear_exception():
    model = tiny_model()
    with pytest.raises(zerotrain.ConfigError, match="zero_optimization"):
        zerotrain.initialize(model=model, config=config(0, zero_optimization={"stage": 7}))
    with pytest.raises(zerotrain.ConfigError):
        zerotrain.initialize(model=model, config=dict(config(0), no_such_key_at_all=1, zero_optimisation={}))
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        zerotrain.initialize(model=model, model_parameters=list(model.parameters()) + [stranger], config=config(0))
    with pytest.raises(ValueError, match="only lr and weight_decay may be set per group"):
        zerotrain.initialize(model=model, config=config(0),
                             model_parameters=[{"params": [model[0].weight]},
                                               {"params": [p for n, p in model.named_parameters() if n != "0.weight"],
                                                "betas": (0.8, 0.9)}])
    with pytest.raises(ValueError, match="require a gradient but are not in model_parameters"):
        zerotrain.initialize(model=model, model_parameters=[model[0].weight], config=config(0))
    with pytest.raises(ValueError, match="not JSON"):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "zt-python-bad.json")
        with open(path, "w") as f:
            f.write("{ nope")
        zerotrain.initialize(model=model, config=path)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(0))
    with pytest.raises(zerotrain.EngineError, match="without a backward"):
        engine.step()


def test_frozen_parameters_and_buffers_stay_as_they_are():
    model = tiny_model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    model.register_buffer("counter", torch.tensor([1.5]))
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=config(2))
    train(engine, batches(2))
    assert torch.equal(model[0].weight.detach(), frozen)
    assert model[0].weight.grad is None
    assert float(model.counter) == 1.5


def test_save_and_resume_is_exact(tmp_path):
    data = batches(6)
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(2))
    train(engine, data[:3])
    engine.save_checkpoint(tmp_path, client_state={"epoch": 3, "note": ["a", 1]})
    straight = train(engine, data[3:])

    model2 = tiny_model(seed=5)  # other initial values: all must come from the checkpoint
    engine2, _, _, _ = zerotrain.initialize(model=model2, config=config(3))
    path, state = engine2.load_checkpoint(tmp_path)
    assert path == os.path.join(str(tmp_path), "global_step3")
    assert state == {"epoch": 3, "note": ["a", 1]}
    assert engine2.global_steps == 3
    assert train(engine2, data[3:]) == straight

    empty = tmp_path / "empty"
    empty.mkdir()
    assert engine2.load_checkpoint(empty) == (None, None)
    with pytest.raises(TypeError, match="JSON values"):
        engine2.save_checkpoint(tmp_path, client_state={"t": torch.zeros(1)})


def test_a_python_checkpoint_is_the_command_lines_format(tmp_path):
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(1))
    train(engine, batches(2))
    engine.save_checkpoint(tmp_path, tag="t2")
    cli = os.environ.get("ZT_BIN")
    if not cli:
        pytest.skip("ZT_BIN (the zerotrain command line) not given")
    out = tmp_path / "w.safetensors"
    subprocess.run([cli, "export", str(tmp_path), "--out", str(out)], check=True, capture_output=True)
    from safetensors.torch import load_file

    weights = load_file(str(out))
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p.detach()), name


def test_safe_set_changes_one_parameter_everywhere():
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(1, bf16={"enabled": True}))
    value = torch.linspace(-1, 1, 16)
    before = model[4].weight.detach().clone()
    zerotrain.utils.safe_set_full_fp32_param(model[0].bias, value)
    assert torch.equal(zerotrain.utils.safe_get_full_fp32_param(model[0].bias), value)
    assert torch.equal(model[0].bias.detach(), value.to(torch.bfloat16))  # the working copy follows
    assert torch.equal(model[4].weight.detach(), before)
    assert zerotrain.utils.safe_get_full_fp32_param(torch.zeros(2)) is None


def test_checkpointing_recomputes_with_the_same_random_numbers():
    def run(use_checkpoint):
        torch.manual_seed(3)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.GELU())
        x = torch.randn(4, 8, requires_grad=True)
        torch.manual_seed(4)
        y = zerotrain.checkpointing.checkpoint(block, x) if use_checkpoint else block(x)
        y.pow(2).sum().backward()
        return y.detach(), x.grad, block[0].weight.grad

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="tensor arguments"):
        zerotrain.checkpointing.checkpoint(lambda x, k: x * k, torch.ones(2), 3)


def test_install_as_deepspeed_makes_deepspeed_imports_resolve_to_zerotrain():
    code = ("import zerotrain; zerotrain.install_as_deepspeed()\n"
            "import deepspeed\nfrom deepspeed.ops.adam import FusedAdam\nfrom deepspeed.utils import safe_get_full_fp32_param\n"
            "import deepspeed.comm as dist\nprint(deepspeed is zerotrain, FusedAdam.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "zerotrain.ops.adam"]


def test_add_config_arguments_reads_deepspeed_config(tmp_path):
    import argparse

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(0)))
    parser = zerotrain.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(args=args, model=model)
    assert engine.train_micro_batch_size_per_gpu() == 4


def test_training_data_gives_a_loader_of_micro_batches():
    data = torch.utils.data.TensorDataset(torch.randn(20, 8), torch.randn(20, 1))
    model = tiny_model()
    engine, _, loader, _ = zerotrain.initialize(model=model, config=config(0), training_data=data)
    x, y = next(iter(loader))
    assert x.shape == (4, 8) and len(loader) == 5


class _Reader(torch.nn.Module):
    """Reads another module's weight directly (not through that module's forward)."""

    def __init__(self, source):
        super().__init__()
        self._source = [source]  # a list, so that it is not a submodule

    def forward(self, x):
        return torch.nn.functional.linear(x, self._source[0].weight.t())


class _External(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.read = _Reader(self.a)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.read(self.a(x)))


def stage3_external(register):
    torch.manual_seed(0)
    model = _External()
    if register:
        zerotrain.zero.register_external_parameter(model.read, model.a.weight)
    cfg = config(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    engine, _, _, _ = zerotrain.initialize(model=model, config=cfg)
    return train(engine, batches(3))


def test_register_external_parameter_gathers_the_owner_for_the_reader():
    torch.manual_seed(0)
    model = _External()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(0))
    want = train(engine, batches(3))
    assert stage3_external(register=True) == pytest.approx(want, rel=1e-5)
    with pytest.raises(RuntimeError, match="storage of size 0|not allocated"):  # released while the reader runs
        stage3_external(register=False)


def test_fp16_skips_overflowing_steps_with_deepspeeds_loss_scaler():
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(
        2, fp16={"enabled": True, "initial_scale_power": 40, "loss_scale_window": 2, "hysteresis": 1}))
    assert engine.optimizer.loss_scale == 2.0 ** 40  # the scaler's current scale, as DeepSpeed's optimizer has it
    assert engine.loss_scale() == 0 and engine.dynamic_loss_scale()  # the configured one: 0, dynamic
    losses = []
    for x, y in batches(12):  # the module is fp16 now: so are its inputs, as under DeepSpeed
        loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.skipped_steps > 0  # 2^40 overflows fp16 at once: halved on each skipped step
    assert engine.optimizer.loss_scale < 2.0 ** 40
    assert engine.global_steps == 12
    assert all(torch.isfinite(torch.tensor(losses)))
    assert next(model.parameters()).dtype == torch.float16


def test_offload_and_the_delayed_update_train_from_python(tmp_path):
    model = tiny_model()
    reference = copy.deepcopy(model)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(
        2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                                                "delayed_update": True, "delayed_update_after": 2}}))
    ref_engine, _, _, _ = zerotrain.initialize(model=reference, config=config(2))
    data = batches(6)
    got, want = train(engine, data), train(ref_engine, data)
    # The first two steps are ordinary; from then on each update lands one step late.
    assert got[:3] == pytest.approx(want[:3], rel=1e-6)
    assert got[3:] != pytest.approx(want[3:], rel=1e-6)
    engine.destroy()  # completes the update still running
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_reporting_keys_as_deepspeed_honours_them(tmp_path, capsys):
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(
        1, steps_per_print=2, wall_clock_breakdown=True,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"}))
    train(engine, batches(4))
    out = capsys.readouterr().out
    assert "[Rank 0] step=2, skipped=0, lr=[0.01], mom=[(0.9, 0.999)]" in out
    assert "[Rank 0] step=4," in out and "step=3," not in out
    assert "time (ms) | forward:" in out
    lr = (tmp_path / "job" / "Train_Samples_lr.csv").read_text().split()
    assert lr == ["step,lr", "4,0.01", "8,0.01", "12,0.01", "16,0.01"]
    assert (tmp_path / "job" / "Train_Samples_elapsed_time_ms_step.csv").read_text().count("\n") == 3


def test_flops_profiler_measures_the_profiled_step_of_any_module(capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 1, bias=False))
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(
        steps_per_print=100, flops_profiler={"enabled": True, "profile_step": 2}))
    data = batches(3)
    train(engine, data[:1])
    assert engine.flops_report() is None
    train(engine, data[1:])
    report = engine.flops_report()
    assert report["step"] == 2
    # The forward's matrix products, batch 4: 2·4·8·16 + 2·4·16·1, marked by engine(...).
    forward_mm = 2 * 4 * 8 * 16 + 2 * 4 * 16 * 1
    assert dict(report["operators"])["aten::mm"] >= forward_mm
    assert report["forward_flops"] >= forward_mm and report["backward_flops"] > 0
    assert 0 < report["mfu"]
    assert "flops profiler: optimizer step 2 on rank 0" in capsys.readouterr().out


def test_comms_logger_counts_the_engines_collectives_for_log_summary(capsys):
    model = tiny_model()
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(comms_logger={"enabled": True}))
    train(engine, batches(2))
    capsys.readouterr()
    zerotrain.comm.log_summary()
    assert "broadcast" in capsys.readouterr().out
    with pytest.raises(ValueError, match="show_straggler"):
        zerotrain.comm.log_summary(show_straggler=True)


def _fresh_process(code, cwd):
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=cwd).stdout


@pytest.mark.parametrize("retain, installed", [(None, True), ("never", False)])
def test_train_retain_freed_memory_sets_the_heap_policy_and_nothing_is_written_unasked(tmp_path, retain, installed):
    extra = "" if retain is None else f", 'train': {{'retain_freed_memory': '{retain}'}}"
    code = ("import torch, zerotrain\n"
            "m = torch.nn.Linear(4, 2)\n"
            "e, _, _, _ = zerotrain.initialize(model=m, config={'train_micro_batch_size_per_gpu': 1, "
            f"'optimizer': {{'type': 'SGD', 'params': {{'lr': 0.1}}}}{extra}}})\n"
            "for _ in range(2):\n"
            "    e.backward(m(torch.ones(1, 4)).sum()); e.step()\n"
            "print(zerotrain._C.block_cache_installed())\n")
    assert _fresh_process(code, tmp_path).split()[-1] == str(installed)
    assert list(tmp_path.iterdir()) == []  # csv_monitor is off unless the configuration enables it


def test_no_sync_refusals_as_deepspeed_has_them():
    for stage in (2, 3):
        engine, _, _, _ = zerotrain.initialize(model=tiny_model(), config=config(stage))
        with pytest.raises(zerotrain.EngineError, match=f"no_sync\\(\\) at ZeRO stage {stage}: .*partition the gradients"):
            with engine.no_sync():
                pass
    engine, _, _, _ = zerotrain.initialize(model=tiny_model(), config=config(1, accumulation=2, train_batch_size=8))
    (x, y), (x2, y2) = batches(2)
    with engine.no_sync():
        with pytest.raises(zerotrain.EngineError, match="reentry"):
            with engine.no_sync():
                pass
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        with pytest.raises(zerotrain.EngineError, match=r"step\(\) inside engine.no_sync"):
            engine.step()
        # The window's last micro-step: its reduction feeds the step, so it is refused before it runs.
        with pytest.raises(zerotrain.EngineError, match="last micro-step of an accumulation window"):
            engine.backward(torch.nn.functional.mse_loss(engine(x2), y2))
    assert engine.is_gradient_accumulation_boundary()  # the refused backward did not count
    engine.backward(torch.nn.functional.mse_loss(engine(x2), y2))
    engine.step()
    assert engine.global_steps == 1


class _Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class _Moe(torch.nn.Module):
    """Experts picked by the data: the order of their use changes from batch to batch."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(_Expert() for _ in range(3))

    def forward(self, x):
        choice = int(x.detach().abs().sum() * 1000) % 3
        return x + self.experts[choice](x) + 0.5 * self.experts[(choice + 1) % 3](x)


class _MoeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = _Moe()
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def test_leaf_modules_from_the_configuration_and_from_utils():
    torch.manual_seed(0)
    plain = _MoeNet()
    flagged = copy.deepcopy(plain)
    by_utils = copy.deepcopy(plain)
    engine, _, _, _ = zerotrain.initialize(model=plain, config=config(0))
    want = train(engine, batches(4))
    stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, _, _, _ = zerotrain.initialize(model=flagged, config=config(
        3, zero_optimization=dict(stage3, leaf_module={"classes": "_Moe"})))
    assert train(engine, batches(4)) == pytest.approx(want, rel=1e-5)
    assert zerotrain.utils.get_z3_leaf_modules(flagged) == [flagged.moe]
    # The leaf is one unit with its experts' parameters, where they would make 6 units of their own.
    assert list(engine._unit_members) == ["inp", "moe", "out"]
    assert len(engine._unit_members["moe"]) == 12
    assert zerotrain.utils.set_z3_leaf_modules(by_utils, [_Moe]) == [by_utils.moe]
    engine, _, _, _ = zerotrain.initialize(model=by_utils, config=config(3, zero_optimization=stage3))
    assert train(engine, batches(4)) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match=r"set_z3_leaf_modules: expected a module of class Nothing in the model"):
        zerotrain.utils.set_z3_leaf_modules(by_utils, ["Nothing"])


def test_bad_leaf_modules_are_one_clear_exception():
    stage3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
    with pytest.raises(ValueError, match=r"leaf_module: expected the keys classes, names and name_suffixes, found 'nmes'"):
        zerotrain.initialize(model=_MoeNet(), config=config(3, zero_optimization=dict(stage3, leaf_module={"nmes": ["x"]})))
    with pytest.raises(ValueError, match=r"leaf_module.classes: expected a string or a list of strings, found 3"):
        zerotrain.initialize(model=_MoeNet(), config=config(3, zero_optimization=dict(stage3, leaf_module={"classes": 3})))
    with pytest.raises(ValueError, match="leaf 'moe.experts' is a ModuleList, whose forward never runs"):
        zerotrain.initialize(model=_MoeNet(), config=config(
            3, zero_optimization=dict(stage3, leaf_module={"names": ["moe.experts"]})))


def test_steps_after_initialize_reuse_freed_blocks_as_the_command_line_steps_do(tmp_path):
    # initialize builds with no slack in the block cache and gives the steps their slack back, as the
    # command line does: without it every step maps (and page-faults in) its large temporaries anew.
    code = ("import torch, zerotrain\n"
            "torch.manual_seed(0)\n"
            "m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) "
            "for _ in range(6)])\n"
            "e, _, _, _ = zerotrain.initialize(model=m, config={'train_micro_batch_size_per_gpu': 96, "
            "'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}}})\n"
            "x = torch.randn(96, 256)\n"
            "def step():\n"
            "    e.backward(e(x).float().pow(2).mean()); e.step()\n"
            "for _ in range(3): step()\n"
            "before = zerotrain._C.block_cache_stats()\n"
            "for _ in range(5): step()\n"
            "after = zerotrain._C.block_cache_stats()\n"
            "print(after['large_allocations'] - before['large_allocations'], after['mapped'] - before['mapped'])\n")
    allocations, mapped = map(int, _fresh_process(code, tmp_path).split()[-2:])
    assert allocations >= 5 * 6  # each step allocates at least one large block per layer
    assert mapped == 0, f"{mapped} of {allocations} large allocations in the later steps mapped new memory"
