"""deepspeed.moe.utils: how DeepSpeed tells expert parameters (those of its MoE layer, marked
`allreduce = False`) from shared ones. zerotrain's models have no expert-parallel parameters, so
the helpers return what DeepSpeed returns for a model without them, and refuse expert parameters
(something marked them for a layer zerotrain cannot train)."""
from .. import _unsupported
from .layer import MoE


def is_moe_param(param):
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model):
    """(False, 0): a model holds no MoE layer of DeepSpeed's here (the class cannot be made)."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param_group(param_group):
    return param_group.get("moe", False)


def _refuse_expert_parameters(groups, function):
    for group in groups:
        if any(is_moe_param(p) for p in group["params"]):
            raise _unsupported.NotSupportedError(_unsupported.message(
                f"deepspeed.moe.utils.{function} with expert-parallel parameters (allreduce=False)",
                "zerotrain has no expert parallelism"))


def split_params_into_shared_and_expert_params(params):
    params = list(params)
    _refuse_expert_parameters([{"params": params}], "split_params_into_shared_and_expert_params")
    return params, []


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """DeepSpeed's: the optimizer's parameter groups with each group's expert parameters moved into
    groups of their own. Without expert parameters that is the groups as given (a dict becomes a
    list of one, a tuple a list), each group's "params" made a list, as DeepSpeed returns them."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        group["params"] = list(group["params"])
    _refuse_expert_parameters(param_groups, "split_params_into_different_moe_groups_for_optimizer")
    return param_groups


def configure_moe_param_groups(model_parameters):
    """DeepSpeed's: a list of parameters becomes one group named "dense-params"; a list of groups
    is split as above unless it already has MoE groups."""
    if not isinstance(model_parameters, list):
        raise TypeError(f"model_parameters must be a list, found {type(model_parameters).__name__}")
    first = model_parameters[0]
    if isinstance(first, dict):
        if any("moe" in group for group in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
