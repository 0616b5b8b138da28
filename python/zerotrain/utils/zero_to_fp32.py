"""deepspeed.utils.zero_to_fp32 over zerotrain's checkpoints: the whole fp32 weights of a checkpoint
saved at any world size and ZeRO stage, as DeepSpeed's functions of the same names return and
write them. checkpoint_dir is the folder that holds `latest` and the tag folders (the Trainer's
checkpoint-N); tag defaults to the one `latest` names. The same command line as DeepSpeed's script:

    python -m zerotrain.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization] [-t TAG]

(every checkpoint folder also holds a zero_to_fp32.py that runs it). The tensors come out in the
order the model registered them: trained parameters, then frozen values (parameters without
gradient and floating-point buffers). A parameter tied to another (GPT-2's lm_head and wte) is
saved once, under the first name the model gives it, so its second name is not in the result;
load_state_dict(strict=False) then leaves the tie in place, as transformers' own loading does."""
import argparse
import collections
import json
import os
import re

import torch

from .. import _C


def _checkpoint(checkpoint_dir, tag):
    return _C.CheckpointModel(os.fspath(checkpoint_dir), "" if tag is None else str(tag))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The checkpoint's whole tensors, fp32, on the CPU, as an OrderedDict name -> tensor. lazy_mode
    is accepted for DeepSpeed's callers; the tensors are read eagerly (and .contiguous() on them is
    a no-op, as DeepSpeed's lazy entries expect)."""
    checkpoint = _checkpoint(checkpoint_dir, tag)
    state = collections.OrderedDict()
    for name in checkpoint.names():
        if exclude_frozen_parameters and checkpoint.frozen(name):
            continue
        state[name] = checkpoint.read(name)
    return state


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def _bytes(size):
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size: expected a size such as '5GB' or '500MB', found {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _dtype(dtype):
    named = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    found = named.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if found not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: expected float32, float16 or bfloat16, found {dtype!r}")
    return found


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Writes the checkpoint's weights into output_dir as transformers names them:
    model.safetensors (safe_serialization) or pytorch_model.bin, or shards of at most
    max_shard_size with their .index.json when larger."""
    dtype, limit = _dtype(dtype), _bytes(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state = collections.OrderedDict((k, v.to(dtype) if v.is_floating_point() else v) for k, v in state.items())
    shards, current, size = [], collections.OrderedDict(), 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = collections.OrderedDict(), 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    os.makedirs(output_dir, exist_ok=True)
    names = [f"{stem}.{ext}"] if len(shards) == 1 else [
        f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        path = os.path.join(output_dir, name)
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in shard.items()}, path + ".partial", metadata={"format": "pt"})
        else:
            torch.save(shard, path + ".partial")
        os.replace(path + ".partial", path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """convert_zero_checkpoint_to_state_dict in fp32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Moves model to the CPU, loads the checkpoint's fp32 weights into it and returns it (a tied
    parameter's second name is not in the checkpoint and keeps the tie)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name, p in model.named_parameters(remove_duplicate=False)} - set(
        name for name, _ in model.named_parameters())
    absent = [name for name in missing if name not in tied]
    if absent or unexpected:
        raise ValueError(f"load_state_dict_from_zero_checkpoint: {checkpoint_dir} does not fit the model "
                         f"(missing {absent[:5]}, unexpected {unexpected[:5]})")
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description="The whole fp32 weights of a zerotrain checkpoint, as DeepSpeed's "
                                     "zero_to_fp32.py writes them.")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holding 'latest'), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="where the state_dict files go")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                               args.safe_serialization, args.tag, args.exclude_frozen_parameters)


# What save_checkpoint writes beside the tag folders, as DeepSpeed copies its script there.
SCRIPT = '''#!/usr/bin/env python3
"""The whole fp32 weights of the zerotrain checkpoint in this folder:
    python zero_to_fp32.py . OUTPUT_DIR [--safe_serialization] [-t TAG]"""
from zerotrain.utils.zero_to_fp32 import main

if __name__ == "__main__":
    main()
'''


if __name__ == "__main__":
    main()
