"""The build backend of `pip install .` (python/pip_backend/zerotrain_build.py): under pip's build
isolation it builds against the torch of the environment being installed into, refuses an
unsupported one by name, and asks for torch only where that environment has none.

Each case makes that environment as pip finds it: a virtual environment whose site-packages holds a
stand-in torch (its version and CMake path, all the backend reads), and pip's isolation around the
backend (PYTHONNOUSERSITE and a PYTHONPATH whose sitecustomize drops the environment's
site-packages from sys.path, as pip's build environment does)."""
import json
import os
import subprocess
import textwrap
import venv

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BACKEND_DIR = os.path.join(ROOT, "python", "pip_backend")


def installing_environment(tmp_path, torch_version):
    """A virtual environment with a stand-in torch of that version (None: without torch)."""
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False, symlinks=True)
    site = next(env_dir.glob("lib/python*/site-packages"))
    if torch_version is not None:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
        (site / "torch" / "utils.py").write_text(
            f"cmake_prefix_path = {str(site / 'torch' / 'share' / 'cmake')!r}\n")
    return env_dir / "bin" / "python", site


def in_isolation(tmp_path, python, site, code):
    """Runs code in the backend's module as pip's isolated build would: the environment's
    site-packages hidden from the build process."""
    isolation = tmp_path / "isolation"
    isolation.mkdir(exist_ok=True)
    (isolation / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import sys
        sys.path[:] = [p for p in sys.path if not p.startswith({str(site)!r})]
        """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=f"{isolation}{os.pathsep}{BACKEND_DIR}", PYTHONNOUSERSITE="1")
    program = "import json, zerotrain_build as b\n" + code
    done = subprocess.run([str(python), "-c", program], capture_output=True, text=True, env=env, timeout=120)
    return done


def test_the_isolated_build_sees_no_torch_of_its_own(tmp_path):
    python, site = installing_environment(tmp_path, "2.11.0+cu130")
    done = in_isolation(tmp_path, python, site, "print(json.dumps(b._build_environments_torch()))")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) is None  # what made the old build use the wrong torch, or none


def test_it_builds_against_the_installing_environments_torch_and_asks_for_no_other(tmp_path):
    python, site = installing_environment(tmp_path, "2.11.0+cu130")
    done = in_isolation(tmp_path, python, site,
                        "print(json.dumps([b._requires(['scikit-build-core>=0.10']), b._with_torch({'x': 'y'})]))")
    assert done.returncode == 0, done.stderr
    requires, settings = json.loads(done.stdout)
    assert requires == ["scikit-build-core>=0.10"]
    assert settings == {"x": "y", "cmake.define.CMAKE_PREFIX_PATH": str(site / "torch" / "share" / "cmake")}


def test_the_newest_supported_torch_builds_too(tmp_path):
    with open(os.path.join(ROOT, "cmake", "torch-python-range.txt")) as f:
        lowest, beyond = [line.strip() for line in f if line[:1].isdigit()]
    newest_minor = f"{beyond.split('.')[0]}.{int(beyond.split('.')[1]) - 1}.3"
    python, site = installing_environment(tmp_path, newest_minor)
    done = in_isolation(tmp_path, python, site, "print(json.dumps(b._with_torch(None)))")
    assert done.returncode == 0, done.stderr
    assert "cmake.define.CMAKE_PREFIX_PATH" in json.loads(done.stdout)


@pytest.mark.parametrize("version", ["2.10.2", "2.16.0", "3.0.0a0"])
def test_an_unsupported_torch_is_refused_by_name_before_anything_is_built(tmp_path, version):
    python, site = installing_environment(tmp_path, version)
    for hook in ("b._requires([])", "b._with_torch({})"):
        done = in_isolation(tmp_path, python, site, hook)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("zerotrain_build.BuildSetupError: zerotrain's Python package builds against torch "
                               "2.11.0 up to, not including, 2.16.0"), last
        assert f"this environment has torch {version} (" in last and last.endswith("install a supported torch first")


def test_an_environment_without_torch_gets_the_supported_range_as_a_build_requirement(tmp_path):
    python, site = installing_environment(tmp_path, None)
    done = in_isolation(tmp_path, python, site, "print(json.dumps(b._requires(['scikit-build-core>=0.10'])))")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["scikit-build-core>=0.10", "torch>=2.11.0,<2.16.0"]


def test_pyproject_builds_through_this_backend_with_the_same_range_at_run_time():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    # No torch among the build requirements: one would be the index's newest, not the user's.
    assert project["build-system"] == {"requires": ["scikit-build-core>=0.10"], "build-backend": "zerotrain_build",
                                       "backend-path": ["python/pip_backend"]}
    assert project["project"]["dependencies"] == ["torch>=2.11,<2.16"]
    with open(os.path.join(ROOT, "cmake", "torch-python-range.txt")) as f:
        assert [line.strip() for line in f if line[:1].isdigit()] == ["2.11.0", "2.16.0"]


@pytest.fixture
def backend(monkeypatch, tmp_path):
    """The backend's module in this process, with no nvcc but the ones a test puts on PATH."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("zerotrain_build_under_test",
                                                  os.path.join(BACKEND_DIR, "zerotrain_build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_NVCC_BEYOND_PATH", ())
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("ZT_CUDA", raising=False)
    return module


def fake_nvcc(tmp_path, monkeypatch):
    bin_dir = tmp_path / "cuda-bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvcc").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return str(bin_dir / "nvcc")


def test_the_cuda_path_is_built_exactly_where_nvcc_is_found(backend, tmp_path, monkeypatch):
    assert backend._with_cuda_choice({}) == {"cmake.define.ZT_CUDA": "OFF"}
    fake_nvcc(tmp_path, monkeypatch)
    assert backend._with_cuda_choice({}) == {"cmake.define.ZT_CUDA": "ON"}


def test_nvcc_outside_path_is_named_to_cmake(backend, tmp_path, monkeypatch):
    nvcc = fake_nvcc(tmp_path, monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(backend, "_NVCC_BEYOND_PATH", (nvcc,))
    assert backend._with_cuda_choice({}) == {"cmake.define.ZT_CUDA": "ON", "cmake.define.CMAKE_CUDA_COMPILER": nvcc}


def test_the_users_choice_wins(backend, tmp_path, monkeypatch):
    fake_nvcc(tmp_path, monkeypatch)
    monkeypatch.setenv("ZT_CUDA", "0")
    assert backend._with_cuda_choice({}) == {"cmake.define.ZT_CUDA": "OFF"}
    assert backend._with_cuda_choice({"cmake.define.ZT_CUDA": "ON"}) == {"cmake.define.ZT_CUDA": "ON"}
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("ZT_CUDA", "1")
    with pytest.raises(backend.BuildSetupError, match=r"^ZT_CUDA=1: nvcc is not on PATH nor in /usr/local/cuda/bin"):
        backend._with_cuda_choice({})
    monkeypatch.setenv("ZT_CUDA", "yes")
    with pytest.raises(backend.BuildSetupError, match=r"^ZT_CUDA: expected 0 or 1, found 'yes'$"):
        backend._with_cuda_choice({})
