"""The build backend of `pip install .` (pyproject.toml): scikit-build-core, pointed at the torch of
the environment the package is installed into.

zerotrain's extension must run beside the very torch it was compiled against (its C++ symbols are
torch's, and they change between torch releases). pip builds in an isolated environment, where a
build requirement on torch would install the newest torch on the index — not the user's — and the
extension would then refuse to import beside the user's own. So this backend asks the installing
environment which torch it has (the same interpreter without pip's isolation), and builds against
that one through CMAKE_PREFIX_PATH; only an environment without torch gets torch as a build
requirement (and then the newest supported torch at run time as well, through the package's
dependency). A torch outside the supported range (cmake/torch-python-range.txt) is refused, in one
sentence, before anything is built.

Where nvcc is found (on PATH, or /usr/local/cuda/bin) the engine's CUDA path is built too
(-DZT_CUDA=ON), so that the package trains modules on a GPU; ZT_CUDA=0 in the environment (or
-C cmake.define.ZT_CUDA=OFF) builds the CPU engine only, ZT_CUDA=1 insists on CUDA."""
import json
import os
import shutil
import subprocess
import sys

_PROBE = ("import json, torch, torch.utils; "
          "print(json.dumps([torch.__version__, torch.utils.cmake_prefix_path, torch.__file__]))")
# What pip's build isolation sets so that the backend cannot see the installing environment.
_ISOLATION_VARIABLES = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONSAFEPATH")


_SOURCE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class BuildSetupError(RuntimeError):
    pass


def _supported_range():
    path = os.path.join(_SOURCE_DIR, "cmake", "torch-python-range.txt")
    with open(path) as f:
        versions = [line.strip() for line in f if line.strip()[:1].isdigit()]
    if len(versions) != 2:
        raise BuildSetupError(f"cmake/torch-python-range.txt: expected two versions (the lowest supported, the first not supported), "
                               f"found {len(versions)}")
    return tuple(tuple(int(p) for p in v.split(".")[:3]) for v in versions)


def _release(version):
    """(major, minor, patch) of a torch version string such as 2.15.0+cu132."""
    parts = version.split("+")[0].split(".")[:3]
    numbers = []
    for part in parts:
        digits = "".join(c for c in part if c.isdigit()) if part else ""
        numbers.append(int(digits or 0))
    return tuple(numbers + [0] * (3 - len(numbers)))


def _probe(environment):
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=environment,
                          timeout=300)
    if done.returncode != 0:
        return None
    version, prefix, module = json.loads(done.stdout.strip().splitlines()[-1])
    return {"version": version, "prefix": prefix, "module": module}


def _installing_environments_torch():
    """The torch the package will run beside: the one this interpreter imports without pip's
    isolation (with --no-build-isolation, the build environment is that environment)."""
    clean = {k: v for k, v in os.environ.items() if k not in _ISOLATION_VARIABLES}
    return _probe(clean)


def _build_environments_torch():
    return _probe(dict(os.environ))


def _checked(torch):
    lowest, beyond = _supported_range()
    found = _release(torch["version"])
    if not lowest <= found < beyond:
        raise BuildSetupError(
            f"zerotrain's Python package builds against torch {'.'.join(map(str, lowest))} up to, not including, "
            f"{'.'.join(map(str, beyond))} (cmake/torch-python-range.txt), but this environment has torch "
            f"{torch['version']} ({torch['module']}): install a supported torch first")
    return torch


def _with_torch(config_settings):
    """config_settings for scikit-build-core that name the installing environment's torch, when the
    build environment has none of its own."""
    settings = dict(config_settings or {})
    if _build_environments_torch() is not None:
        return settings  # --no-build-isolation, or an environment without torch: CMake finds it itself
    torch = _installing_environments_torch()
    if torch is None:
        raise BuildSetupError("the build environment has no torch, and neither has the environment being installed "
                               "into")
    settings["cmake.define.CMAKE_PREFIX_PATH"] = _checked(torch)["prefix"]
    return settings


_NVCC_BEYOND_PATH = ("/usr/local/cuda/bin/nvcc",)  # where the CUDA toolkit installs it without PATH


def _nvcc():
    return shutil.which("nvcc") or next((p for p in _NVCC_BEYOND_PATH if os.access(p, os.X_OK)), None)


def _with_cuda_choice(settings):
    """ZT_CUDA for CMake: the caller's (-C cmake.define.ZT_CUDA, or ZT_CUDA in the environment), else
    on exactly when nvcc is found."""
    if "cmake.define.ZT_CUDA" in settings:
        return settings
    wanted = os.environ.get("ZT_CUDA", "")
    if wanted not in ("", "0", "1"):
        raise BuildSetupError(f"ZT_CUDA: expected 0 or 1, found {wanted!r}")
    nvcc = _nvcc()
    if wanted == "1" and nvcc is None:
        raise BuildSetupError("ZT_CUDA=1: nvcc is not on PATH nor in /usr/local/cuda/bin (install the CUDA toolkit)")
    on = wanted == "1" or (wanted == "" and nvcc is not None)
    settings["cmake.define.ZT_CUDA"] = "ON" if on else "OFF"
    if on and os.path.dirname(nvcc) not in os.environ.get("PATH", "").split(os.pathsep):
        settings["cmake.define.CMAKE_CUDA_COMPILER"] = nvcc
    return settings


def _requires(requirements):
    torch = _installing_environments_torch()
    if torch is None:
        lowest, beyond = _supported_range()
        return list(requirements) + [f"torch>={'.'.join(map(str, lowest))},<{'.'.join(map(str, beyond))}"]
    _checked(torch)
    return list(requirements)


def _skbuild():
    # Imported when a hook runs: pip has installed the build requirements by then (and the helpers
    # above stay testable without them).
    from scikit_build_core import build

    return build


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_skbuild().get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _requires(_skbuild().get_requires_for_build_editable(config_settings))


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild().get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_wheel(wheel_directory, _with_cuda_choice(_with_torch(config_settings)),
                                  metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild().build_editable(wheel_directory, _with_cuda_choice(_with_torch(config_settings)),
                                     metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild().build_sdist(sdist_directory, config_settings)
