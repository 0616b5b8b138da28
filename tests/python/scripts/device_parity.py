"""zerotrain's Python package training a module on a device, against the same training on another
device (the CPU): one process, a tiny language model built on the CPU from one seed and moved
(`model.to(device)`), zerotrain.initialize at ZeRO stages 0-3 (stage 3 sharding every submodule:
persistence threshold 0), with CPU offload of the optimizer and of the parameters, in fp32 and bf16, 6 optimizer steps of 2 micro-batches each. The module
must stay on its device and the engine must report it; the per-step losses must agree within the
precision's tolerance. The GPU check (scripts/gpu-check.sh, phase "python") runs it with
--device cuda --reference cpu; the test suite runs it on the CPU against the CPU
(tests/python/test_device_parity.py), so that the script itself is known to work.

usage: device_parity.py --device D --reference R [--only a,b] [--out results.json]
Prints one line per case and exits 1 when a case fails or differs beyond its tolerance."""
import argparse
import json
import sys
import time

import torch

import zerotrain

VOCAB, WIDTH, SEQ, MICRO, STEPS, ACCUMULATION = 96, 64, 16, 4, 6, 2
# fp32: the same model on other matrix-multiply kernels (cuBLAS against oneDNN), a few ulps apart
# per step; bf16: the rounding of bf16 weights and activations in those kernels.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
CASES = {
    "s0-fp32": ({"stage": 0}, "fp32"),
    "s1-fp32": ({"stage": 1}, "fp32"),
    "s2-fp32": ({"stage": 2}, "fp32"),
    "s3-fp32": ({"stage": 3, "stage3_param_persistence_threshold": 0}, "fp32"),
    "s2-fp32-offload": ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "fp32"),
    "s3-fp32-offload": ({"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                         "offload_param": {"device": "cpu"}}, "fp32"),
    "s2-bf16": ({"stage": 2}, "bf16"),
    "s3-bf16-offload": ({"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"}},
                        "bf16"),
}


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(2 * WIDTH, WIDTH)) for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def config(zero, precision):
    c = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
         "gradient_clipping": 1.0, "steps_per_print": 10**9,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
         "zero_optimization": dict(zero)}
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    return c


def batches():
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g) for _ in range(STEPS * ACCUMULATION)]


def train(case, device):
    zero, precision = CASES[case]
    torch.manual_seed(0)
    model = TinyLM().to(device)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(zero, precision))
    try:
        where = {p.device.type for p in model.parameters()}
        if where != {torch.device(device).type}:
            raise AssertionError(f"the module's parameters moved to {sorted(where)} (expected {device})")
        if engine.device.type != torch.device(device).type:
            raise AssertionError(f"engine.device is {engine.device} (expected {device})")
        losses = []
        started = time.time()
        for i, ids in enumerate(batches()):
            ids = ids.to(device)
            logits = engine(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            if (i + 1) % ACCUMULATION == 0:
                losses.append(loss.item())
        return {"losses": losses, "seconds": time.time() - started, "steps": engine.global_steps}
    finally:
        engine.destroy()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", required=True)
    parser.add_argument("--reference", default="cpu")
    parser.add_argument("--only", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    chosen = [c for c in CASES if not args.only or c in args.only.split(",")]
    zerotrain.init_distributed()
    results, failed = {}, 0
    for case in chosen:
        try:
            got, want = train(case, args.device), train(case, args.reference)
        except Exception as error:  # one line per case, then the next
            print(f"device-parity {case}: FAILED: {type(error).__name__}: {error}", flush=True)
            failed += 1
            continue
        tolerance = TOLERANCE[CASES[case][1]]
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"]))
        ok = got["steps"] == want["steps"] == STEPS and worst <= tolerance
        failed += not ok
        results[case] = {"device": got, "reference": want, "worst": worst}
        print(f"device-parity {case}: {'ok' if ok else 'FAILED'}: {args.device} against {args.reference}, "
              f"{got['steps']} steps, worst loss rel. diff {worst:.1e} (tolerance {tolerance:.0e}); "
              f"{got['seconds']:.2f} s against {want['seconds']:.2f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"device-parity: {len(chosen)} cases, " + (f"{failed} failed" if failed else "all within tolerance"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
