"""Stage 3 from Python on 2 ranks (zerotrain launch): a module's units are sharded, gathered per
submodule and released, with the same losses as the unsharded run."""
import pytest

import launching


def launch(tmp_path, name, spec):
    return launching.launch(tmp_path, "units_run.py", name, spec)


def check_modified(got):
    """What rank 0 wrote under GatheredParameters(modifier_rank=0) is what every rank holds."""
    ranks = got["modified"]
    assert ranks[0][0] == pytest.approx(0.25 * 32)
    assert all(r == ranks[0] for r in ranks), ranks


@pytest.fixture(scope="module")
def stage0(tmp_path_factory):
    got = launch(tmp_path_factory.mktemp("s0"), "s0", {"stage": 0})[0]
    check_modified(got)
    return got


# Units released right after use and prefetched a thousand elements ahead, so that the peak of
# gathered parameters is a few units; DeepSpeed's defaults (reuse distance 1e9) keep a model this
# small gathered from its forward to its backward.
RELEASING = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1000}


@pytest.mark.parametrize("variant", [
    {"stage": 3, "zero": RELEASING},
    {"stage": 3, "checkpointing": True, "zero": RELEASING},
    {"stage": 3, "zero": dict(RELEASING, offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})},
    {"stage": 3},
    {"stage": 3, "zero_init": True, "zero": RELEASING},
    {"stage": 3, "zero_init": True, "zero": dict(RELEASING, offload_param={"device": "cpu"})},
])
def test_stage3_units_train_as_the_unsharded_run(tmp_path, stage0, variant):
    got, stderr = launch(tmp_path, "s3", variant)
    check_modified(got)
    assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
    assert got["eval_loss"] == pytest.approx(stage0["eval_loss"], rel=1e-5)
    assert got["head_norm"] == pytest.approx(stage0["head_norm"], rel=1e-5)
    assert "units sharded" in stderr
    if variant.get("zero") is not None:
        # Never the whole model gathered at once: a few units (the largest, 4·32·128 elements).
        assert 0 < got["peak_gathered_bytes"] < got["trainable_bytes"] / 2


@pytest.mark.parametrize("stage", [0, 2])
def test_zero_init_builds_sharded_for_every_stage(tmp_path, stage0, stage):
    got, _ = launch(tmp_path, f"init-s{stage}", {"stage": stage, "zero_init": True})
    check_modified(got)
    assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
    assert got["head_norm"] == pytest.approx(stage0["head_norm"], rel=1e-5)


def test_stage3_says_so_when_no_unit_qualifies(tmp_path, stage0):
    got, stderr = launch(tmp_path, "s3-none", {"stage": 3, "zero": {"stage3_param_persistence_threshold": 10**9}})
    assert "no submodule qualifies as a unit" in stderr
    assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
    assert got["peak_gathered_bytes"] == 0


@pytest.fixture(scope="module")
def stage3_releasing(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("s3"), "s3", {"stage": 3, "zero": RELEASING})[0]


# Block gathers of one optimizer step (two micro-steps) with RELEASING, from the unit calls of one
# forward: the embedding (twice: the tied head reads it), each block's norm, up and down (a leaf
# block: one unit), the final norm. Each call gathers its unit for the forward and again for the
# backward, except the last one, still gathered when its backward comes right after (nothing is
# used in between: a reuse distance of 0).
def gathers_per_step(units_in_forward, accumulation=2):
    return (2 * units_in_forward - 1) * accumulation


@pytest.mark.parametrize("variant, forward_units", [
    ({"zero": dict(RELEASING, leaf_module={"classes": ["Block"]})}, 1 + 3 + 1 + 1),
    ({"leaf_classes": ["Block"], "zero": RELEASING}, 1 + 3 + 1 + 1),
    ({"zero": dict(RELEASING, leaf_module={"names": ["blocks.1"]})}, 1 + 3 + 1 + 3 + 1 + 1),
    ({"zero": dict(RELEASING, leaf_module={"name_suffixes": ["s.0", "s.2"]})}, 1 + 1 + 3 + 1 + 1 + 1),
    ({"zero_init": True, "zero": dict(RELEASING, leaf_module={"classes": ["Block"]})}, 1 + 3 + 1 + 1),
])
def test_leaf_modules_are_one_unit_each(tmp_path, stage0, stage3_releasing, variant, forward_units):
    plain = stage3_releasing
    got, _ = launch(tmp_path, "leaf", dict(variant, stage=3))
    check_modified(got)
    assert got["losses"] == pytest.approx(stage0["losses"], rel=1e-5)
    assert got["head_norm"] == pytest.approx(stage0["head_norm"], rel=1e-5)
    assert got["block_gathers"] == [gathers_per_step(forward_units)] * 4
    assert plain["block_gathers"] == [gathers_per_step(1 + 9 + 1 + 1)] * 4
