"""An Accelerate training loop as its users write it, run by `accelerate launch` with a DeepSpeed
configuration (argv[1]: the spec as JSON: model, stage; argv[2]: where rank 0 writes its losses). A
torch AdamW and a transformers warm-up schedule are handed to accelerator.prepare(), which gives them
to deepspeed.initialize(); the script never names zerotrain or DeepSpeed."""
import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as tf  # noqa: E402
from accelerate import Accelerator  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer_run import Batches, build  # noqa: E402


def main():
    spec = json.loads(sys.argv[1])
    accelerator = Accelerator()
    model = build(spec["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if spec.get("schedule", "linear") == "linear":
        scheduler = tf.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=10)
    else:
        scheduler = tf.get_constant_schedule(optimizer)
    loader = torch.utils.data.DataLoader(Batches(40), batch_size=2, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses, rates = [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        # The mean over ranks through torch.distributed: accelerator.gather() on the CPU under a
        # DeepSpeed plugin sizes its output for one process (Accelerate 1.16, with DeepSpeed as well).
        mean = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / torch.distributed.get_world_size())
        rates.append([scheduler.get_last_lr()[0], model.get_lr()[0]])
    if accelerator.is_main_process:
        import deepspeed

        with open(sys.argv[2], "w") as f:
            json.dump({"losses": losses, "rates": rates, "deepspeed": deepspeed.__version__,
                       "engine": type(model).__module__ + "." + type(model).__name__}, f, indent=1)


if __name__ == "__main__":
    main()
