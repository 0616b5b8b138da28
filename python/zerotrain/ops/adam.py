"""FusedAdam and DeepSpeedCPUAdam: the engine's fused Adam/AdamW kernel (AVX2/AVX-512 on the CPU,
the CUDA kernel on a GPU), with DeepSpeed's signatures and defaults."""
from .. import _unsupported
from ._client import EngineOptimizer


class FusedAdam(EngineOptimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise ValueError(f"{type(self).__name__}: amsgrad=True: the AMSGrad variant is not implemented (DeepSpeed's "
                             "FusedAdam refuses it too)")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = bool(adam_w_mode)

    @property
    def engine_type(self):
        return "AdamW" if self.adam_w_mode else "Adam"

    def engine_params(self):
        g = self.param_groups[0]
        params = {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"], "weight_decay": g["weight_decay"],
                  "bias_correction": bool(g["bias_correction"])}
        if not self.adam_w_mode:
            params["adam_w_mode"] = False  # Adam with L2 weight decay
        return params


class DeepSpeedCPUAdam(FusedAdam):
    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if not fp32_optimizer_states:
            raise ValueError("DeepSpeedCPUAdam: fp32_optimizer_states=False: the engine keeps optimizer states in fp32 only")
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=adamw_mode, weight_decay=weight_decay, amsgrad=amsgrad)


ZenFlowCPUAdam = _unsupported.cls("deepspeed.ops.adam.ZenFlowCPUAdam", "zerotrain has no ZenFlow")
ZenFlowSelectiveAdamW = _unsupported.cls("deepspeed.ops.adam.ZenFlowSelectiveAdamW", "zerotrain has no ZenFlow")
ZenFlowSelectiveAdamW_stage3 = _unsupported.cls("deepspeed.ops.adam.ZenFlowSelectiveAdamW_stage3",
                                                "zerotrain has no ZenFlow")
