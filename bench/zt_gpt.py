"""zerotrain's GPT (src/models/gpt.cpp) in PyTorch, for the runs that put DeepSpeed beside it.

Used by bench/deepspeed_offload.py (the peer benchmarks) and tests/oracle/deepspeed_oracle.py (the
numerical comparison with DeepSpeed). The architecture is zerotrain's: pre-LN GPT-2, learned
positions, tanh GELU, causal scaled-dot-product attention, biases everywhere, the output head tied
to the token embedding, cross-entropy in fp32 even when the weights are bf16. Module and parameter
names and their registration order are zerotrain's too (wte, wpe, blocks.N.{ln_1, attn.c_attn,
attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}, ln_f), so that a safetensors file written by
`zerotrain export` loads by name and DeepSpeed flattens the parameters in zerotrain's order.

Initialisation: GPT-2's recipe drawn in each module's reset_parameters (so that it also holds under
deepspeed.zero.Init, which partitions each module's parameters as soon as its constructor returns).
It is the same distribution as zerotrain's, not the same values: runs that must start from
zerotrain's weights load them (load_zerotrain_weights, load_hf_gpt2_weights).
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# vocab, context, layers, heads, width: the table in src/models/gpt.cpp, kept once in offload_common.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload_common import PRESETS  # noqa: E402


def parameter_count(preset):
    v, t, layers, _, c = PRESETS[preset]
    return v * c + t * c + layers * (12 * c * c + 13 * c) + 2 * c


def gpt2_linear(std):
    class Linear(nn.Linear):
        def reset_parameters(self):
            nn.init.normal_(self.weight, 0.0, std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    return Linear


class Embedding(nn.Embedding):
    def reset_parameters(self):
        nn.init.normal_(self.weight, 0.0, 0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, c, heads, layers):
        super().__init__()
        self.heads = heads
        self.c_attn = gpt2_linear(0.02)(c, 3 * c)
        self.c_proj = gpt2_linear(0.02 / math.sqrt(2.0 * layers))(c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        heads = lambda z: z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, c, layers):
        super().__init__()
        self.c_fc = gpt2_linear(0.02)(c, 4 * c)
        self.c_proj = gpt2_linear(0.02 / math.sqrt(2.0 * layers))(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, heads, layers):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c)
        self.attn = CausalSelfAttention(c, heads, layers)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = MLP(c, layers)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TiedHead(nn.Module):
    """The output projection; its weight is the token embedding's (assigned after construction)."""

    def forward(self, x):
        return F.linear(x, self.weight)


class GPT(nn.Module):
    def __init__(self, preset):
        super().__init__()
        v, t, layers, heads, c = PRESETS[preset]
        self.wte = Embedding(v, c)
        self.wpe = Embedding(t, c)
        self.blocks = nn.ModuleList([Block(c, heads, layers) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c)
        self.head = TiedHead()
        self.head.weight = self.wte.weight

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def load_named_weights(model, tensors, source):
    """Copies tensors (name -> tensor, zerotrain's names) into the model; every parameter must be given."""
    params = dict(model.named_parameters())  # the tied head.weight is wte.weight: listed once
    missing = sorted(set(params) - set(tensors))
    extra = sorted(set(tensors) - set(params))
    if missing or extra:
        raise ValueError(f"{source}: parameters do not match the model: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, p in params.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{source}: {name} has shape {tuple(t.shape)}, the model expects {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32}


def read_safetensors(path):
    """name -> tensor of a safetensors file (the format: u64 header length, JSON header, data)."""
    import json
    import struct

    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = memoryview(blob)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}, not one this reader knows")
        lo, hi = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[lo:hi]), dtype=_ST_DTYPES[info["dtype"]]) if hi > lo else \
            torch.empty(0, dtype=_ST_DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    return out


def load_zerotrain_weights(model, path):
    """Loads the safetensors file `zerotrain export CHECKPOINT --out FILE` writes (zerotrain's names)."""
    load_named_weights(model, read_safetensors(path), path)


# The Hugging Face GPT-2 names of zerotrain's parameters; the four Linear weights are stored as
# Conv1D ([in, out]), i.e. transposed.
_HF_BLOCK = {"ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
             "attn.c_attn.weight": "attn.c_attn.weight", "attn.c_attn.bias": "attn.c_attn.bias",
             "attn.c_proj.weight": "attn.c_proj.weight", "attn.c_proj.bias": "attn.c_proj.bias",
             "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
             "mlp.c_fc.weight": "mlp.c_fc.weight", "mlp.c_fc.bias": "mlp.c_fc.bias",
             "mlp.c_proj.weight": "mlp.c_proj.weight", "mlp.c_proj.bias": "mlp.c_proj.bias"}
_HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_to_zerotrain_names(hf):
    """Maps a Hugging Face GPT-2 state (transformer.* names, Conv1D weights) to zerotrain's names."""
    out = {}
    for name, t in hf.items():
        key = name[len("transformer."):] if name.startswith("transformer.") else name
        if key in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
            out[key] = t
        elif key.startswith("h."):
            layer, rest = key[2:].split(".", 1)
            if rest not in _HF_BLOCK:
                raise ValueError(f"unexpected Hugging Face GPT-2 tensor {name}")
            out[f"blocks.{layer}.{_HF_BLOCK[rest]}"] = t.t().contiguous() if rest in _HF_TRANSPOSED else t
        elif key == "lm_head.weight" or name == "lm_head.weight":
            continue  # tied to wte.weight
        elif key.endswith(".attn.bias") or key.endswith(".attn.masked_bias"):
            continue  # GPT-2's causal-mask buffers, not parameters
        else:
            raise ValueError(f"unexpected Hugging Face GPT-2 tensor {name}")
    return out


def load_hf_gpt2_weights(model, directory):
    """Loads a Hugging Face GPT-2 directory (`zerotrain export --init --format hf`): its safetensors
    files by transformer.* names, Conv1D weights transposed back."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{directory}: no safetensors file in the directory")
    hf = {}
    for f in files:
        hf.update(read_safetensors(os.path.join(directory, f)))
    load_named_weights(model, hf_to_zerotrain_names(hf), directory)
