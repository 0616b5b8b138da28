"""The package as docs/python.md says to use it: PYTHONPATH=build/python:<the torch wheel's
directory>, with Debian's own python3, which has none of torch's Python dependencies."""
import os
import subprocess
import sys

import pytest
import torch

import zerotrain

DEBIAN_PYTHON = "/usr/bin/python3"


def test_the_documented_pythonpath_imports_zerotrain_with_debians_python3(tmp_path):
    if not os.path.exists(DEBIAN_PYTHON):
        pytest.skip(f"no Debian python3 at {DEBIAN_PYTHON}")
    version = subprocess.run([DEBIAN_PYTHON, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        pytest.skip(f"{DEBIAN_PYTHON} is Python {version}; the extension was built for {sys.version_info[:2]}")
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(zerotrain.__file__)))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": f"{package_dir}:{torch_dir}"}
    result = subprocess.run([DEBIAN_PYTHON, "-s", "-c",
                             "import zerotrain, torch; print(torch.ones(3).sum().item())"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "3.0"
