"""What the Hugging Face stack and DeepSpeed's own launcher need of zerotrain standing in for
DeepSpeed, without DeepSpeed: the companion distribution (python/deepspeed-companion), the
`deepspeed` command, the rates a client optimizer's groups carry, buffer dtypes under bf16, a
checkpoint saved again under its tag, zero_to_fp32, DeepSpeed's stage-3 parameter attributes and the
small modules libraries import. The Trainer, Accelerate and TRL themselves run against DeepSpeed
0.19.8 in the oracle (tests/oracle/hf_clients.py). Tiny models only."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import zerotrain

deepspeed = zerotrain.install_as_deepspeed()
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def companion(tmp_path_factory):
    """The companion distribution, installed by pip as a user installs it (into a folder of its own)."""
    target = tmp_path_factory.mktemp("companion")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                           "--no-compile", "--target", str(target), os.path.join(ROOT, "python", "deepspeed-companion")],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"pip could not build the companion distribution (no package index?): {done.stderr[-300:]}")
    return target


def python_with(path_first, code, **env):
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in path_first] +
                                                           [os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ,
                          timeout=300)


def test_the_companion_is_deepspeed_by_import_name_and_metadata(companion):
    done = python_with([companion], """
        import importlib.metadata, json
        import deepspeed, zerotrain
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        out = {"metadata": importlib.metadata.version("deepspeed"), "version": deepspeed.__version__,
               "initialize": deepspeed.initialize is zerotrain.initialize, "comm": deepspeed.comm is zerotrain.comm,
               "engine": deepspeed.DeepSpeedEngine is zerotrain.DeepSpeedEngine,
               "status": ZeroParamStatus is zerotrain.partition_parameters.ZeroParamStatus}
        try:
            from transformers.integrations.deepspeed import is_deepspeed_available
            from accelerate.utils import is_deepspeed_available as accelerate_sees
            out["transformers"], out["accelerate"] = is_deepspeed_available(), accelerate_sees()
        except ImportError:
            pass
        print(json.dumps(out))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["metadata"] == got["version"] == f"0.19.8+zerotrain.{zerotrain.__version__}"
    assert got["initialize"] and got["comm"] and got["engine"] and got["status"]
    if "transformers" in got:  # the Hugging Face libraries' own checks find it
        assert got["transformers"] and got["accelerate"]


def test_the_companion_refuses_to_run_beside_a_real_deepspeed(companion, tmp_path):
    real = tmp_path / "real"
    (real / "deepspeed-0.19.8.dist-info").mkdir(parents=True)
    (real / "deepspeed-0.19.8.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.19.8\n")
    done = python_with([companion, real], "import deepspeed")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "ImportError" in last and "deepspeed 0.19.8 in" in last and "uninstall one" in last


def test_install_as_deepspeed_refuses_once_a_real_deepspeed_is_imported():
    done = python_with([], """
        import sys, types
        real = types.ModuleType("deepspeed"); real.__version__ = "0.19.8"; real.__file__ = "/site/deepspeed/__init__.py"
        sys.modules["deepspeed"] = real
        import zerotrain
        try:
            zerotrain.install_as_deepspeed()
        except ImportError as error:
            print("refused:", error)
    """)
    assert "refused: zerotrain cannot stand in for DeepSpeed in this process: DeepSpeed 0.19.8" in done.stdout, done.stderr


DEEPSPEED_STYLE_SCRIPT = """
import argparse, json, os, sys
import torch
import deepspeed

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--out")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()
deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
g = torch.Generator().manual_seed(engine.global_rank)
losses = []
for _ in range(3):
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
seen = {"local_rank": args.local_rank, "env_local_rank": int(os.environ["LOCAL_RANK"]),
        "world": deepspeed.comm.get_world_size(), "losses": losses}
with open(f"{args.out}.{engine.global_rank}", "w") as f:
    json.dump(seen, f)
"""


