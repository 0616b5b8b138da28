"""DeepSpeed's public Python surface (data/deepspeed_surface.txt: what transformers 5.24 reaches and
DeepSpeed 0.19.8's public modules and engine methods) resolves after install_as_deepspeed(): each
name is zerotrain's implementation, or a name that, called, raises zerotrain.NotSupportedError
with one sentence naming it. Never an ImportError or AttributeError on the way."""
import importlib
import os
import re
import types

import pytest
import torch

import zerotrain
from zerotrain import _unsupported

deepspeed = zerotrain.install_as_deepspeed()

SURFACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed_surface.txt")


def entries():
    with open(SURFACE) as f:
        for number, line in enumerate(f, 1):
            if line.strip() and not line.startswith("#"):
                name, status, source = line.split(None, 2)
                yield number, name, status, source.strip()


def resolve(name):
    """The object NAME stands for, found as a script finds it: `import deepspeed.a.b`, then attributes."""
    if name.startswith("DeepSpeedEngine."):
        return getattr(deepspeed.DeepSpeedEngine, name.split(".", 1)[1])
    if name.startswith("accelerator."):
        return getattr(deepspeed.get_accelerator(), name.split(".", 1)[1])
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ModuleNotFoundError:
            if i == 1:
                raise
    for part in parts[i:]:
        obj = getattr(obj, part)
    return obj


def problem(name, status):
    """What is wrong with NAME against its STATUS, or None."""
    if status not in ("works", "not-supported"):
        return f"unknown status {status!r}"
    try:
        obj = resolve(name)
    except (ImportError, AttributeError) as e:
        return f"does not resolve: {type(e).__name__}: {e}"
    if status == "works":
        return "listed as working but is not supported" if _unsupported.is_not_supported(obj) else None
    if not _unsupported.is_not_supported(obj):
        return f"listed as not supported but resolves to {obj!r}"
    if isinstance(obj, types.ModuleType):  # a subsystem zerotrain has no part of: any name in it
        obj, name = obj.AnyName, name + ".AnyName"
    try:
        obj(None, 1, key="value")
    except zerotrain.NotSupportedError as e:
        text = str(e)
    else:
        return "calling it raised nothing"
    last = re.escape(name.rsplit(".", 1)[1])
    if not re.match(rf"^\S*\b{last} is not supported by zerotrain\b", text):
        return f"the error does not name it as not supported: {text}"
    if re.search(r"[.!?] [A-Z]", text):
        return f"more than one sentence: {text}"
    return None


def test_every_name_resolves_as_listed():
    listed = list(entries())
    assert len(listed) > 500
    problems = [f"line {number}: {name} ({source}): {why}" for number, name, status, source in listed
                if (why := problem(name, status)) is not None]
    assert not problems, "\n".join(problems)
    assert issubclass(zerotrain.NotSupportedError, NotImplementedError)


def test_the_engines_attributes_scripts_read():
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    assert (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps) == (1, 2, 1, 0)
    assert (engine.world_size, engine.global_rank) == (1, 0)
    assert engine.module is model and engine.lr_scheduler is None and engine.training_dataloader is None
    assert engine.config == config and engine.optimizer.param_groups[0]["lr"] == 1e-3


def test_a_name_not_in_deepspeed_is_still_an_attribute_error():
    with pytest.raises(AttributeError):
        deepspeed.no_such_name
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("deepspeed.no_such_module")
