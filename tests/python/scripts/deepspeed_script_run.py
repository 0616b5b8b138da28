"""A DeepSpeed script as people write them, run under `zerotrain launch --nproc 2`: it imports
deepspeed by name, defines --local_rank itself before add_config_arguments, joins with
deepspeed.init_distributed(), uses deepspeed.comm's collectives and point-to-point calls, trains at
stage 3 with an optimizer callable and a client scheduler, and saves the 16-bit model. Rank 0
writes what it saw as JSON (argv[2]); the spec (argv[1]) holds the save directory."""
import argparse
import json
import sys

import torch

import zerotrain

zerotrain.install_as_deepspeed()
import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402


def collectives(rank, world):
    seen = {}
    t = torch.full((2,), float(rank))
    if rank == 0:
        dist.send(t + 10, dst=1)
        dist.recv(t, src=1)
    else:
        got = torch.empty(2)
        dist.recv(got, src=0)
        dist.send(got + 1, dst=0)
    seen["send_recv"] = t.tolist()  # rank 0: what rank 1 sent back (10 + 1)
    peer = 1 - rank
    inbox = torch.empty(1)
    ops = [dist.P2POp(dist.isend, torch.tensor([100.0 + rank]), peer), dist.P2POp(dist.irecv, inbox, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    seen["batch_isend_irecv"] = inbox.item()
    gathered = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 0.5]), gathered, dst=0)
    seen["gather"] = [g.item() for g in gathered] if rank == 0 else None
    piece = torch.empty(1)
    dist.scatter(piece, [torch.tensor([7.0]), torch.tensor([8.0])] if rank == 0 else None, src=0)
    seen["scatter"] = piece.item()
    total = torch.tensor([rank + 1.0])
    dist.reduce(total, dst=0)
    seen["reduce"] = total.item()
    half = torch.empty(1)
    dist.reduce_scatter_tensor(half, torch.tensor([1.0, 2.0]) * (rank + 1))
    seen["reduce_scatter_tensor"] = half.item()
    objects = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    seen["all_gather_object"] = objects
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=1)
    seen["broadcast_object_list"] = box
    return seen


def main():
    spec = json.loads(sys.argv[1])
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed"])
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"collectives": collectives(rank, world)}

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_gather_16bit_weights_on_model_save": True}}
    engine, _, _, scheduler = deepspeed.initialize(
        args=args, model=model, config=config,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1000))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    result["local_rank"] = args.local_rank
    result["scheduler_steps"] = scheduler.last_epoch
    result["saved"] = engine.save_16bit_model(spec["save"])
    masters = {name: zerotrain.utils.safe_get_full_fp32_param(p) for name, p in model.named_parameters()}
    dist.barrier()
    if rank == 0:
        saved = torch.load(f"{spec['save']}/pytorch_model.bin", weights_only=True)
        result["keys"] = list(saved)
        result["want_keys"] = list(model.state_dict())
        result["equal"] = {name: bool(torch.equal(saved[name], value)) for name, value in masters.items()}
        result["elements"] = sum(t.numel() for t in saved.values())
        with open(sys.argv[2], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
