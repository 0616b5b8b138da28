"""The Python side of bench/llama_finetune.sh: a Llama-shaped model fine-tuned with ZeRO-3 and
offload by zerotrain's command line and by DeepSpeed, from the same Hugging Face directory, the
same jsonl file, the same tokenizer and the same DeepSpeed configuration file.

Subcommands:
  model --size tiny|1b --out DIR [--seed S]
      DIR/config.json + model.safetensors: transformers' LlamaForCausalLM with seeded random
      weights (fp32, save_pretrained), and DIR/tokenizer.json: a byte-level BPE trained here by
      `tokenizers` on synthetic text (nothing downloaded), its vocabulary within the model's
  data --out FILE [--examples N] [--seed S]
      a jsonl file of synthetic {"prompt", "response"} pairs
  config --out F --model-dir DIR --data FILE --seq T --steps K --run-dir R --nvme-dir D
         [--offload-optimizer nvme|cpu] [--offload-param cpu|nvme|none] [--threads N] [--set KEY=VALUE ...]
      the one configuration file both systems read: DeepSpeed's keys (ZeRO stage 3, bf16, AdamW,
      offload) and zerotrain's own blocks (model, data, train), which DeepSpeed's side ignores
  train --config F
      (under torch.distributed.run) DeepSpeed fine-tunes transformers' LlamaForCausalLM loaded
      from model.init_from on data.path; each rank prints
        DSBENCH step rank=R step=S seconds=T loss=L peak_rss_bytes=B
        DSBENCH summary rank=R world=W params=P steps=K peak_rss_bytes=B baseline_rss_bytes=B0
  params DIR
      the parameter count of DIR's config.json (tied head counted once)
  table RECORDS.jsonl
      the markdown table of the run's records (bench/offload_common.py record lines)
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
import warnings
from bench_util import set_path, status_bytes  # noqa: E402

GIB = 1024 ** 3
EOS = "<|end_of_text|>"

# The shape of zerotrain's llama-1b preset (src/config/llama_config.cpp: Llama 3.2 1B) and a tiny
# one of the same kind for a quick check.
SHAPES = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
               rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 256}),
}
TOKENIZER_VOCAB = {"1b": 4096, "tiny": 1024}

WORDS = ("the a of to and in is it that for on with as was by at from this be are or an have not which "
         "model data train step memory rank shard gradient optimizer state parameter layer weight token "
         "batch loss update disk host device compute time speed value table result system sample answer "
         "question river mountain city market garden window letter number colour music story friend").split()


def sentence(rng, lo, hi):
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def text_corpus(seed, n):
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(sentence(rng, 4, 16) for _ in range(rng.randint(1, 4)))


# ------------------------------------------------------------------------------------ model, data
def cmd_model(a):
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shape = SHAPES[a.size]
    os.makedirs(a.out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(TOKENIZER_VOCAB[a.size], shape["vocab_size"]),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS],
                                  show_progress=False)
    tok.train_from_iterator(text_corpus(a.seed, 20000), trainer)
    if tok.get_vocab_size() > shape["vocab_size"]:
        sys.exit(f"tokenizer vocabulary {tok.get_vocab_size()} exceeds the model's {shape['vocab_size']}")
    eos = tok.token_to_id(EOS)
    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    config = transformers.LlamaConfig(**shape, bos_token_id=eos, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(a.out)  # safetensors, fp32
    tok.save(os.path.join(a.out, "tokenizer.json"))
    print(f"model {a.size}: {n} parameters, tokenizer vocabulary {tok.get_vocab_size()}, saved to {a.out} "
          f"in {time.perf_counter() - t0:.0f} s")


def cmd_data(a):
    rng = random.Random(a.seed)
    with open(a.out, "w") as f:
        for i in range(a.examples):
            prompt = f"Question {i}: " + " ".join(sentence(rng, 5, 14) for _ in range(rng.randint(1, 3))) + "\nAnswer:"
            response = " " + " ".join(sentence(rng, 6, 18) for _ in range(rng.randint(2, 6)))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def parameter_count(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    H, L, I, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H
    return V * H * (1 if c.get("tie_word_embeddings", False) else 2) + L * layer + H


# ------------------------------------------------------------------------------------ config

def cmd_config(a):
    with open(os.path.join(a.model_dir, "config.json")) as f:
        hf = json.load(f)
    # Sub-groups of 2e7 parameters: the optimizer state goes to and from the disk in pieces of
    # that size (DeepSpeed's default, 1e9, holds a whole rank's fp32 state in memory at once).
    zero = {"stage": 3, "sub_group_size": 20_000_000,
            "offload_optimizer": {"device": a.offload_optimizer, "pin_memory": False}}
    if a.offload_optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = a.nvme_dir
    if a.offload_param != "none":
        # The parameter swap buffers must hold the largest tensor: the token embedding.
        zero["offload_param"] = {"device": a.offload_param, "pin_memory": False,
                                 "buffer_size": max(100_000_000, hf["vocab_size"] * hf["hidden_size"])}
        if a.offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = a.nvme_dir
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 1,
        "wall_clock_breakdown": False,
        "csv_monitor": {"enabled": True, "output_path": a.run_dir, "job_name": "zerotrain"},
        "model": {"type": "llama", "init_from": os.path.abspath(a.model_dir)},
        "data": {"source": "finetune", "path": os.path.abspath(a.data), "tokenizer": os.path.abspath(a.model_dir),
                 "eos_token": EOS, "sequence_length": a.seq},
        "train": {"steps": a.steps, "seed": 1234, "threads": a.threads, "log_dir": a.run_dir},
    }
    for s in a.set:
        key, sep, value = s.partition("=")
        if not sep:
            sys.exit(f"--set expects KEY=VALUE, found '{s}'")
        set_path(config, key, value)
    with open(a.out, "w") as f:
        json.dump(config, f, indent=1)


# ------------------------------------------------------------------------------------ train

def examples(path, tokenizer_dir, seq):
    """(ids, labels) rows of seq + 1 tokens as zerotrain builds them unpacked: the prompt (its
    template: none for this tokenizer), the response and the end token, cut to seq + 1, padded with
    id 0; labels -100 on the prompt and on the padding."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            ex = json.loads(line)
            p = tok.encode(ex["prompt"]).ids
            r = tok.encode(ex["response"], add_special_tokens=False).ids + [eos]
            ids = (p + r)[: seq + 1]
            labels = ([-100] * len(p) + r)[: seq + 1]
            pad = seq + 1 - len(ids)
            rows.append((ids + [0] * pad, labels + [-100] * pad))
    return rows


