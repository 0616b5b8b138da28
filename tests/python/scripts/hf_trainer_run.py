"""The Hugging Face Trainer with a DeepSpeed configuration, as its users write it: a tiny model with
random weights (no hub), TrainingArguments(deepspeed=<file with "auto" values>), a warm-up
schedule, Trainer.train() and, when asked, a resume from the checkpoint it saved. The script never
names zerotrain: run it with DeepSpeed 0.19.8 installed, or with zerotrain's companion distribution
(python/deepspeed-companion) standing in for it, under torchrun on 2 ranks.

argv[1]: the spec as JSON (model, stage, offload, steps, save_steps, resume, out_dir);
argv[2]: where rank 0 writes its result (losses per step, learning rates, the weights' sum)."""
import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import transformers as tf  # noqa: E402

VOCAB, SEQ = 96, 16


def build(kind):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=False)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(cfg)


class Batches(torch.utils.data.Dataset):
    """Fixed random token sequences: the same on every rank and in every run."""

    def __init__(self, count):
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(tf.TrainerCallback):
    def __init__(self):
        self.losses, self.rates = {}, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            self.rates[state.global_step] = logs.get("learning_rate")


def deepspeed_config(spec):
    zero = {"stage": spec["stage"], "overlap_comm": False, "contiguous_gradients": True,
            "reduce_bucket_size": "auto"}
    if spec["stage"] == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    if spec.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if spec["stage"] == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    return {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": zero}


def main():
    spec = json.loads(sys.argv[1])
    out_dir = spec["out_dir"]
    os.makedirs(out_dir, exist_ok=True)
    ds_file = os.path.join(out_dir, "ds_config.json")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(ds_file + ".tmp", "w") as f:
            json.dump(deepspeed_config(spec), f)
        os.replace(ds_file + ".tmp", ds_file)
    else:
        import time
        while not os.path.exists(ds_file):
            time.sleep(0.05)
    args = tf.TrainingArguments(
        output_dir=out_dir, deepspeed=ds_file, per_device_train_batch_size=2,
        gradient_accumulation_steps=spec.get("accumulation", 1), learning_rate=1e-3, weight_decay=0.01,
        warmup_steps=3, max_steps=spec.get("steps", 10), logging_steps=1, save_steps=spec.get("save_steps", 5),
        save_strategy="steps", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, data_seed=0,
        max_grad_norm=1.0, dataloader_num_workers=0, disable_tqdm=True, save_only_model=False,
        gradient_checkpointing=spec.get("gradient_checkpointing", False))
    model = build(spec["model"])
    recorder = Losses()
    trainer = tf.Trainer(model=model, args=args, train_dataset=Batches(64), callbacks=[recorder])
    resume = spec.get("resume")
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, resume) if resume else None)
    engine = trainer.model_wrapped
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        total = float(sum(p.detach().double().sum() for p in model.parameters()))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(sys.argv[2], "w") as f:
            json.dump({"losses": recorder.losses, "rates": recorder.rates, "weight_sum": total,
                       "engine": type(engine).__module__ + "." + type(engine).__name__,
                       "deepspeed": deepspeed.__version__}, f, indent=1)
    if "+zerotrain" not in deepspeed.__version__:
        # DeepSpeed 0.19.8 on the CPU sometimes aborts at interpreter exit after a resumed run
        # ("terminate called without an active exception"), before rank 0 has written: both ranks
        # end here, together, once the result is on disk. zerotrain's runs exit normally.
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
