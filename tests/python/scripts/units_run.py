"""Run under `zerotrain launch --nproc 2`: trains a small module with a tied embedding/head, norms,
a container with a parameter of its own and activation checkpointing, at the stage and settings
given in argv, and writes rank 0's losses and the engine's stage-3 counters as JSON."""
import json
import sys

import torch

import zerotrain


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x, scale=0.5):
        return x + scale * self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, vocab=64, d=32, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.gate = torch.nn.Parameter(torch.ones(d))  # the container's own parameter: kept whole
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.checkpointing = False

    def forward(self, ids, targets):
        x = self.embed(ids) * self.gate
        for block in self.blocks:
            if self.checkpointing:
                x = zerotrain.checkpointing.checkpoint(block, x)
            else:
                x = block(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main():
    spec = json.loads(sys.argv[1])
    out = sys.argv[2]
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "zero_optimization": dict({"stage": spec["stage"], "stage3_param_persistence_threshold": 0},
                                        **spec.get("zero", {}))}
    config.update(spec.get("extra", {}))
    torch.manual_seed(0)
    if spec.get("zero_init"):
        with zerotrain.zero.Init(config_dict_or_path=config):
            model = Net()
    else:
        model = Net()
    if spec.get("leaf_classes"):  # DeepSpeed's utility, the other way to name leaves
        zerotrain.utils.set_z3_leaf_modules(model, [{"Block": Block}[c] for c in spec["leaf_classes"]])
    model.checkpointing = spec.get("checkpointing", False)
    zerotrain.comm.init_distributed()
    rank = zerotrain.comm.get_rank()
    # Set by rank 0 before the engine exists (other ranks write something else, which must not win).
    with zerotrain.zero.GatheredParameters([model.blocks[0].up.weight], modifier_rank=0), torch.no_grad():
        model.blocks[0].up.weight.mul_(0.5 if rank == 0 else -7.0)
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(100 + rank)
    losses, gathers = [], []
    for step in range(4):
        if step == 2:  # set by rank 0 between steps, at any stage
            with zerotrain.zero.GatheredParameters([model.blocks[1].down.bias, model.norm.weight], modifier_rank=0), \
                    torch.no_grad():
                model.blocks[1].down.bias.fill_(0.25 if rank == 0 else 9.0)
                model.norm.weight.mul_(1.5 if rank == 0 else 0.0)
            seen = torch.tensor([float(zerotrain.utils.safe_get_full_fp32_param(model.blocks[1].down.bias).sum()),
                                 float(zerotrain.utils.safe_get_full_fp32_param(model.norm.weight).sum()),
                                 float(zerotrain.utils.safe_get_full_fp32_param(model.blocks[0].up.weight).sum())])
            every_rank = [torch.zeros(3) for _ in range(zerotrain.comm.get_world_size())]
            torch.distributed.all_gather(every_rank, seen)
        before = engine._engine.diagnostics()["block_gathers"]
        total = 0.0
        for micro in range(2):
            ids = torch.randint(0, 64, (2, 12), generator=g)
            loss = engine(ids, torch.roll(ids, -1, 1))
            engine.backward(loss)
            engine.step()
            total += float(loss)
        gathers.append(engine._engine.diagnostics()["block_gathers"] - before)  # the step's forward and backward passes
        mean = torch.tensor([total / 2])
        zerotrain.comm.all_reduce(mean)
        losses.append(float(mean) / zerotrain.comm.get_world_size())
    with torch.no_grad():
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
        eval_loss = float(engine(ids, torch.roll(ids, -1, 1)))
    head = zerotrain.utils.safe_get_full_fp32_param(model.head.weight)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"modified": [t.tolist() for t in every_rank], "losses": losses, "eval_loss": eval_loss, "head_norm": float(head.norm()),
                       "block_gathers": gathers,
                       "peak_gathered_bytes": engine._engine.diagnostics()["peak_gathered_parameter_bytes"],
                       "trainable_bytes": 4 * sum(p.numel() for p in model.parameters())}, f)


if __name__ == "__main__":
    main()