def test_the_deepspeed_command_starts_a_script_as_deepspeeds_launcher_does(companion, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DEEPSPEED_STYLE_SCRIPT)
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}))
    out = tmp_path / "seen"
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join([str(companion), os.environ.get("PYTHONPATH", "")]),
                   CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(companion / "bin" / "deepspeed"), "--num_gpus", "2", "--master_port",
                           str(free_port()), str(script), "--out", str(out), "--deepspeed_config", str(ds_config)],
                          capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]
    # DeepSpeed's launcher passes --local_rank=N after the script's own arguments, and sets LOCAL_RANK.
    assert [r["local_rank"] for r in ranks] == [r["env_local_rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 and len(r["losses"]) == 3 for r in ranks)


def test_the_launcher_maps_deepspeeds_flags_or_refuses_them_naming_the_equivalent(tmp_path):
    from zerotrain import launcher

    def command(*argv):
        return launcher.torchrun_command(launcher.parser("deepspeed").parse_args(list(argv) + ["train.py", "--lr", "1"]))

    argv, env = command("--num_gpus", "3", "--master_port", "29999", "--no_local_rank")
    assert argv[:2] == ["--nproc_per_node", "3"] and "29999" in argv and argv[-3:] == ["train.py", "--lr", "1"]
    argv, _ = command("--include", "localhost:0,2", "--module")
    assert argv[:2] == ["--nproc_per_node", "2"] and "--module" in argv
    assert argv[-1] == "--local_rank=${local_rank}"  # torch.distributed.run substitutes each rank's
    argv, _ = command("--no_ssh", "--num_nodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--num_gpus", "1")
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node_rank") + 1] == "1"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    for refused, why in ((["--hostfile", str(hostfile)], "--no_ssh --num_nodes N --node_rank I"),
                         (["--num_nodes", "2"], "--no_ssh"), (["--launcher", "slurm"], "--launcher slurm"),
                         (["--include", "worker-1:0"], "names host 'worker-1'"), (["--autotuning", "tune"], "autotuner"),
                         (["--bind_cores_to_rank"], "numactl")):
        with pytest.raises(zerotrain.NotSupportedError, match=why):
            command(*refused)
    hostfile.write_text("worker-0 slots=eight\n")
    with pytest.raises(ValueError, match="hostfile:1: expected 'HOST slots=N'"):
        command("--hostfile", str(hostfile))


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("stage", [0, 3])
def test_rates_written_into_a_client_optimizers_groups_are_the_next_steps(stage):
    """Accelerate steps a scheduler DeepSpeed does not know (transformers' warm-up LambdaLR) itself;
    it writes the client optimizer's groups, which DeepSpeed's optimizer reads at its next step.
    The engine must apply those rates too, as torch does with the same loop."""
    warm = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731

    def loop(model, optimizer, scheduler, stepper):
        losses = []
        for x, y in batches(5):
            loss = torch.nn.functional.mse_loss(model(x), y)
            stepper(loss)
            scheduler.step()
            losses.append(loss.item())
        return losses

    reference = tiny_model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)

    def torch_step(loss):
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

    want = loop(reference, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, warm), torch_step)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warm)  # not given to initialize
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}})
    assert returned is None

    def engine_step(loss):
        engine.backward(loss)
        engine.step()

    got = loop(engine, optimizer, scheduler, engine_step)
    assert engine.get_lr() == [pytest.approx(1e-2 * warm(5))]
    assert got == pytest.approx(want, rel=1e-6)
    final = dict(reference.named_parameters())
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, p in model.named_parameters():
            assert torch.allclose(p, final[name], rtol=1e-5, atol=1e-7), name


class WithBuffers(torch.nn.Module):
    """A rotary-style fp32 buffer, a second one, and one a transformers list keeps in fp32."""
    _keep_in_fp32_modules_strict = ["router"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8).float() / 8)), persistent=False)
        self.register_buffer("scale", torch.full((8,), 1.0 / 3))
        self.router = torch.nn.Module()
        self.router.register_buffer("bias", torch.full((8,), 5.001))

    def forward(self, x):
        return self.proj(x * self.scale.to(x.dtype) * self.inv_freq.to(x.dtype) + self.router.bias.to(x.dtype))


