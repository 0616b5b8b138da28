"""engine.no_sync() on 2 ranks (zerotrain launch): at stages 0 and 1 a window's gradients are
reduced once, on its last micro-step, so micro-steps inside no_sync leave the result where
DeepSpeed's no_sync leaves it: the reduction of the whole window's gradients at its boundary."""
import pytest

import launching


def launch(tmp_path, name, spec):
    return launching.launch(tmp_path, "no_sync_run.py", name, spec)[0]


@pytest.mark.parametrize("stage, zero", [(0, {}), (1, {}), (1, {"overlap_comm": True})])
def test_micro_steps_inside_no_sync_reduce_at_the_boundary(tmp_path, stage, zero):
    synced = launch(tmp_path, "synced", {"stage": stage, "zero": zero, "no_sync": False})
    quiet = launch(tmp_path, "quiet", {"stage": stage, "zero": zero, "no_sync": True})
    assert quiet["steps"] == synced["steps"] == 3
    assert quiet["losses"] == synced["losses"]
    assert quiet["weights"] == synced["weights"]
    assert quiet["ranks_agree"]
    # The mean gradient over every rank's micro-batches of the window, as torch's AdamW computes it.
    assert quiet["max_diff_from_torch"] < 1e-5