def emit(line):
    """One write per line: the ranks share the log, and print's separate writes could interleave."""
    os.write(1, (line + "\n").encode())


def cmd_train(a):
    warnings.filterwarnings("ignore")
    import torch
    import deepspeed
    import transformers

    with open(a.config) as f:
        config = json.load(f)
    # DeepSpeed gets its own keys; zerotrain's blocks and the CSV monitor (whose files would
    # mix with zerotrain's) stay out. Step times are taken here.
    ds_config = {k: v for k, v in config.items() if k not in ("model", "data", "train", "csv_monitor")}
    seq, steps, seed = config["data"]["sequence_length"], config["train"]["steps"], config["train"]["seed"]
    torch.set_num_threads(config["train"]["threads"])
    micro = config["train_micro_batch_size_per_gpu"]

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    baseline = status_bytes("VmRSS")
    rows = examples(config["data"]["path"], config["data"]["tokenizer"], seq)
    model_dir = config["model"]["init_from"]
    # Loaded whole on each rank in bf16 (the training precision; the file is fp32), then
    # partitioned by initialize, which builds the fp32 optimizer partitions from it. (Building it
    # under deepspeed.zero.Init through transformers' HfDeepSpeedConfig needs `accelerate`, which
    # the pinned Python set does not hold.)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    rng = random.Random(seed * 1000 + rank)
    torch.distributed.barrier()
    for step in range(1, steps + 1):
        batch = [rows[rng.randrange(len(rows))] for _ in range(micro)]
        ids = torch.tensor([b[0] for b in batch])
        labels = torch.tensor([b[1] for b in batch])
        t0 = time.perf_counter()
        # Inputs are the first seq tokens, targets the next ones (the shift done here), the mean
        # cross-entropy in fp32 over the response tokens, as zerotrain's loss.
        logits = engine(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        engine.backward(loss)
        engine.step()
        seconds = time.perf_counter() - t0
        emit(f"DSBENCH step rank={rank} step={step} seconds={seconds:.4f} loss={float(loss):.5f} "
             f"peak_rss_bytes={status_bytes('VmHWM')}")
    torch.distributed.barrier()
    emit(f"DSBENCH summary rank={rank} world={world} params={n_params} steps={steps} "
         f"peak_rss_bytes={status_bytes('VmHWM')} baseline_rss_bytes={baseline}")


# ------------------------------------------------------------------------------------ table
def cmd_table(a):
    recs = [json.loads(l) for l in open(a.records) if l.strip()]
    gib = lambda b: "–" if b is None else f"{b / GIB:.2f}"
    print("| model | parameters | system | s/step | peak RSS per rank (GiB) | peak process-tree PSS (GiB) "
          "| peak disk (GiB) | status |")
    print("|---|---|---|---|---|---|---|---|")
    for r in recs:
        ok = r["status"] == "ok"
        ranks = " / ".join(gib(b) for b in r.get("peak_rss_per_rank") or [] if b) or "–"
        if not ok and ranks != "–":
            ranks = "≥ " + ranks  # the last figure a rank printed before it stopped
        sps = f"{r['s_per_step']:.2f}" if ok and r.get("s_per_step") is not None else "–"
        s = r["status"]
        if s == "ok":
            status = "OK"
        elif s == "memory-cap":
            status = f"killed at the memory cap (process tree > {r.get('cap_gib', '?')} GiB)"
        elif s == "oom-kill":
            status = f"killed by the OOM killer ({r.get('detail', '')[:80]})"
        else:
            status = "error: " + (r.get("detail") or "")[:200].replace("|", "/").replace("`", "'")
        name = {"zerotrain": "zerotrain", "deepspeed": "DeepSpeed 0.19.8"}.get(r["system"], r["system"])
        print(f"| {r['model']} | {int(r['params']) / 1e6:.1f} M | {name} | {sps} | {ranks} "
              f"| {gib(r.get('peak_tree_memory_bytes'))} | {gib(r.get('peak_disk_bytes'))} | {status} |")
    print()
    if any(r["status"] != "ok" and r.get("peak_rss_per_rank") for r in recs):
        print("≥: a run that did not finish; its peak RSS per rank is the last one its ranks printed (after a step).")
        print()
    for r in recs:
        steps = r.get("step_seconds") or []
        losses = r.get("losses") or []
        if steps or losses:
            print(f"- {r['system']}: step times (s) {', '.join(f'{t:.2f}' for t in steps) or '–'}; "
                  f"losses {', '.join(f'{l:.4f}' for l in losses) or '–'}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("--size", choices=sorted(SHAPES), required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--seed", type=int, default=1234)
    d = sub.add_parser("data")
    d.add_argument("--out", required=True)
    d.add_argument("--examples", type=int, default=400)
    d.add_argument("--seed", type=int, default=7)
    c = sub.add_parser("config")
    for k in ("--out", "--model-dir", "--data", "--run-dir", "--nvme-dir"):
        c.add_argument(k, required=True)
    c.add_argument("--seq", type=int, required=True)
    c.add_argument("--steps", type=int, required=True)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--offload-optimizer", choices=["cpu", "nvme"], default="nvme")
    c.add_argument("--offload-param", choices=["none", "cpu", "nvme"], default="cpu")
    c.add_argument("--set", action="append", default=[])
    t = sub.add_parser("train")
    t.add_argument("--config", required=True)
    pc = sub.add_parser("params")
    pc.add_argument("dir")
    tb = sub.add_parser("table")
    tb.add_argument("records")
    a = p.parse_args()
    if a.cmd == "params":
        print(parameter_count(a.dir))
        return
    {"model": cmd_model, "data": cmd_data, "config": cmd_config, "train": cmd_train, "table": cmd_table}[a.cmd](a)


if __name__ == "__main__":
    main()