@pytest.mark.parametrize("data_types,want", [
    ({}, {"inv_freq": torch.float32, "scale": torch.float32, "router.bias": torch.float32}),
    ({"buffer_dtype": "bf16"}, {"inv_freq": torch.bfloat16, "scale": torch.bfloat16, "router.bias": torch.float32}),
    ({"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv*"]},
     {"inv_freq": torch.float32, "scale": torch.bfloat16, "router.bias": torch.bfloat16}),
])
def test_buffers_keep_their_dtype_under_bf16_unless_the_configuration_says_otherwise(data_types, want):
    """DeepSpeed 0.19 casts parameters only: a rotary inv_freq rounded to bf16 moves every angle."""
    model = WithBuffers()
    exact = model.inv_freq.clone()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if data_types:
        config["data_types"] = data_types
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert {name: b.dtype for name, b in model.named_buffers()} == want
    assert model.proj.weight.dtype == torch.bfloat16
    if want["inv_freq"] == torch.float32:
        assert torch.equal(model.inv_freq, exact)
    engine.backward(engine(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean())
    engine.step()


def trained_engine(stage, save_dir=None):
    model = tiny_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
    for x, y in batches(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return engine, model


def gathered(engine, model):
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_saving_again_under_a_tag_replaces_that_checkpoint_as_deepspeed_does(tmp_path):
    """A resumed Trainer saves checkpoint-N/global_stepN again when it reaches N."""
    engine, model = trained_engine(2)
    engine.save_checkpoint(tmp_path, tag="global_step2")
    first = gathered(engine, model)
    x, y = batches(3)[-1]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(tmp_path, tag="global_step2")
    assert sorted(os.listdir(tmp_path)) == ["global_step2", "latest", "zero_to_fp32.py"]  # nothing set aside is left
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    now = gathered(engine, model)
    assert all(torch.equal(saved[n], now[n]) for n in now) and not all(torch.equal(first[n], now[n]) for n in now)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_gives_the_trained_weights_as_deepspeeds_functions_and_script_do(tmp_path, stage):
    from deepspeed.utils import zero_to_fp32

    engine, model = trained_engine(stage)
    engine.save_checkpoint(tmp_path / "ckpt")
    want = gathered(engine, model)
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert list(state) == list(want) and all(torch.equal(state[n], want[n]) for n in want)
    assert all(t.dtype == torch.float32 for t in state.values())
    # Sharded output with its index, as transformers reads it.
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "out"),
                                                             max_shard_size="300B", safe_serialization=True)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and len(set(index["weight_map"].values())) > 1
    fresh = zero_to_fp32.load_state_dict_from_zero_checkpoint(tiny_model(seed=5), str(tmp_path / "ckpt"))
    assert all(torch.equal(p, want[n]) for n, p in fresh.named_parameters())
    # The script beside the tags, as users run DeepSpeed's.
    done = subprocess.run([sys.executable, str(tmp_path / "ckpt" / "zero_to_fp32.py"), str(tmp_path / "ckpt"),
                           str(tmp_path / "bin")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    written = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(written[n], want[n]) for n in want)
    with pytest.raises(zerotrain.DataError, match="no checkpoint|latest"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "nothing-here"))


def test_stage_3_parameters_carry_deepspeeds_status_attributes():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine, model = trained_engine(3)
    weight = model[0].weight
    assert weight.ds_numel == weight.numel() == 128 and weight.ds_shape == weight.shape
    assert [p.ds_id for p in model.parameters()] == [0, 1, 2, 3]
    assert isinstance(weight, torch.nn.Parameter)
    with deepspeed.zero.GatheredParameters([weight]):
        assert weight.ds_status == ZeroParamStatus.AVAILABLE
    # Between forwards a unit's parameters hold no values here (one rank: its shard is the whole,
    # but the working copy is released all the same).
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE


def test_the_small_modules_libraries_import():
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
    from deepspeed.runtime.utils import move_to_device, see_memory_usage

    big = torch.arange(10.0)
    cloned = clone_tensors_for_torch_save({"a": [big[:2], (big[2:3],)], "n": 1})
    assert cloned["a"][0].untyped_storage().nbytes() == 8 and cloned["n"] == 1 and torch.equal(cloned["a"][1][0], big[2:3])
    t = torch.ones(2)
    moved = move_to_device({"x": [t]}, "cpu", criterion_func=lambda v: torch.is_tensor(v))
    assert moved["x"][0] is t
    see_memory_usage("nothing printed without force")
    assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
    import deepspeed.runtime.sequence_parallel.ulysses_sp as ulysses

    with pytest.raises(zerotrain.NotSupportedError, match="sequence parallelism"):
        ulysses.UlyssesSPAttentionHF()


def test_ranks_naming_different_checkpoint_folders_are_told_before_anything_is_written(tmp_path):
    import launching

    got, _ = launching.launch(tmp_path, "per_rank_folders.py", "folders", {"dir": str(tmp_path / "ckpt")})
    assert "the ranks gave different folders or tags" in got["refused"] and "rank 1:" in got["refused"]
    assert got["written"] == []  # nothing was created for the refused save
    assert got["shared"] == ["global_step1", "latest", "zero_to_fp32.py"]
