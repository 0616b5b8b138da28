"""Run under `zerotrain launch --nproc 2`: a script that names its checkpoint folder per rank (as one
naming it from each rank's clock does). save_checkpoint must refuse on every rank, before writing
anything, and then save normally once the ranks agree. Rank 0 writes what it saw as JSON (argv[2])."""
import json
import os
import sys

import torch

import zerotrain


def main():
    spec = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2}})
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    rank = zerotrain.comm.get_rank()
    seen = {}
    try:
        engine.save_checkpoint(os.path.join(spec["dir"], f"rank{rank}"))
    except ValueError as error:
        seen["refused"] = str(error)
    seen["written"] = sorted(os.listdir(spec["dir"])) if os.path.isdir(spec["dir"]) else []
    engine.save_checkpoint(os.path.join(spec["dir"], "shared"))
    seen["shared"] = sorted(os.listdir(os.path.join(spec["dir"], "shared")))
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    main()
