"""Run under `zerotrain launch --nproc 2`: two backward() calls before one step() with
gradient_accumulation_steps 1 (DeepSpeed's GAN example does it on its discriminator), at the
stages of argv. A 2-element weight at zero, plain SGD with lr 0.1: the first loss has the gradient
[1, 1] on every rank, the second [2, 0] on rank 0 and [0, 2] on rank 1 (mean [1, 1]). Rank 0
writes, per case, the weight change or the error's message as JSON."""
import json
import sys

import torch

import zerotrain


def case(stage, zero):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": dict({"stage": stage}, **zero)}
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = zerotrain.comm.get_rank()
    second = torch.tensor([[2.0, 0.0]]) if rank == 0 else torch.tensor([[0.0, 2.0]])
    try:
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.backward(engine(second).sum())
        engine.step()
        return {"change": model.weight.detach().reshape(-1).tolist(), "steps": engine.global_steps}
    except zerotrain.EngineError as e:
        return {"error": str(e)}
    finally:
        engine.destroy()


def main():
    spec = json.loads(sys.argv[1])
    out = {f"{stage}{'-overlap' if overlap else ''}": case(stage, {"overlap_comm": True} if overlap else {})
           for stage, overlap in spec["cases"]}
    if zerotrain.comm.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
