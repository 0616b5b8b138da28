"""The Hugging Face stack on zerotrain against the same on DeepSpeed 0.19.8 (docs/deepspeed_oracle.md
"The Hugging Face Trainer, Accelerate and TRL"; run by tests/oracle/run.sh).

Each case runs one unchanged script of tests/python/scripts twice on 2 CPU ranks: once with
DeepSpeed installed, once with zerotrain's companion distribution standing in for it (the script
never names zerotrain), and compares the per-step losses. The cases:
  - transformers' Trainer (hf_trainer_run.py) with a DeepSpeed file full of "auto" values and a
    warm-up schedule: GPT-2 and a Llama, ZeRO-2 and ZeRO-3, with and without CPU offload, with
    gradient accumulation; a save at step 5 and a Trainer resume from it; zero_to_fp32 of the last
    checkpoint against the gathered model;
  - an Accelerate loop under `accelerate launch` with a DeepSpeed configuration, a torch AdamW and a
    transformers warm-up schedule (accelerate_run.py);
  - TRL's SFTTrainer on chat examples (trl_sft_run.py), fp32 and bf16.

usage: hf_clients.py --out DIR --deepspeed-path P --zerotrain-path P [--only a,b]
  --deepspeed-path   PYTHONPATH for the DeepSpeed side (DeepSpeed's site, transformers' site, torch)
  --zerotrain-path   PYTHONPATH for zerotrain's side (the companion, the built package, the same
                     transformers' site and torch)
Prints one line per case and exits 1 when one fails or is out of tolerance."""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = os.path.join(ROOT, "tests", "python", "scripts")
# fp32: the same kernels on the same inputs; the two engines differ in the order of a few
# operations (measured at most 2.1e-7). bf16: the oracle's bf16 tolerance (deepspeed_oracle.py),
# for the rounding of bf16 gradients in different summation orders (measured at most 6.8e-5).
FP32_LOSS_RTOL = 1e-5
BF16_LOSS_RTOL = 5e-4

ACCELERATE_DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                 "gradient_clipping": 1.0, "steps_per_print": float("inf")}

CASES = {
    # name: (script, spec, bf16)
    "trainer-gpt2-z2": ("hf_trainer_run.py", {"model": "gpt2", "stage": 2}, False),
    "trainer-gpt2-z3": ("hf_trainer_run.py", {"model": "gpt2", "stage": 3}, False),
    "trainer-gpt2-z2-offload-gas2": ("hf_trainer_run.py",
                                     {"model": "gpt2", "stage": 2, "offload": True, "accumulation": 2}, False),
    "trainer-llama-z3-offload": ("hf_trainer_run.py", {"model": "llama", "stage": 3, "offload": True}, False),
    "accelerate-gpt2-z2": ("accelerate", {"model": "gpt2", "stage": 2}, False),
    "accelerate-llama-z3": ("accelerate", {"model": "llama", "stage": 3}, False),
    "trl-sft-z3": ("trl_sft_run.py", {"stage": 3}, False),
    "trl-sft-z2-bf16": ("trl_sft_run.py", {"stage": 2, "bf16": True}, True),
}
RESUMED = "trainer-gpt2-z3"  # also resumed from its checkpoint-5, and converted by zero_to_fp32


LOG_TAIL_LINES = 15  # of a failed run's log, printed: the test command's output alone must explain a failure


