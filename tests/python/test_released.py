"""Parameters without values in this process (built sharded under zero.Init and not adopted yet, or
gone with a destroyed stage-3 engine) raise an error that says why instead of crashing, refuse to
be saved, and a parameter that outlives its sharded module (an embedding replaced by a resize) is
still gathered. Anything that could crash runs in a child process, so that a crash is a failure."""
import os
import subprocess
import sys
import textwrap

import pytest

import launching


def run_child(tmp_path, code):
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_a_parameter_gone_with_its_destroyed_stage3_engine_raises_and_refuses_to_be_saved(tmp_path):
    out = run_child(tmp_path, """
        import torch, zerotrain
        ReleasedParameterError = getattr(zerotrain, "ReleasedParameterError", RuntimeError)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        engine, _, _, _ = zerotrain.initialize(model=m, config=config)
        engine.backward(m(torch.randn(4, 8)).pow(2).mean())
        engine.step()
        engine.destroy()
        p = next(m.parameters())
        assert p.shape == (16, 8) and p.requires_grad
        for name, use in [("sum", lambda: p.sum()), ("clone", lambda: p.clone()), ("data", lambda: p.data + 1),
                          ("state_dict", lambda: torch.save(m.state_dict(), "m.pt")),
                          ("save", lambda: torch.save(p, "p.pt"))]:
            try:
                use()
                print(name, "did not raise")
            except ReleasedParameterError as e:
                assert "engine that was destroyed" in str(e), str(e)
                print(name, "raised")
        print("repr", "destroyed" in repr(p))
        import os
        print("state_dict file", os.path.exists("m.pt"))
        try:
            zerotrain.initialize(model=m, config=config)
            print("initialize did not raise")
        except ValueError as e:
            assert "has no values" in str(e), str(e)
            print("initialize raised")
        """)
    for name in ("sum", "clone", "data", "state_dict", "save", "initialize"):
        assert f"{name} raised" in out, out
    assert "repr True" in out and "state_dict file False" in out, out


def test_a_parameter_built_under_init_raises_until_the_engine_adopts_it(tmp_path):
    out = run_child(tmp_path, """
        import torch, zerotrain
        ReleasedParameterError = getattr(zerotrain, "ReleasedParameterError", RuntimeError)
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        torch.manual_seed(0)
        with zerotrain.zero.Init(config_dict_or_path=config):
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
        torch.manual_seed(0)
        reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
        p = m[0].weight
        assert p.shape == (16, 8)
        m.to("cpu")  # a conversion that changes nothing reads nothing
        for name, use in [("sum", lambda: p.sum()), ("tolist", lambda: p.tolist()), ("clone", lambda: p.clone()),
                          ("forward-free read", lambda: p.data.sum()), ("save", lambda: torch.save(m.state_dict(), "m.pt"))]:
            try:
                use()
                print(name, "did not raise")
            except ReleasedParameterError as e:
                assert "zerotrain.zero.Init" in str(e) and "GatheredParameters" in str(e), str(e)
                print(name, "raised")
        print("repr", "zerotrain.zero.Init" in repr(p))
        with zerotrain.zero.GatheredParameters(list(m.parameters())):
            print("gathered", all(torch.equal(a, b) for a, b in zip(m.parameters(), reference.parameters())))
        engine, _, _, _ = zerotrain.initialize(model=m, config=config)
        with zerotrain.zero.GatheredParameters([p]):
            print("adopted", torch.equal(p.detach(), reference[0].weight.detach()), type(p).__name__)
        """)
    for name in ("sum", "tolist", "clone", "forward-free read", "save"):
        assert f"{name} raised" in out, out
    # Adopted: an ordinary parameter again, of the engine's stage-3 kind (DeepSpeed's ds_* attributes).
    assert "repr True" in out and "gathered True" in out and "adopted True ZeroParameter" in out, out


@pytest.mark.parametrize("vocab, retie", [(32, True), (40, True), (32, False)])
def test_a_replaced_embedding_built_under_init_is_still_gathered_and_trains(tmp_path, vocab, retie):
    out, _ = launching.launch(tmp_path, "resize_run.py", "resize", {"vocab": vocab, "retie": retie})
    assert out["old_weight_equal"]
    assert out["old_is_released"] == ("ReleasedParameter" if retie else "ZeroParameter")
    assert out["losses"] == pytest.approx(out["want"], rel=1e-5)
