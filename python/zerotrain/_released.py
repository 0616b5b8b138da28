"""Parameters whose values are not in this process: a unit built sharded under zero.Init and not
adopted by an engine yet (this rank holds only its shard), or a stage-3 unit whose engine was
destroyed. Their storage is empty while they keep their shape, and most of torch's kernels would
read it without a check (a crash, not an error). Such a parameter's class becomes
ReleasedParameter for as long as it is empty: what only asks about the tensor (its shape, dtype,
requires_grad) works as before, anything that reads or copies its values raises
ReleasedParameterError saying why it is empty, and pickling it (torch.save, a state_dict) refuses.
"""
import torch

WHY_INIT = ("it was built sharded under zerotrain.zero.Init and this rank holds only its shard until "
            "zerotrain.initialize adopts the module; read or write it inside "
            "zerotrain.zero.GatheredParameters(...)")
WHY_DESTROYED = ("its values went with the ZeRO stage-3 engine that was destroyed (engine.destroy()); save a "
                 "checkpoint, or copy the values out inside zerotrain.zero.GatheredParameters, before destroying it")

# What does not read the values. Property getters (shape, dtype, device, requires_grad, grad) pass
# too, all but `data`, which would hand out the empty storage under another name.
_ALLOWED = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement,
            torch.Tensor.element_size, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
            torch.Tensor.requires_grad_, torch.Tensor.__hash__, torch.Tensor.get_device, torch.Tensor.is_contiguous,
            torch.Tensor.stride, torch.Tensor.untyped_storage, torch._has_compatible_shallow_copy_type}
_DATA_GETTER = torch.Tensor.data.__get__
# Conversions that are no-ops return the parameter itself (a module's .to() on its own device and
# dtype, say); any other would copy the values.
_CONVERSIONS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.float}


def _no_op_conversion(func, args, kwargs):
    p = args[0]
    if func is torch.Tensor.cpu:
        return p.device.type == "cpu"
    if func is torch.Tensor.float:
        return p.dtype == torch.float32
    if kwargs.get("copy"):
        return False
    device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})
    return (device is None or torch.device(device) == p.device) and (dtype is None or dtype == p.dtype)


class ReleasedParameterError(RuntimeError):
    """A parameter without values in this process was read."""


class ReleasedParameter(torch.nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        reads_data = type(func).__name__ == "method-wrapper" and func.__name__ == "__get__" and func == _DATA_GETTER
        if func in _ALLOWED or (type(func).__name__ == "method-wrapper" and not reads_data):
            return super().__torch_function__(func, types, args, kwargs or {})
        if func in _CONVERSIONS and args and isinstance(args[0], ReleasedParameter) and \
                _no_op_conversion(func, args, kwargs or {}):
            return args[0]
        released = next((a for a in args if isinstance(a, ReleasedParameter)), None)
        what = ".data" if reads_data else getattr(func, "__name__", str(func))
        raise ReleasedParameterError(_message(released, what))

    def __repr__(self):
        return f"ReleasedParameter(shape={tuple(self.shape)}, dtype={self.dtype}: no values here, {why(self)})"

    def __reduce_ex__(self, proto):
        raise ReleasedParameterError(_message(self, "pickling (torch.save)"))

    def __deepcopy__(self, memo):
        raise ReleasedParameterError(_message(self, "copy.deepcopy"))


def why(p):
    return p.__dict__.get("_zt_why", WHY_INIT) if p is not None else WHY_INIT


def _message(p, what):
    shape = f" of shape {tuple(p.shape)}" if p is not None else ""
    return f"{what}: this parameter{shape} has no values in this process: {why(p)}"


def release(p, reason):
    """p's storage is empty now: reading it raises, saying `reason`."""
    p.__dict__["_zt_why"] = reason
    if type(p) is not ReleasedParameter and isinstance(p, torch.nn.Parameter):
        p.__dict__["_zt_class"] = type(p)  # a plain Parameter, or the engine's ZeroParameter
        p.__class__ = ReleasedParameter


def restore(p):
    """p holds its values again (gathered, or adopted by an engine)."""
    if type(p) is ReleasedParameter:
        p.__class__ = p.__dict__.get("_zt_class", torch.nn.Parameter)
    p.__dict__.pop("_zt_class", None)
    p.__dict__.pop("_zt_why", None)


def is_released(p):
    return type(p) is ReleasedParameter
