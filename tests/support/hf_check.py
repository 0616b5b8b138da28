"""The transformers side of tests/hf_test.cpp (run with the pinned transformers of
scripts/python_deps.sh on PYTHONPATH; nothing is downloaded).

  make-models OUT
      one randomly initialised tiny GPT2LMHeadModel saved with save_pretrained (safetensors) as
      OUT/fp32, OUT/sharded (30 kB shards), OUT/bf16 and OUT/fp16
  logits REFERENCE HF_DIR...
      loads each HF_DIR with GPT2LMHeadModel.from_pretrained and compares its logits on the tokens
      of REFERENCE (a safetensors file with "tokens" and zerotrain's "logits") within 1e-5
  bert-logits REFERENCE HF_DIR...
      loads each HF_DIR with BertForPreTraining (or BertForMaskedLM, as its config.json names)
      and compares its MLM logits at every position, and its NSP logits when it has the head, on
      REFERENCE's "input_ids", "token_type_ids" and "attention_mask" with zerotrain's
      "mlm_logits" (and "nsp_logits") within 1e-5
  loss TOKENS_BIN SEED SEQ MICRO WORLD HF_DIR...
      transformers' loss on the batch of zerotrain's first step (its sampler: SplitMix64 over
      (seed, step, sample)), averaged over the ranks as the trainer does, for each HF_DIR
(one process per command: importing transformers takes seconds)
"""
import json
import sys

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import BertForMaskedLM, BertForPreTraining, GPT2Config, GPT2LMHeadModel

TINY = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
M = (1 << 64) - 1


def mix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M
    return x ^ (x >> 31)


def make_models(argv):
    out = argv[0]
    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    model.save_pretrained(out + "/fp32", safe_serialization=True)
    model.save_pretrained(out + "/sharded", safe_serialization=True, max_shard_size="30KB")
    model.to(torch.bfloat16).save_pretrained(out + "/bf16", safe_serialization=True)
    model.to(torch.float16).save_pretrained(out + "/fp16", safe_serialization=True)
    print("saved", out)


def logits(argv):
    ref = load_file(argv[0])
    for hf_dir in argv[1:]:
        model = GPT2LMHeadModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
        assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "head not tied"
        with torch.no_grad():
            out = model(ref["tokens"].long()).logits
        diff = (out - ref["logits"]).abs().max().item()
        print(f"{hf_dir}: max_abs_diff {diff:.3e}")
        assert diff <= 1e-5, diff


def bert_logits(argv):
    ref = load_file(argv[0])
    for hf_dir in argv[1:]:
        with open(hf_dir + "/config.json") as f:
            pretraining = json.load(f)["architectures"] == ["BertForPreTraining"]
        cls = BertForPreTraining if pretraining else BertForMaskedLM
        model = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
        decoder = model.cls.predictions.decoder.weight
        assert decoder.data_ptr() == model.bert.embeddings.word_embeddings.weight.data_ptr(), "decoder not tied"
        with torch.no_grad():
            out = model(input_ids=ref["input_ids"].long(), token_type_ids=ref["token_type_ids"].long(),
                        attention_mask=ref["attention_mask"].long())
        mlm = out.prediction_logits if pretraining else out.logits
        diff = (mlm - ref["mlm_logits"]).abs().max().item()
        print(f"{hf_dir}: mlm max_abs_diff {diff:.3e}")
        assert diff <= 1e-5, diff
        assert pretraining == ("nsp_logits" in ref), "the NSP head is exported exactly when the model has it"
        if pretraining:
            nsp_diff = (out.seq_relationship_logits - ref["nsp_logits"]).abs().max().item()
            print(f"{hf_dir}: nsp max_abs_diff {nsp_diff:.3e}")
            assert nsp_diff <= 1e-5, nsp_diff


def loss(argv, load=GPT2LMHeadModel.from_pretrained):
    """The loss on the batch of zerotrain's first step for each HF_DIR in argv[5:], the model read
    by `load` (tests/support/llama_hf_check.py passes transformers' AutoModelForCausalLM)."""
    tokens_bin = argv[0]
    seed, seq, micro, world = (int(v) for v in argv[1:5])
    tokens = np.fromfile(tokens_bin, dtype=np.uint16).astype(np.int64)
    for hf_dir in argv[5:]:
        model = load(hf_dir, dtype=torch.float32).eval()
        losses = []
        for rank in range(world):
            starts = [mix64(mix64(mix64(seed) ^ 0) ^ (rank * micro + i)) % (len(tokens) - seq) for i in range(micro)]
            x = torch.tensor(np.stack([tokens[s:s + seq] for s in starts]))
            y = torch.tensor(np.stack([tokens[s + 1:s + seq + 1] for s in starts]))
            with torch.no_grad():
                out = model(x).logits
            losses.append(torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1)).item())
        print(f"loss {hf_dir} {sum(losses) / world:.10f}")


if __name__ == "__main__":
    {"make-models": make_models, "logits": logits, "bert-logits": bert_logits, "loss": loss}[sys.argv[1]](sys.argv[2:])
