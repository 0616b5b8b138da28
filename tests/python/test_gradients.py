"""What reaches the engine's gradients besides its own backward: torch's zero_grad() on the module,
another engine's loss whose graph runs through this model, and a second backward() before step()
(DeepSpeed's GAN example does all three). Tiny models; one process, and 2 ranks for the reduction."""
import copy

import pytest
import torch

import launching
import zerotrain


def mlp(seed, inputs=8, outputs=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.GELU(), torch.nn.Linear(16, outputs))


def config(stage, **zero):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": dict({"stage": stage}, **zero)}


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def assert_same_parameters(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-3, atol=1e-4), name


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_module_zero_grad_every_iteration_trains_as_torch_does(stage, set_to_none):
    model = mlp(0)
    reference = copy.deepcopy(model)
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(stage))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    for x, y in batches(4):
        model.zero_grad(set_to_none=set_to_none)  # as DeepSpeed's GAN example does each iteration
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
        assert engine.get_global_grad_norm() > 0
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("stage", [0, 1])
def test_gradients_the_script_zeroes_after_backward_are_not_stepped_on(stage):
    model = mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    engine, _, _, _ = zerotrain.initialize(model=model, config=config(stage))
    (x, y), = batches(1)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    model.zero_grad()
    engine.step()
    assert engine.get_global_grad_norm() == 0.0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize("discriminator_steps_first", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_another_engines_loss_through_this_model_does_not_reach_its_step(stage, discriminator_steps_first):
    """A GAN: G's loss runs through D, so G's backward leaves gradients on D's parameters; D's
    engine steps on D's own loss only, as torch's loop with a zero_grad() before each backward."""
    netG, netD = mlp(1, inputs=4, outputs=8), mlp(2)
    refG, refD = copy.deepcopy(netG), copy.deepcopy(netD)
    engineG, _, _, _ = zerotrain.initialize(model=netG, config=config(stage))
    engineD, _, _, _ = zerotrain.initialize(model=netD, config=config(stage))
    optG = torch.optim.AdamW(refG.parameters(), lr=1e-2, weight_decay=0.0)
    optD = torch.optim.AdamW(refD.parameters(), lr=1e-2, weight_decay=0.0)
    mse = torch.nn.functional.mse_loss
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        noise, real = torch.randn(4, 4, generator=g), torch.randn(4, 8, generator=g)
        engineD.backward(mse(engineD(real), torch.ones(4, 1)) + mse(engineD(engineG(noise).detach()), torch.zeros(4, 1)))
        if discriminator_steps_first:
            engineD.step()
        engineG.backward(mse(engineD(engineG(noise)), torch.ones(4, 1)))  # through D: D's parameters get gradients
        if not discriminator_steps_first:
            engineD.step()
        engineG.step()

        optD.zero_grad()
        (mse(refD(real), torch.ones(4, 1)) + mse(refD(refG(noise).detach()), torch.zeros(4, 1))).backward()
        if discriminator_steps_first:
            optD.step()
        # G's gradient alone: D's stays what D's own loss gave it.
        lossG = mse(refD(refG(noise)), torch.ones(4, 1))
        for p, grad in zip(refG.parameters(), torch.autograd.grad(lossG, list(refG.parameters()))):
            p.grad = grad
        if not discriminator_steps_first:
            optD.step()
        optG.step()
    assert_same_parameters(netD, refD)
    assert_same_parameters(netG, refG)


def test_two_backwards_before_one_step_in_one_process():
    """Stage 0 and 3 add the second backward's gradient, stage 1 keeps it alone, stage 2 refuses it,
    as DeepSpeed 0.19 does."""
    (x1, y1), (x2, y2) = batches(2)
    mse = torch.nn.functional.mse_loss
    for stage, keeps_both in ((0, True), (1, False), (3, True)):
        model = mlp(0)
        reference = copy.deepcopy(model)
        engine, _, _, _ = zerotrain.initialize(model=model, config=config(stage))
        engine.backward(mse(engine(x1), y1))
        assert engine.is_gradient_accumulation_boundary()
        engine.backward(mse(engine(x2), y2))
        engine.step()
        assert engine.global_steps == 1
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
        (mse(reference(x1), y1) * keeps_both + mse(reference(x2), y2)).backward()
        optimizer.step()
        assert_same_parameters(model, reference)
    engine, _, _, _ = zerotrain.initialize(model=mlp(0), config=config(2))
    engine.backward(mse(engine(x1), y1))
    with pytest.raises(zerotrain.EngineError, match=r"backward\(\) called again before step\(\): at ZeRO stage 2"):
        engine.backward(mse(engine(x2), y2))
    engine.step()
    assert engine.global_steps == 1


def test_two_backwards_before_one_step_on_two_ranks(tmp_path):
    """Each backward's gradient is the mean over the ranks: [1, 1] twice at stage 0 and 3 (DeepSpeed:
    a weight change of [-0.2, -0.2] with lr 0.1), the last one alone at stage 1."""
    cases = [[0, False], [0, True], [1, False], [1, True], [2, False], [3, False]]
    out, _ = launching.launch(tmp_path, "two_backwards_run.py", "two_backwards", {"cases": cases})
    for key in ("0", "0-overlap", "3"):
        assert out[key]["change"] == pytest.approx([-0.2, -0.2], abs=1e-6), key
    for key in ("1", "1-overlap"):
        assert out[key]["change"] == pytest.approx([-0.1, -0.1], abs=1e-6), key
    assert "at ZeRO stage 2" in out["2"]["error"]


def test_initialize_refuses_a_module_that_a_live_engine_holds():
    model = mlp(0)
    first, _, _, _ = zerotrain.initialize(model=model, config=config(0))
    with pytest.raises(ValueError, match="held by another engine that is still alive"):
        zerotrain.initialize(model=model, config=config(0))
    # The first engine still trains the module.
    before = [p.detach().clone() for p in model.parameters()]
    (x, y), = batches(1)
    first.backward(torch.nn.functional.mse_loss(first(x), y))
    first.step()
    assert first.get_global_grad_norm() > 0
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    # Handed over: destroyed, the module goes to a new engine, which trains it.
    first.destroy()
    second, _, _, _ = zerotrain.initialize(model=model, config=config(0))
    second.backward(torch.nn.functional.mse_loss(second(x), y))
    second.step()
    assert second.get_global_grad_norm() > 0
