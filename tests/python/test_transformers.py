"""Hugging Face transformers models, unchanged, through the Python front end: tiny configurations
with random weights (no hub access). Needs transformers (scripts/python_deps.sh); skipped, with the
reason, when it could not be installed."""
import os
import subprocess

import pytest

import launching

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/python_deps.sh)")

RELEASING = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1000}  # see test_stage3.py


def launch(tmp_path, name, spec):
    return launching.launch(tmp_path, "hf_run.py", name, spec)


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_models_train_at_stage_3_as_at_stage_0(tmp_path, model):
    reference, _ = launch(tmp_path, "s0", {"model": model, "stage": 0})
    got, stderr = launch(tmp_path, "s3", {"model": model, "stage": 3, "zero": RELEASING})
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert 0 < got["peak_gathered_bytes"] < got["trainable_bytes"] / 2
    assert "units sharded" in stderr


@pytest.mark.parametrize("model", ["gpt2", "llama", "deep_init"])
def test_models_built_under_zero_init_get_their_own_weights_and_train_as_built_outside(tmp_path, model):
    reference, _ = launch(tmp_path, "outside", {"model": model, "stage": 3, "zero": RELEASING})
    got, _ = launch(tmp_path, "init", {"model": model, "stage": 3, "zero": RELEASING, "zero_init": True})
    assert got["init"]["sharded"] > 0  # built sharded
    # post_init's weights, bit for bit those of the model built without Init under the same seed.
    assert got["init"]["differ"] == []
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_llama_stage_3_on_nvme_with_checkpointing_equals_stage_0_in_memory(tmp_path):
    reference, _ = launch(tmp_path, "s0", {"model": "llama", "stage": 0})
    swap = tmp_path / "swap"
    swap.mkdir()
    swap = str(swap)
    got, stderr = launch(tmp_path, "s3", {"model": "llama", "stage": 3, "checkpointing": True, "zero": dict(
        RELEASING, offload_optimizer={"device": "nvme", "nvme_path": swap},
        offload_param={"device": "nvme", "nvme_path": swap})})
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert 0 < got["peak_gathered_bytes"] < got["trainable_bytes"] / 2


def test_a_checkpoint_saved_from_python_exports_to_a_model_transformers_loads(tmp_path):
    import torch

    save = tmp_path / "ckpt"
    launch(tmp_path, "save", {"model": "gpt2", "stage": 3, "zero": RELEASING, "save": str(save)})
    hf = tmp_path / "hf"
    hf.mkdir()
    subprocess.run([os.environ["ZT_BIN"], "export", str(save), "--out", str(hf / "model.safetensors")], check=True,
                   capture_output=True)
    (hf / "config.json").write_text((save / "config.json").read_text())
    model = transformers.GPT2LMHeadModel.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).reshape(1, 16) % 96).logits
    want = torch.load(save / "logits.pt")
    assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5), (logits - want).abs().max()
