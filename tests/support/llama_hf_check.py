"""transformers' side of tests/hf_llama_test.cpp (Llama-family directories in and out).

usage:
  make OUT
      saves tiny random models with save_pretrained (safetensors, fp32) into OUT/llama (a
      LlamaForCausalLM: grouped-query attention, an explicit head_dim, Llama 3 rope scaling, untied
      head), OUT/llama-sharded (the same model in shards with an index) and OUT/qwen2 (a
      Qwen2ForCausalLM: q/k/v biases, tied head); norm weights random so that a misplaced norm shows
  loss TOKENS_BIN SEED SEQ MICRO WORLD HF_DIR...
      transformers' loss on the batch of zerotrain's first step (its sampler: SplitMix64 over
      (seed, step, sample)), averaged over the ranks as the trainer does, for each HF_DIR
  same A B
      the tensors of A's and B's safetensors files (one file or an index's shards): the same names,
      and bitwise the same values and dtypes
  tokenizer DIR...
      writes DIR/tokenizer.json for each DIR: a byte-level BPE tokenizer trained by `tokenizers` to
      the 256 ids of the tiny models' vocabulary (the byte alphabet, no merges, no special tokens)
  generate HF_DIR N TEXT
      greedy generate() of N new tokens after TEXT (encoded by HF_DIR's tokenizer.json): prints
      "prompt IDS" and "new IDS"
  logits REFERENCE HF_DIR
      the logits of HF_DIR's model (AutoModelForCausalLM) on REFERENCE's tokens against
      REFERENCE's logits (a safetensors file): within 1e-5
Several commands may follow each other, separated by "--" (importing transformers takes seconds).
"""
import json
import os
import sys

import torch
import transformers as tf
from safetensors.torch import load_file

import hf_check  # the first-step loss of zerotrain's sampler, shared with the GPT-2 checks

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def randomise_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)


def make(argv):
    out = argv[0]
    torch.manual_seed(11)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(
        **SHAPE, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    randomise_norms(llama)
    llama.save_pretrained(out + "/llama")
    llama.save_pretrained(out + "/llama-sharded", max_shard_size="40KB")
    qwen2 = tf.Qwen2ForCausalLM(tf.Qwen2Config(**SHAPE, tie_word_embeddings=True,
                                               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))
    randomise_norms(qwen2)
    qwen2.save_pretrained(out + "/qwen2")
    print("made", out)


def loss(argv):
    hf_check.loss(argv, load=tf.AutoModelForCausalLM.from_pretrained)


def tensors_of(hf_dir):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(hf_dir, f)))
    return out


def same(argv):
    a, b = tensors_of(argv[0]), tensors_of(argv[1])
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{name}: {a[name].dtype} vs {b[name].dtype}"
        assert torch.equal(a[name], b[name]), f"{name} differs"
    print(f"same {argv[0]} {argv[1]} {len(a)} tensors")


def logits(argv):
    ref = load_file(argv[0])
    model = tf.AutoModelForCausalLM.from_pretrained(argv[1], dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ref["tokens"].long()).logits
    diff = (out - ref["logits"]).abs().max().item()
    print(f"{argv[1]}: {type(model).__name__} max_abs_diff {diff:.3e}")
    assert diff <= 1e-5, diff


def tokenizer(argv):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    for out in argv:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=[], show_progress=False)
        tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"], trainer)
        assert tok.get_vocab_size() == 256, tok.get_vocab_size()
        tok.save(os.path.join(out, "tokenizer.json"))


def generate(argv):
    from tokenizers import Tokenizer

    hf_dir, n, text = argv[0], int(argv[1]), argv[2]
    ids = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json")).encode(text).ids
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.generation_config.eos_token_id)
    print("prompt", *ids)
    print("new", *out[0, len(ids):].tolist())


if __name__ == "__main__":
    commands = {"make": make, "loss": loss, "same": same, "logits": logits, "tokenizer": tokenizer,
                "generate": generate}
    args = sys.argv[1:]
    while args:
        end = args.index("--") if "--" in args else len(args)
        commands[args[0]](args[1:end])
        args = args[end + 1:]
