"""The Python package on a device: the script the GPU check runs (tests/python/scripts/device_parity.py,
scripts/gpu-check.sh phase "python") run here on the CPU against the CPU, so that it is known to
work before a GPU machine runs it; and what a CPU build says of a module on another device."""
import os
import subprocess
import sys

import pytest
import torch

import zerotrain

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "device_parity.py")


def test_the_gpu_checks_python_phase_runs_every_case_here_on_the_cpu():
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--reference", "cpu"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("device-parity ")]
    assert len(lines) == 8 and all(": ok: cpu against cpu, 6 steps, worst loss rel. diff 0.0e+00" in line
                                   for line in lines), done.stdout
    assert done.stdout.rstrip().endswith("device-parity: 8 cases, all within tolerance")


def test_the_devices_trained_on_follow_the_build_and_another_is_refused_by_name():
    built_with_cuda = zerotrain._C.built_with_cuda()
    assert zerotrain.engine.TRAINING_DEVICE_TYPES == (("cpu", "cuda") if built_with_cuda else ("cpu",))
    model = torch.nn.Linear(4, 4, device="meta")
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    trains_on = "cpu or cuda" if built_with_cuda else "cpu"
    with pytest.raises(ValueError, match=rf"^zerotrain.initialize: the model has a parameter on meta; it trains on "
                                         rf"{trains_on}$"):
        zerotrain.initialize(model=model, config=config)
