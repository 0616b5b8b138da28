"""The DeepSpeed side of bench/vs_deepspeed.sh: zerotrain's GPT trained by DeepSpeed as a user
would train it, on the batches zerotrain trains on, from zerotrain's initial weights.

Subcommands:
  data --dir D                 writes D/train.bin and D/val.bin, the token files both systems read
  config --out F --data D --stage S --precision P --preset N --micro-batch M --seq T --steps K --run-dir R
                               writes the configuration file both systems train with
  train --config F --init W --result J
                               (under torch.distributed.run) trains with DeepSpeed and writes J
  table RUN_DIR...             the markdown table of bench/vs_deepspeed.sh; exits 1 when an fp32
                               pair's losses disagree

What is shared with the DeepSpeed oracle (tests/oracle/deepspeed_oracle.py, docs/deepspeed_oracle.md)
and imported from it rather than copied: the token file's text, zerotrain's DistributedSampler in
Python (the same windows in the same order on each rank), and the two bf16 start-up adjustments
that make DeepSpeed start where zerotrain starts (undo_construction_step, set_fp32_masters). The
model is bench/zt_gpt.py with zerotrain's parameter names; the initial weights are the file
`zerotrain export --init` wrote, read tensor by tensor.

DeepSpeed reads the very file zerotrain trains with (it ignores zerotrain's own blocks "model",
"data", "train"), less csv_monitor, which would have it write CSV files of its own: its step
times are taken here. The optimizer is the configuration's AdamW, so DeepSpeed builds the
optimizer it builds by default for that configuration.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import struct
import sys
import time
import warnings
from collections.abc import Mapping

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_util import status_bytes  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "tests", "oracle"))

FP32_LOSS_RTOL = 1e-5  # the oracle's fp32 loss tolerance (docs/deepspeed_oracle.md "Tolerances")
# Reported against, never failed on: the oracle's bf16 figures are for the tiny GPT over ten steps;
# a larger model's bf16 rounding differs more between two summation orders.
BF16_LOSS_RTOL = 3e-2
GIB = 1024 ** 3


# ------------------------------------------------------------------------------------ data, config
def cmd_data(a):
    import torch
    from deepspeed_oracle import corpus_tokens

    # The oracle's corpus and split (cmd_prepare there): bytes as tokens, so any preset's vocabulary
    # holds them; a separate held-out file so that zerotrain splits nothing off the training file.
    text = corpus_tokens(40000)
    os.makedirs(a.dir, exist_ok=True)
    for key, chunk in (("train", text[:32000]), ("val", text[32000:])):
        with open(os.path.join(a.dir, f"{key}.bin"), "wb") as f:
            f.write(torch.tensor(list(chunk), dtype=torch.int16).numpy().tobytes())


def cmd_config(a):
    data = os.path.abspath(a.data)
    config = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": {"stage": a.stage},
        "bf16": {"enabled": a.precision == "bf16"},
        "wall_clock_breakdown": False,
        "csv_monitor": {"enabled": True, "output_path": a.run_dir, "job_name": "zerotrain"},
        **({} if a.preset in HF_PRESETS else {"model": {"preset": a.preset}}),
        "data": {"source": "bin", "path": os.path.join(data, "train.bin"), "val_path": os.path.join(data, "val.bin"),
                 "sequence_length": a.seq},
        "train": {"steps": a.steps, "seed": 1234, "threads": 1, "log_dir": a.run_dir},
    }
    with open(a.out, "w") as f:
        json.dump(config, f, indent=1)


# ------------------------------------------------------------------------------------ train
class SafetensorsFile(Mapping):
    """name -> fp32 tensor of a safetensors file, each read from disk when asked for: the initial
    weights never sit in memory twice, so the peak a run reports is DeepSpeed's, not the loader's."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = {k: v for k, v in json.loads(f.read(n)).items() if k != "__metadata__"}
        self.base = 8 + n

    def __getitem__(self, name):
        import torch

        info = self.header[name]
        if info["dtype"] != "F32":
            raise ValueError(f"{self.path}: {name} is {info['dtype']}, expected F32 (zerotrain export --init writes fp32)")
        t = torch.empty(info["shape"], dtype=torch.float32)
        lo, hi = info["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.base + lo)
            if f.readinto(memoryview(t.numpy()).cast("B")) != hi - lo:
                raise ValueError(f"{self.path}: {name} is truncated")
        return t

    def __iter__(self):
        return iter(self.header)

    def __len__(self):
        return len(self.header)


def load_weights(model, weights, partitioned):
    """Copies zerotrain's initial weights into the model by name; under zero.Init one parameter is
    gathered at a time and rank 0's copy is the one kept."""
    import deepspeed
    import torch

    params = dict(model.named_parameters())  # the tied head is wte.weight, listed once
    if set(params) != set(weights):
        raise ValueError(f"{weights.path}: names differ from the model's: missing {sorted(set(params) - set(weights))}, "
                         f"unexpected {sorted(set(weights) - set(params))}")
    for name, p in params.items():
        gather = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if partitioned else contextlib.nullcontext()
        with gather, torch.no_grad():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{weights.path}: {name} has shape {tuple(w.shape)}, the model's is {tuple(p.shape)}")
            p.copy_(w)
            del w


def reset_peak():
    """Restarts VmHWM from the current RSS (Linux >= 4.0: clear_refs "5"); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# Models from transformers (random weights from a seed, no hub), trained by the same script under
# either front. Their vocabulary holds the byte tokens of the data files.
HF_PRESETS = {
    # ~106M parameters: 8 layers of width 768, untied head, vocabulary 32000.
    "hf-llama-100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                          num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                          tie_word_embeddings=False),
}


def build_hf(preset, seed):
    import torch
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_PRESETS[preset]))


def cmd_train(a):
    warnings.filterwarnings("ignore")
    import torch

    if a.front in ("python", "cpp"):
        # The same script on zerotrain's Python package: every `deepspeed` below is zerotrain.
        import zerotrain

        zerotrain.install_as_deepspeed()
    import deepspeed
    from deepspeed_oracle import Sampler, read_tokens, set_fp32_masters, undo_construction_step
    from zt_gpt import GPT, PRESETS

    with open(a.config) as f:
        config = json.load(f)
    ds_config = {k: v for k, v in config.items() if k != "csv_monitor"}
    preset = a.model or config["model"]["preset"]
    hf = preset in HF_PRESETS
    seq = config["data"]["sequence_length"] or (1024 if hf else PRESETS[preset][1])
    micro, steps, seed = config["train_micro_batch_size_per_gpu"], config["train"]["steps"], config["train"]["seed"]
    if config["gradient_accumulation_steps"] != 1:
        sys.exit("deepspeed_train.py steps one micro-batch per optimizer step: gradient_accumulation_steps must be 1")
    torch.set_num_threads(config["train"]["threads"])
    stage, bf16 = config["zero_optimization"]["stage"], config["bf16"]["enabled"]

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    sampler = Sampler(read_tokens(config["data"]["path"]), seq, micro, world, rank, seed)
    weights = None if hf else SafetensorsFile(a.init)

    # Stage 3 builds the model already partitioned, as a DeepSpeed user whose model is large does
    # (and as zerotrain builds it at stage 3).
    build = (lambda: build_hf(preset, seed)) if hf else (lambda: GPT(preset))
    if a.front == "cpp":
        # The command line's own C++ GPT, built as it builds it (train.seed; sharded at stage 3):
        # what differs from `zerotrain train` is the Python loop around the same engine.
        build = lambda: deepspeed.models.GPT(config)
    # transformers' models initialise their weights after construction (post_init), which writes
    # into parameters zero.Init has already sharded: DeepSpeed's partitioned parameters silently
    # ignore those writes (without transformers' own DeepSpeed integration), zerotrain's raise an
    # error. So they are built whole under both fronts and sharded by initialize.
    if stage == 3 and not hf and a.front != "cpp":
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = build()
    else:
        model = build()
    if not hf and a.front != "cpp":
        load_weights(model, weights, partitioned=stage == 3)

    # The peak counts what DeepSpeed holds, not what loading zerotrain's weights or the bf16
    # adjustments below cost: it is taken in two windows, deepspeed.initialize and training.
    windows = reset_peak()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config if a.front == "cpp" else ds_config)
    peak_init = status_bytes("VmHWM")
    # bf16 only (no-ops in fp32): DeepSpeed's construction-time optimizer step at stage 0 and its
    # masters rounded to bf16 would otherwise make the two systems start from different states
    # (docs/deepspeed_oracle.md "Differences found", items 3 and 4).
    # DeepSpeed's own quirks, so they apply to its front only; the transformers models start from
    # their seeded construction, whose bf16 rounding DeepSpeed's masters keep (reported, not fixed).
    undone = undo_construction_step(engine) if a.front == "deepspeed" else False
    masters = set_fp32_masters(engine, model, weights) if bf16 and a.front == "deepspeed" and not hf else ""
    if windows and (undone or masters):
        reset_peak()

    losses, elapsed = [], []
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        if a.front == "cpp":  # the command line's dropout seeds, so that its losses are reproduced bit for bit
            torch.manual_seed(seed + 1000003 * (rank + 1) + 7919 * step)
        x, y = sampler.batch(step, 0)
        if hf:
            logits = engine(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        else:
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        # The loss zerotrain reports: the mean over ranks, in double.
        mean = torch.tensor([float(loss.item())], dtype=torch.float64)
        torch.distributed.all_reduce(mean)
        losses.append(float(mean.item()) / world)
        elapsed.append(time.perf_counter() - t0)
    peak = max(peak_init, status_bytes("VmHWM"))
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    if rank == 0:
        result = {"losses": losses, "elapsed_seconds": elapsed, "peak_rss_bytes": peaks, "world_size": world,
                  "micro_batch": micro, "sequence_length": seq, "optimizer": type(engine.optimizer).__name__,
                  "basic_optimizer": type(engine.basic_optimizer).__name__, "peak_windows": windows,
                  "construction_step_undone": undone, "masters_set_by": masters}
        # Written whole or not at all: a rank that aborts at exit must not leave half a result.
        with open(a.result + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(a.result + ".tmp", a.result)
        print(f"{a.front}: {result['optimizer']} over {result['basic_optimizer']}, losses "
              f"{' '.join(f'{l:.6f}' for l in losses)}", flush=True)
    torch.distributed.barrier()


# ------------------------------------------------------------------------------------ table
def zerotrain_run(d):
    import csv

    with open(os.path.join(d, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(d, "zerotrain.csv")) as f:
        rows = list(csv.DictReader(f))
    return {"losses": summary["losses"], "elapsed_seconds": [float(r["elapsed_seconds"]) for r in rows],
            "peak_rss_bytes": [r["peak_rss_bytes"] for r in summary["ranks"]]}


def rate(run, warmup, tokens_per_step):
    """(tokens/s, mean step seconds) over the steps after warm-up, from elapsed time since training
    began at the end of each step: the same reading for both systems."""
    e = run["elapsed_seconds"]
    start = e[warmup - 1] if warmup > 0 else 0.0
    step = (e[-1] - start) / (len(e) - warmup)
    return tokens_per_step / step, step


def json_run(d, name):
    with open(os.path.join(d, name)) as f:
        return json.load(f)


SYSTEMS = {  # result file, column name
    "cli": ("summary.json", "zerotrain CLI"),
    "cpp": ("cpp.json", "zerotrain C++ GPT from Python"),
    "python": ("python.json", "zerotrain (Python)"),
    "deepspeed": ("deepspeed.json", "DeepSpeed"),
}


def cmd_table_fronts(a):
    """The table with zerotrain's Python front end: DeepSpeed's script under DeepSpeed and under
    zerotrain (python), the command line (cli), and the command line's C++ GPT driven from a Python
    loop (cpp), whichever ran."""
    groups = {}
    for d in a.runs:
        meta = json_run(d, "meta.json")
        groups.setdefault((meta.get("model", "gpt"), meta["stage"], meta["precision"]), []).append((meta, d))
    present = [k for k, (f, _) in SYSTEMS.items() if any(os.path.exists(os.path.join(d, f)) for d in a.runs)]
    ratios = [(x, y) for x, y in (("python", "deepspeed"), ("cpp", "cli"), ("python", "cli")) if x in present and y in present]
    head = ["model", "stage", "precision"] + [f"{SYSTEMS[k][1]} tok/s" for k in present] + \
        [f"{SYSTEMS[x][1]} / {SYSTEMS[y][1]}" for x, y in ratios] + [f"peak RSS/rank {SYSTEMS[k][1]} GiB" for k in present]
    if "python" in present and "deepspeed" in present:
        head.append("loss max rel diff (Python vs DeepSpeed)")
    if "cpp" in present and "cli" in present:
        head.append("C++ GPT from Python: losses equal the CLI's")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    failed = []
    for (model, stage, precision), runs in groups.items():
        rates = {k: [] for k in present}
        mems = {k: [] for k in present}
        diff, same = 0.0, True
        for meta, d in runs:
            tokens = meta["world"] * meta["micro_batch"] * meta["seq"]
            got = {}
            for k in present:
                if k == "cli":
                    got[k] = zerotrain_run(d)
                else:
                    got[k] = json_run(d, SYSTEMS[k][0])
                rates[k].append(rate(got[k], meta["warmup"], tokens)[0])
                mems[k].append(max(int(b) for b in got[k]["peak_rss_bytes"]))
            if "python" in got and "deepspeed" in got:
                pl, dl = got["python"]["losses"], got["deepspeed"]["losses"]
                diff = max(diff, max(abs(x - y) / abs(y) for x, y in zip(pl, dl)) if len(pl) == len(dl) else math.inf)
            if "cpp" in got and "cli" in got:
                same = same and got["cpp"]["losses"] == got["cli"]["losses"]
        med = {k: statistics.median(v) for k, v in rates.items()}
        row = [model, str(stage), precision] + [f"{med[k]:.0f}" for k in present] + \
            [f"{med[x] / med[y]:.2f}" for x, y in ratios] + [f"{statistics.median(mems[k]) / GIB:.2f}" for k in present]
        if "python" in present and "deepspeed" in present:
            mark = ""
            if precision == "fp32" and model == "gpt2-124m" and not diff <= FP32_LOSS_RTOL:
                failed.append(f"{model} stage {stage} fp32: losses differ by {diff:.2e}")
                mark = " **FAIL**"
            row.append(f"{diff:.1e}{mark}")
        if "cpp" in present and "cli" in present:
            row.append("yes" if same else "**no**")
            if not same:
                failed.append(f"{model} stage {stage} {precision}: the C++ GPT from Python lost bitwise equality with the CLI")
        print("| " + " | ".join(row) + " |")
    for f in failed:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failed else 0


def cmd_table(a):
    if any(os.path.exists(os.path.join(d, f)) for d in a.runs for f in ("python.json", "cpp.json")):
        return cmd_table_fronts(a)
    groups = {}
    for d in a.runs:
        with open(os.path.join(d, "meta.json")) as f:
            meta = json.load(f)
        groups.setdefault((meta["stage"], meta["precision"]), []).append((meta, d))
    print("| stage | precision | zerotrain tok/s | DeepSpeed tok/s | ratio | zerotrain step ms | DeepSpeed step ms "
          "| peak RSS/rank zerotrain GiB | DeepSpeed GiB | loss max rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed, notes, curves, optimizers = [], [], [], set()
    for (stage, precision), runs in groups.items():
        zt_rate, ds_rate, zt_step, ds_step, zt_mem, ds_mem, diff = [], [], [], [], [], [], 0.0
        for meta, d in runs:
            zt = zerotrain_run(d)
            with open(os.path.join(d, "deepspeed.json")) as f:
                ds = json.load(f)
            optimizers.add(f"{ds['optimizer']} over {ds['basic_optimizer']}")
            if not ds.get("peak_windows"):
                notes.append(f"stage {stage} {precision}: /proc/self/clear_refs refused, so DeepSpeed's peak RSS "
                             f"includes loading zerotrain's initial weights")
            tokens = meta["world"] * meta["micro_batch"] * meta["seq"]
            for run, rates, steps in ((zt, zt_rate, zt_step), (ds, ds_rate, ds_step)):
                r, s = rate(run, meta["warmup"], tokens)
                rates.append(r)
                steps.append(s * 1e3)
            zt_mem.append(max(zt["peak_rss_bytes"]))
            ds_mem.append(max(ds["peak_rss_bytes"]))
            if len(zt["losses"]) != len(ds["losses"]):
                diff = math.inf
            else:
                diff = max(diff, max(abs(x - y) / abs(y) for x, y in zip(zt["losses"], ds["losses"])))
            if meta["round"] == 1:
                curves.append((stage, precision, zt["losses"], ds["losses"]))
        mark = ""
        if precision == "fp32" and not diff <= FP32_LOSS_RTOL:
            failed.append(f"stage {stage} fp32: losses differ by {diff:.2e} (relative), above {FP32_LOSS_RTOL:.0e}")
            mark = f" **FAIL** (> {FP32_LOSS_RTOL:.0e})"
        if precision == "bf16" and not diff <= BF16_LOSS_RTOL:
            notes.append(f"stage {stage} bf16: losses differ by {diff:.2e} (relative), above {BF16_LOSS_RTOL:.0e} (reported only)")
            mark = f" (> {BF16_LOSS_RTOL:.0e})"
        z, s = statistics.median(zt_rate), statistics.median(ds_rate)
        print(f"| {stage} | {precision} | {z:.0f} | {s:.0f} | {z / s:.2f} | {statistics.median(zt_step):.0f} "
              f"| {statistics.median(ds_step):.0f} | {statistics.median(zt_mem) / GIB:.2f} "
              f"| {statistics.median(ds_mem) / GIB:.2f} | {diff:.1e}{mark} |")
    print()
    print("Losses per step (round 1; mean over ranks):")
    print()
    for stage, precision, zl, dl in curves:
        print(f"- stage {stage} {precision} zerotrain: {' '.join(f'{x:.6f}' for x in zl)}")
        print(f"- stage {stage} {precision} DeepSpeed: {' '.join(f'{x:.6f}' for x in dl)}")
    print()
    print(f"DeepSpeed's optimizer: {'; '.join(sorted(optimizers))}.")
    for n in dict.fromkeys(notes):
        print(f"note: {n}", file=sys.stderr)
    for f in failed:
        print(f"FAIL: {f}: zerotrain and DeepSpeed did not compute the same thing", file=sys.stderr)
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("data")
    s.add_argument("--dir", required=True)
    s = sub.add_parser("config")
    for name in ("--out", "--preset", "--precision", "--run-dir", "--data"):
        s.add_argument(name, required=True)
    for name in ("--stage", "--micro-batch", "--seq", "--steps"):
        s.add_argument(name, type=int, required=True)
    s = sub.add_parser("train")
    for name in ("--config", "--result"):
        s.add_argument(name, required=True)
    s.add_argument("--init", help="zerotrain's initial weights (the GPT presets; the transformers models are seeded)")
    s.add_argument("--model", help=f"a transformers model instead of the configuration's GPT preset: {', '.join(HF_PRESETS)}")
    s.add_argument("--front", choices=("deepspeed", "python", "cpp"), default="deepspeed",
                   help="python: zerotrain's Python package stands in for DeepSpeed (install_as_deepspeed); cpp: "
                        "the same, training zerotrain.models.GPT (the command line's C++ GPT)")
    s = sub.add_parser("table")
    s.add_argument("runs", nargs="+")
    a = p.parse_args()
    return {"data": cmd_data, "config": cmd_config, "train": cmd_train, "table": cmd_table}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
