import torch


class EngineOptimizer(torch.optim.Optimizer):
    """Hyperparameters for one of the engine's fused optimizers (see zerotrain.ops)."""

    engine_type = None  # the configuration's optimizer "type" this class stands for

    def __init__(self, params, defaults):
        super().__init__(params, defaults)

    def engine_params(self):
        """The configuration's optimizer "params" for the engine (the first group's values)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        raise RuntimeError(f"{type(self).__name__} runs inside zerotrain's engine: hand it to zerotrain.initialize(optimizer=...) "
                           "and call engine.step()")
