#!/usr/bin/env python3
"""The transformers side of tests/tokenized_data_test.cpp's fine-tuning losses (run with the pinned
transformers of scripts/python_deps.sh on PYTHONPATH; nothing is downloaded).

  finetune_loss_oracle.py HF_DIR CASE_JSON
      CASE_JSON: {"examples": [{"input_ids": [...], "labels": [...]}...], "batches": [[example
      index per row]...], "losses": [zerotrain's loss per batch], "seq_len": T, "class": "gpt2"
      (default) or "llama"}. For each batch, GPT2LMHeadModel (or LlamaForCausalLM)
      .from_pretrained(HF_DIR) is given the examples' first T + 1 ids, one example per row padded
      with 0 after its end, and their labels (-100 on the prompt, as the examples give them, and
      on the padding); its loss (the mean over the labelled tokens) must equal zerotrain's within
      1e-5. zerotrain's batch may hold these examples one per row or packed several to a row: the
      loss counts each response token once either way.
"""
import json
import sys

import torch
from transformers import GPT2LMHeadModel, LlamaForCausalLM


def main(hf_dir, case_path):
    with open(case_path) as f:
        case = json.load(f)
    model_class = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}[case.get("class", "gpt2")]
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    width = case["seq_len"] + 1
    for k, (rows, ours) in enumerate(zip(case["batches"], case["losses"])):
        ids, labels = [], []
        for i in rows:
            example = case["examples"][i]
            row_ids = example["input_ids"][:width]
            row_labels = example["labels"][:width]
            pad = width - len(row_ids)
            ids.append(row_ids + [0] * pad)
            labels.append(row_labels + [-100] * pad)
        with torch.no_grad():
            loss = model(torch.tensor(ids), labels=torch.tensor(labels)).loss.item()
        print(f"batch {k}: zerotrain {ours:.6f} transformers {loss:.6f}")
        assert abs(loss - ours) <= 1e-5, (k, loss, ours)


if __name__ == "__main__":
    main(*sys.argv[1:])
