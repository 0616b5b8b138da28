"""A DeepSpeed script that creates torch.distributed's process group itself (env://, as many do
before deepspeed.initialize), run on 2 ranks under `zerotrain launch` or torchrun: its own
collective, then a stage-2 engine over the same job. Rank 0 writes what it saw as JSON (argv[2]);
argv[1] is the spec: {"leave_group": true} leaves the group alive at the end, as Accelerate on the
CPU does, and rank 0 then writes to argv[2] + ".exit" whether it was still alive after zerotrain's
exit handler had run, and how many engines still held the job's communicator then."""
import atexit
import json
import sys

import torch
import torch.distributed as dist


def _after_zerotrain_exit_handler():
    # Registered before zerotrain is imported, so it runs after zerotrain's own (last in, first out).
    if _SPEC.get("leave_group") and _RANK == 0:
        from zerotrain import _registry

        # An engine still holding the job's communicator keeps its Gloo threads running into
        # Python's teardown (where they can abort the process).
        holding = sum("_communicator" in engine.__dict__ for engine in list(_registry._engines))
        with open(sys.argv[2] + ".exit", "w") as f:
            json.dump({"group_alive_at_exit": dist.is_initialized(), "engines_holding_the_communicator": holding}, f)


_SPEC = json.loads(sys.argv[1])
_RANK = None
atexit.register(_after_zerotrain_exit_handler)

import zerotrain  # noqa: E402

zerotrain.install_as_deepspeed()
import deepspeed  # noqa: E402


def main():
    global _RANK
    dist.init_process_group("gloo")  # the script's own, before deepspeed.initialize
    rank, world = dist.get_rank(), dist.get_world_size()
    _RANK = rank
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 2}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # The engine's own collectives and the script's group serve the same job afterwards too.
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"world": world, "all_reduce": t.item(), "losses": losses, "summed": mean.tolist(),
                       "steps": engine.global_steps}, f)
    # The group the script made is the script's to destroy, as torch asks: left to the interpreter's
    # teardown, torch's Gloo worker can abort the process after a collective (docs/python.md), unless
    # zerotrain's exit handler ends it first.
    if not _SPEC.get("leave_group"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
