"""transformers' side of tests/llama_test.cpp: builds a tiny LlamaForCausalLM (or Qwen2ForCausalLM)
with random weights from a seed (no hub), runs it on random ids and writes, with torch.save, a dict
the C++ test reads with torch::pickle_load: the parameters by name (the tied head listed once, as
named_parameters gives it), the ids, the logits and the loss transformers computes with labels=ids.

usage: llama_oracle.py OUT.pt SPEC_JSON
SPEC_JSON: {"class": "llama"|"qwen2", "config": {...transformers config kwargs...}, "batch": B, "seq": T}
"""
import json
import sys

import torch
import transformers as tf


def main():
    out, spec = sys.argv[1], json.loads(sys.argv[2])
    torch.manual_seed(0)
    config_class, model_class = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                                 "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}[spec["class"]]
    model = model_class(config_class(**spec["config"])).eval()
    # transformers' own initialisation leaves the norms at one; random norm weights make a
    # mistake in where they apply visible.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), generator=g)
    with torch.no_grad():
        result = model(input_ids=ids, labels=ids)
    state = {name: p.detach().clone().contiguous() for name, p in model.named_parameters()}
    torch.save({"state": state, "ids": ids, "logits": result.logits.float().contiguous(),
                "loss": result.loss.detach().float().reshape(1)}, out)


if __name__ == "__main__":
    main()
