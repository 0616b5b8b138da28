"""The peer run for bench/offload_vs_deepspeed.sh: zerotrain's GPT presets trained by DeepSpeed.

The model is the architecture of src/models/gpt.cpp (bench/zt_gpt.py: pre-LN GPT-2, learned
positions, tanh GELU, tied token embedding and head, biases everywhere, fp32 loss), with GPT-2's
initialisation drawn in each module's reset_parameters so that it also holds under zero.Init (stage
3 partitions each module's parameters as soon as its constructor returns). Data are synthetic token ids (seeded, per
rank), micro-batch and sequence length as given: step time and memory do not depend on the text.

Run under torchrun (one process per rank) with DS_ACCELERATOR=cpu; bench/deepspeed_env.sh sets the
environment. Every rank prints one line per step and one summary line, prefixed "DSBENCH" and made
of key=value fields, for the shell script to parse:
  DSBENCH step rank=0 step=1 seconds=1.234 loss=10.98 peak_rss_bytes=...
  DSBENCH summary rank=0 world=2 params=... steps=3 peak_rss_bytes=... baseline_rss_bytes=... nvme_bytes=...
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

import torch

# The model (zerotrain's GPT in PyTorch) and the preset table, shared with the DeepSpeed oracle.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zt_gpt import GPT, PRESETS, parameter_count  # noqa: E402
from bench_util import set_path  # noqa: E402


def peak_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def disk_bytes(path):
    if not path or not os.path.isdir(path):
        return 0
    out = subprocess.run(["du", "-sb", path], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout else 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    p.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"],
                   help="stage 3 only (DeepSpeed refuses it at other stages)")
    p.add_argument("--nvme-path", default="", help="directory for the swap files (NVMe offload)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DeepSpeed configuration value (JSON value), e.g. zero_optimization.sub_group_size=100000000")
    p.add_argument("--print-config", action="store_true")
    a = p.parse_args()

    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    import deepspeed

    v, t, _, _, c = PRESETS[a.preset]
    if a.seq > t:
        sys.exit(f"--seq {a.seq} exceeds the context length {t} of preset {a.preset}")
    if "nvme" in (a.offload_optimizer, a.offload_param) and not a.nvme_path:
        sys.exit("NVMe offload needs --nvme-path")
    zero = {"stage": a.stage}
    if a.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": a.offload_optimizer, "pin_memory": False}
        if a.offload_optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = a.nvme_path
    if a.offload_param != "none":
        # The swap buffers must hold the largest tensor: the token embedding.
        zero["offload_param"] = {"device": a.offload_param, "pin_memory": False,
                                 "buffer_size": max(100_000_000, v * c)}
        if a.offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = a.nvme_path
    config = {
        "train_micro_batch_size_per_gpu": a.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": a.precision == "bf16"},
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    for s in a.set:
        key, sep, value = s.partition("=")
        if not sep:
            sys.exit(f"--set expects KEY=VALUE, found '{s}'")
        set_path(config, key, value)

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if a.print_config and rank == 0:
        print("DSBENCH config " + json.dumps(config, sort_keys=True), flush=True)
    baseline = rss_bytes()  # the runtime before the model, as zerotrain's summary reports it
    torch.manual_seed(1234)
    if a.stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(a.preset)
    else:
        model = GPT(a.preset)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(1, a.steps + 1):
        tokens = torch.randint(0, v, (a.micro_batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t0
        losses.append(float(loss))
        print(f"DSBENCH step rank={rank} step={step} seconds={seconds:.4f} loss={losses[-1]:.5f} "
              f"peak_rss_bytes={peak_rss_bytes()}", flush=True)
    nvme = disk_bytes(a.nvme_path) if rank == 0 else 0
    torch.distributed.barrier()
    print(f"DSBENCH summary rank={rank} world={world} preset={a.preset} params={parameter_count(a.preset)} "
          f"steps={a.steps} peak_rss_bytes={peak_rss_bytes()} baseline_rss_bytes={baseline} nvme_bytes={nvme}", flush=True)


if __name__ == "__main__":
    main()
