"""zerotrain's reference models for Python scripts: the same C++ modules the command line trains,
so that a Python loop over them computes what `zerotrain train` computes, bit for bit.

    model = zerotrain.models.GPT(config)           # config: the command line's configuration
    engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    loss = engine(inputs, targets)                 # the GPT's loss (fp32 cross-entropy)
"""
import json
import os

import torch

from . import _C, comm


class GPT(torch.nn.Module):
    """The reference GPT (its preset and sizes from the configuration's model block), built as the
    command line builds it: seeded with train.seed, and born sharded when the stage shards
    parameters. Its parameters are the C++ module's tensors; the engine takes the C++ module as it
    is (its blocks are the stage-3 units)."""

    def __init__(self, config):
        super().__init__()
        if isinstance(config, (str, os.PathLike)):
            with open(config) as f:
                config = json.load(f)
        comm.init_distributed()
        c = comm.communicator()
        object.__setattr__(self, "cpp_module", _C.build_gpt(json.dumps(config), c.rank, c.world_size))

    def forward(self, idx, targets):
        return _C.gpt_loss(self.cpp_module, idx, targets)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, p in _C.module_named_parameters(self.cpp_module):
            yield (prefix + "." + name if prefix else name), p

    def parameters(self, recurse=True):
        for _, p in self.named_parameters():
            yield p

    def train(self, mode=True):
        _C.module_train(self.cpp_module, mode)
        return super().train(mode)
