"""Run under `zerotrain launch --nproc 2`: a small MLP trained with gradient_accumulation_steps 4,
the first three micro-steps of every window inside engine.no_sync() or not (argv), and the same
MLP trained by torch's AdamW on the mean loss over every rank's micro-batches of each window (what
DeepSpeed's no_sync leaves the result at stages 0 and 1: the window's gradients are reduced once,
on its last micro-step, whether or not the earlier ones ran inside no_sync). Rank 0 writes its
losses, the trained weights and how far they are from torch's as JSON."""
import contextlib
import copy
import json
import sys

import torch

import zerotrain

ACCUMULATION, STEPS, MICRO = 4, 3, 4


def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 1, generator=g)


def main():
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": dict({"stage": spec["stage"]}, **spec.get("zero", {}))}
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = zerotrain.comm.get_rank(), zerotrain.comm.get_world_size()
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            quiet = spec["no_sync"] and micro < ACCUMULATION - 1
            with engine.no_sync() if quiet else contextlib.nullcontext():
                x, y = batch(step, micro, rank)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        total = sum(torch.nn.functional.mse_loss(reference(x), y)
                    for x, y in (batch(step, m, r) for m in range(ACCUMULATION) for r in range(world)))
        (total / (ACCUMULATION * world)).backward()
        optimizer.step()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    # Every rank holds the same weights (the reduction reached all of them): their maximum and their
    # minimum over the ranks are equal.
    c = zerotrain.comm.communicator()
    high, low = got.clone(), -got
    c.all_reduce(high, "max")
    c.all_reduce(low, "max")
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"losses": losses, "weights": got.tolist(), "ranks_agree": torch.equal(high, -low),
                       "max_diff_from_torch": float((got - want).abs().max()), "steps": engine.global_steps}, f)


if __name__ == "__main__":
    main()