def free_port():
    """A port no one listens on now (the kernel's choice), for the rendezvous of one run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(path, deepspeed):
    env = dict(os.environ, PYTHONPATH=path, PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if not deepspeed:
        for name in ("DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR"):
            env.pop(name, None)
    return env


def accelerate_config(case_dir, stage, port):
    ds = dict(ACCELERATE_DS, zero_optimization={"stage": stage})
    ds_file = os.path.join(case_dir, "ds_config.json")
    with open(ds_file, "w") as f:
        json.dump(ds, f)  # steps_per_print: Infinity, as Accelerate writes it
    yaml = os.path.join(case_dir, "accelerate.yaml")
    with open(yaml, "w") as f:
        f.write("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                f"  deepspeed_config_file: {ds_file}\n  zero3_init_flag: false\nnum_processes: 2\nnum_machines: 1\n"
                f"machine_rank: 0\nmain_process_port: {port}\nuse_cpu: true\n")
    return yaml


def run(case, side, path, out_dir, extra=None):
    script, spec, _ = CASES[case]
    case_dir = os.path.join(out_dir, case, side)
    os.makedirs(case_dir, exist_ok=True)
    spec = dict(spec, out_dir=os.path.join(case_dir, "run"), **(extra or {}))
    tag = "resumed" if extra else "result"
    result, log = os.path.join(case_dir, f"{tag}.json"), os.path.join(case_dir, f"{tag}.log")
    port = str(free_port())
    if script == "accelerate":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   accelerate_config(case_dir, spec["stage"], port), os.path.join(SCRIPTS, "accelerate_run.py")]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", port, os.path.join(SCRIPTS, script)]
    started = time.time()
    with open(log, "w") as f:
        done = subprocess.run(command + [json.dumps(spec), result], stdout=f, stderr=subprocess.STDOUT, timeout=600,
                              env=environment(path, side == "deepspeed"), cwd=case_dir)
    if done.returncode != 0 or not os.path.exists(result):
        with open(log, errors="replace") as f:
            tail = "".join("\n    " + line.rstrip() for line in f.readlines()[-LOG_TAIL_LINES:])
        return None, f"{side} failed (exit {done.returncode}; see {log}); its last lines:{tail}", time.time() - started
    with open(result) as f:
        return json.load(f), None, time.time() - started


def losses_of(result):
    losses = result["losses"]
    return [losses[k] for k in sorted(losses, key=int)] if isinstance(losses, dict) else list(losses)


def worst(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b)) if a else float("inf")


def compare(case, ds, zt, bf16):
    tolerance = BF16_LOSS_RTOL if bf16 else FP32_LOSS_RTOL
    a, b = losses_of(ds), losses_of(zt)
    if len(a) != len(b) or not a:
        return False, f"{len(b)} losses against DeepSpeed's {len(a)}"
    if not zt.get("deepspeed", "").startswith("0.19.8+zerotrain") or not zt.get("engine", "").startswith("zerotrain"):
        return False, f"the zerotrain side ran on {zt.get('deepspeed')} ({zt.get('engine')})"
    if ds.get("deepspeed") != "0.19.8":
        return False, f"the DeepSpeed side ran on {ds.get('deepspeed')}"
    rates = ds.get("rates") == zt.get("rates")
    error = worst(a, b)
    ok = error <= tolerance and rates
    return ok, f"{len(a)} steps, worst loss rel. diff {error:.1e} (tolerance {tolerance:.0e}), rates {'equal' if rates else 'DIFFER'}"


def check_fp32_export(case_dir, path, zt):
    """zero_to_fp32.py in the last checkpoint folder (what save_checkpoint writes there, as DeepSpeed
    does), run as users run it; its weights against the gathered model's sum."""
    run_dir = os.path.join(case_dir, "zerotrain", "run")
    last = max((d for d in os.listdir(run_dir) if d.startswith("checkpoint-")), key=lambda d: int(d.split("-")[1]))
    out = os.path.join(case_dir, "fp32")
    done = subprocess.run([sys.executable, os.path.join(run_dir, last, "zero_to_fp32.py"), os.path.join(run_dir, last),
                           out, "--safe_serialization"], capture_output=True, text=True,
                          env=environment(path, False), timeout=300)
    if done.returncode != 0:
        return False, f"zero_to_fp32.py failed: {done.stderr.strip().splitlines()[-1:]}"
    code = ("import sys, torch\nfrom safetensors.torch import load_file\n"
            "w = load_file(sys.argv[1])\nprint(len(w), repr(sum(float(t.double().sum()) for t in w.values())))")
    done = subprocess.run([sys.executable, "-c", code, os.path.join(out, "model.safetensors")], capture_output=True,
                          text=True, env=environment(path, False), timeout=300)
    if done.returncode != 0:
        return False, f"reading the fp32 weights failed: {done.stderr.strip().splitlines()[-1:]}"
    count, total = done.stdout.split()
    error = abs(float(total) - zt["weight_sum"]) / abs(zt["weight_sum"])
    return error <= 1e-12, f"zero_to_fp32: {count} tensors, sum {float(total):.10f} against the gathered model's " \
                           f"{zt['weight_sum']:.10f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deepspeed-path", required=True)
    parser.add_argument("--zerotrain-path", required=True)
    parser.add_argument("--only", default="")
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.only or c in args.only.split(",")]
    failed = 0
    for case in chosen:
        bf16 = CASES[case][2]
        ds, why, t_ds = run(case, "deepspeed", args.deepspeed_path, args.out)
        zt, why_zt, t_zt = run(case, "zerotrain", args.zerotrain_path, args.out)
        if why or why_zt:
            print(f"hf-clients {case}: FAILED: {why or why_zt}", flush=True)
            failed += 1
            continue
        ok, text = compare(case, ds, zt, bf16)
        print(f"hf-clients {case}: {'ok' if ok else 'FAILED'}: {text} (DeepSpeed {t_ds:.0f} s, zerotrain {t_zt:.0f} s)",
              flush=True)
        failed += not ok
        if case != RESUMED:
            continue
        # The Trainer resumes from checkpoint-5 (it saves at 5 and 10): steps 6-10 again, on each side.
        resumed = {}
        for side, path in (("deepspeed", args.deepspeed_path), ("zerotrain", args.zerotrain_path)):
            resumed[side], why, _ = run(case, side, path, args.out, {"resume": "checkpoint-5"})
            if why:
                print(f"hf-clients {case} resumed: FAILED: {why}")
                failed += 1
        if resumed["deepspeed"] and resumed["zerotrain"]:
            after = lambda values: {k: v for k, v in values.items() if int(k) > 5}  # noqa: E731
            ok, text = compare(case, dict(ds, losses=after(ds["losses"]), rates=after(ds["rates"])),
                               resumed["zerotrain"], bf16)
            ok2, text2 = compare(case, resumed["deepspeed"], resumed["zerotrain"], bf16)
            print(f"hf-clients {case} resumed from checkpoint-5: {'ok' if ok and ok2 else 'FAILED'}: against "
                  f"DeepSpeed's straight run {text}; against DeepSpeed's resume {text2}")
            failed += not (ok and ok2)
        ok, text = check_fp32_export(os.path.join(args.out, case), args.zerotrain_path, zt)
        print(f"hf-clients {case}: {'ok' if ok else 'FAILED'}: {text}")
        failed += not ok
    print(f"hf-clients: {len(chosen)} cases, " + (f"{failed} failure(s)" if failed else "all within tolerance"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
