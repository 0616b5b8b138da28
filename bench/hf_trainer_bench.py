"""One side of bench/hf_trainer_vs_deepspeed.sh, under torchrun: the Hugging Face Trainer training
a ~100M transformers Llama (8 layers x 768, vocabulary 32000, untied head: 106M parameters, seeded
weights) with a DeepSpeed configuration, on whichever `deepspeed` is installed (DeepSpeed 0.19.8, or
zerotrain's companion distribution). argv[1]: spec JSON (stage, bf16, steps, warmup, micro, seq);
argv[2]: where rank 0 writes the timed steps, the losses and every rank's peak RSS (VmHWM)."""
import json
import os
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers as tf  # noqa: E402


def vm_hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count, seq):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 32000, (count, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(tf.TrainerCallback):
    def __init__(self):
        self.started, self.times, self.losses = None, [], {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.started)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main():
    spec = json.loads(sys.argv[1])
    zero = {"stage": spec["stage"], "overlap_comm": False}
    if spec["stage"] == 3:
        zero.update({"stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto"})
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
          "bf16": {"enabled": "auto"}, "zero_optimization": zero, "steps_per_print": 1000}
    steps = spec["warmup"] + spec["steps"]
    args = tf.TrainingArguments(output_dir=spec["out_dir"], deepspeed=ds, per_device_train_batch_size=spec["micro"],
                                learning_rate=1e-4, max_steps=steps, logging_steps=1, save_strategy="no",
                                report_to=[], use_cpu=True, seed=0, data_seed=0, bf16=spec["bf16"],
                                dataloader_num_workers=0, disable_tqdm=True)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                               num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                                               max_position_embeddings=512, tie_word_embeddings=False))
    clock = Clock()
    trainer = tf.Trainer(model=model, args=args, train_dataset=Tokens(steps * spec["micro"] * 2, spec["seq"]),
                         callbacks=[clock])
    trainer.train()
    peak = torch.tensor([float(vm_hwm_bytes())])
    peaks = [torch.zeros(1) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(peaks, peak)
    if torch.distributed.get_rank() == 0:
        import deepspeed

        with open(sys.argv[2], "w") as f:
            json.dump({"times": clock.times[spec["warmup"]:], "losses": clock.losses, "deepspeed": deepspeed.__version__,
                       "peak_rss": [p.item() for p in peaks], "world": torch.distributed.get_world_size(),
                       "parameters": sum(p.numel() for p in model.parameters())}, f)
    # Both sides end here once the result is written: DeepSpeed 0.19.8 on the CPU may abort at
    # interpreter exit (tests/python/scripts/hf_trainer_run.py), which would lose nothing timed.
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
