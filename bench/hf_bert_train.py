"""The transformers side of bench/bert_vs_transformers.sh: BERT masked-language-model
pre-training as a PyTorch user would write it with Hugging Face transformers (pinned, from
scripts/python_deps.sh), on CPU ranks over Gloo with DistributedDataParallel.

  python3 bench/hf_bert_train.py --preset bert-base --micro-batch 8 --seq 128 --steps 6 \
      --warmup 2 --threads 1 --precision bf16 --world 2

Each rank builds BertForPreTraining (bert-base: 12 layers, 768, 12 heads, vocab 30522; with the
NSP head, as BERT was pre-trained) from the same seed, masks 15% of the tokens of random batches
(labels -100 elsewhere, as DataCollatorForLanguageModeling does) and steps torch.optim.AdamW.
bf16 runs the forward and backward under torch.autocast("cpu", torch.bfloat16), the usual
mixed precision of a CPU user. Prints one JSON line: tokens per second over the timed steps
(all ranks' tokens), the step time and each rank's peak RSS.
"""
import argparse
import json
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRESETS = {
    "bert-tiny": dict(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, max_position_embeddings=128),
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      intermediate_size=3072, max_position_embeddings=512),
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                       intermediate_size=4096, max_position_embeddings=512),
}


def rank_main(rank, args, port, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(1234)
    config = BertConfig(**PRESETS[args.preset], hidden_act="gelu", hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    model = BertForPreTraining(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    vocab, b, t = config.vocab_size, args.micro_batch, args.seq
    gen = torch.Generator().manual_seed(1000 + rank)
    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (b, t), generator=gen)
        labels = ids.clone()
        masked = torch.rand((b, t), generator=gen) < 0.15
        labels[~masked] = -100
        ids[masked] = vocab - 1  # the mask token's place (a speed benchmark: the value does not matter)
        nsp = torch.randint(0, 2, (b,), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            out = ddp(input_ids=ids, token_type_ids=(torch.arange(t) >= t // 2).long().expand(b, t),
                      labels=labels, next_sentence_label=nsp)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results[rank] = (sum(times), rss)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="bert-base", choices=sorted(PRESETS))
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    port = args.port
    if port == 0:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(rank_main, args=(args, port, results), nprocs=args.world, join=True)
    seconds = max(v[0] for v in results.values())
    tokens = args.world * args.micro_batch * args.seq * args.steps
    print(json.dumps({"program": "transformers", "transformers": __import__("transformers").__version__,
                      "torch": torch.__version__, "preset": args.preset, "precision": args.precision,
                      "tokens_per_second": tokens / seconds, "step_seconds": seconds / args.steps,
                      "peak_rss_bytes": [results[r][1] for r in sorted(results.keys())]}))


if __name__ == "__main__":
    main()
