"""FusedLamb: the engine's LAMB kernel (two passes, so that per-tensor norms work across shards),
with DeepSpeed's signature and defaults."""
from ._client import EngineOptimizer


class FusedLamb(EngineOptimizer):
    engine_type = "Lamb"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 weight_decay=0.0, max_grad_norm=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True: the AMSGrad variant is not implemented (DeepSpeed's FusedLamb "
                             "refuses it too)")
        if eps_inside_sqrt:
            raise ValueError("FusedLamb: eps_inside_sqrt=True: the engine's LAMB adds eps outside the square root only")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, max_grad_norm=max_grad_norm, max_coeff=max_coeff,
                                      min_coeff=min_coeff))

    def engine_params(self):
        g = self.param_groups[0]
        return {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"],
                "bias_correction": bool(g["bias_correction"]), "max_grad_norm": g["max_grad_norm"],
                "max_coeff": g["max_coeff"], "min_coeff": g["min_coeff"]}
