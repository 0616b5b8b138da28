"""Runs a script of tests/python/scripts on 2 ranks under `zerotrain launch` (the test command sets
ZT_BIN to the command line) and returns rank 0's JSON result and its log (where the notes go)."""
import json
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def launch(tmp_path, script, name, spec):
    cli = os.environ.get("ZT_BIN")
    if not cli:
        pytest.fail("ZT_BIN (the zerotrain command line) must be set: the test command sets it")
    out = tmp_path / f"{name}.json"
    logs = tmp_path / f"{name}-logs"
    result = subprocess.run([cli, "launch", "--nproc", "2", "--log-dir", str(logs), "--", sys.executable,
                             os.path.join(SCRIPTS, script), json.dumps(spec), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(logs / "rank0.log") as f:
        log = f.read()
    with open(out) as f:
        return json.load(f), log
