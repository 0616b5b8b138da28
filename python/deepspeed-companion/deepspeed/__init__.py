"""`deepspeed`, answered by zerotrain: this module and every DeepSpeed module a script or library
imports by name (deepspeed.comm, deepspeed.zero, deepspeed.runtime.zero.partition_parameters, ...)
resolve to zerotrain's, so that the Hugging Face Trainer, Accelerate and TRL run on zerotrain's
engine unchanged. Installed only on purpose, from zerotrain's source tree
(`pip install ./python/deepspeed-companion`), and removed with `pip uninstall deepspeed`.

The version is the DeepSpeed release whose API zerotrain follows, with zerotrain's version as its
local label; deepspeed.zerotrain_version says which zerotrain answers."""
import importlib.metadata as _metadata
import os as _os
import sys as _sys


def _refuse_a_second_deepspeed():
    """A real DeepSpeed beside this companion (another `deepspeed` distribution on the path, as
    PYTHONPATH or a --target directory can arrange) would leave which one a library gets to the
    order of the path: refuse, naming both, rather than run on one of them by accident."""
    here = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    others = []
    for dist in _metadata.distributions(name="deepspeed"):
        location = str(dist.locate_file(""))
        if "+zerotrain" not in (dist.version or "") and _os.path.abspath(location) != here:
            others.append(f"deepspeed {dist.version} in {location}")
    if others:
        raise ImportError(f"zerotrain's deepspeed companion in {here} and a real DeepSpeed ({'; '.join(others)}) are both "
                          "installed: uninstall one (pip uninstall deepspeed removes whichever pip finds first)")


_refuse_a_second_deepspeed()

try:
    import zerotrain as _zerotrain
except ImportError as error:  # the companion alone, without the package that does the work
    raise ImportError(f"zerotrain's deepspeed companion needs the zerotrain package, which does not import ({error}): "
                      "install zerotrain (pip install . in its source tree) or uninstall the companion") from error

__version__ = f"0.19.8+zerotrain.{_zerotrain.__version__}"
version = __version__
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
zerotrain_version = _zerotrain.__version__
git_hash = git_branch = "unknown"


def __getattr__(name):
    """Every other top-level name is zerotrain's (initialize, zero, comm, DeepSpeedEngine, ...)."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        return getattr(_zerotrain, name)
    except AttributeError:
        raise AttributeError(f"module 'deepspeed' (zerotrain's companion) has no attribute '{name}'") from None


def __dir__():
    return sorted(set(globals()) | set(dir(_zerotrain)))


from zerotrain import _deepspeed_names as _names  # noqa: E402

_names.register(_sys.modules[__name__])
