"""Run under `zerotrain launch --nproc 2`: a tied embedding and head built under zero.Init, the
embedding then replaced as transformers' resize_token_embeddings replaces it under ZeRO-3 (a new
embedding, the old rows copied inside GatheredParameters, the head tied again, or left on the old
weight), the old module collected, its weight read again inside GatheredParameters, then the model
trained at stage 3. The same steps on the model built without Init, trained by torch's AdamW, are
the reference. Rank 0 writes what it saw as JSON."""
import contextlib
import copy
import gc
import json
import sys

import torch

import zerotrain

VOCAB, DIM = 32, 8


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.mid = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def build(spec, config, under_init):
    torch.manual_seed(0)
    init = (lambda: zerotrain.zero.Init(config_dict_or_path=config)) if under_init else contextlib.nullcontext
    with init():
        model = Tied()
    old_weight = model.emb.weight
    with init():
        new = torch.nn.Embedding(spec["vocab"], DIM)
    rows = min(spec["vocab"], VOCAB)
    with zerotrain.zero.GatheredParameters([old_weight, new.weight], modifier_rank=0):
        with torch.no_grad():
            new.weight[:rows] = old_weight[:rows]
    model.emb = new
    if spec["retie"]:
        model.head.weight = new.weight
    gc.collect()  # the old embedding module is gone; its weight lives on
    with zerotrain.zero.GatheredParameters([old_weight]):
        old_values = old_weight.detach().clone()
    return model, old_weight, old_values


def main():
    spec = json.loads(sys.argv[1])
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    model, old_weight, old_values = build(spec, config, under_init=True)
    reference, _, reference_old = build(spec, config, under_init=False)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    rank = zerotrain.comm.get_rank()
    losses, want = [], []
    out = spec["vocab"] if spec["retie"] else VOCAB  # the head's rows: the new embedding's, or still the old one's
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, min(spec["vocab"], VOCAB), (4, 5), generator=g)
        target = torch.randint(0, out, (4 * 5,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(idx).reshape(-1, out), target)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        optimizer.zero_grad()
        ref = torch.nn.functional.cross_entropy(reference(idx).reshape(-1, out), target)
        ref.backward()
        optimizer.step()
        want.append(ref.item())
    # The losses are the mean over both ranks' identical batches: the same as the reference's.
    if rank == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"old_weight_equal": torch.equal(old_values, reference_old), "losses": losses, "want": want,
                       "old_is_released": type(old_weight).__name__}, f)


if __name__ == "__main__":
    main()
