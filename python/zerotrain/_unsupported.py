"""DeepSpeed names that zerotrain does not implement. Each resolves (so that `import deepspeed.x`
and `from deepspeed.x import y` succeed and a script gets as far as it can), and calling it raises
NotSupportedError with one sentence naming it: a script stops where it reaches something zerotrain
does not do, and says what, instead of failing at import with an AttributeError or ImportError."""


class NotSupportedError(NotImplementedError):
    """A DeepSpeed API that zerotrain does not implement."""


def message(name, hint=None):
    return f"{name} is not supported by zerotrain" + (f" ({hint})" if hint else "")


def _mark(obj, name, hint):
    obj.__doc__ = message(name, hint) + "; calling it raises zerotrain.NotSupportedError."
    obj.zerotrain_not_supported = name
    return obj


def function(name, hint=None):
    """A function (or, set on a class, a method) that raises NotSupportedError when called."""

    def not_supported(*args, **kwargs):
        raise NotSupportedError(message(name, hint))

    not_supported.__name__ = not_supported.__qualname__ = name.rsplit(".", 1)[-1]
    return _mark(not_supported, name, hint)


def cls(name, hint=None):
    """A class that raises NotSupportedError when instantiated: isinstance() checks against it work
    (nothing is an instance), and a subclass fails as soon as it is instantiated."""

    def __new__(klass, *args, **kwargs):
        raise NotSupportedError(message(name, hint))

    short = name.rsplit(".", 1)[-1]
    return _mark(type(short, (), {"__new__": __new__, "__qualname__": short}), name, hint)


def is_not_supported(obj):
    return getattr(obj, "zerotrain_not_supported", None) is not None


def module(name, hint=None):
    """A module of DeepSpeed's that zerotrain has no part of (the pipeline engine, the inference
    kernels): `import deepspeed.pipe` works, and every public name in it is a class that raises
    NotSupportedError naming it when instantiated or called."""
    import types

    made = types.ModuleType(name, message(name, hint) + ": every name in it raises zerotrain.NotSupportedError.")
    made.__path__ = []  # a package: `import deepspeed.pipe.engine` finds its submodules registered the same way

    def __getattr__(attribute):
        if attribute.startswith("__"):
            raise AttributeError(attribute)  # Python's own probes (__file__, __spec__ ...) see a plain module
        value = cls(f"{name}.{attribute}", hint)
        setattr(made, attribute, value)
        return value

    made.__getattr__ = __getattr__
    made.zerotrain_not_supported = name
    return made
