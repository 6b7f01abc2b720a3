"""The package as users install it, from a wheel or the sdist, not the checkout: what it loads at run
time is shipped, what builds the extension is in the sdist, and a command that needs an extra that
is not installed says which."""

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", ".bundle", ".gpu", "out", "build", "dist", "*.egg-info",
                                      "__pycache__", "*.so", ".pytest_cache", ".hypothesis", ".mypy_cache",
                                      ".ruff_cache")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A wheel (pure: no extension build) and an sdist of a copy of the sources."""
    tmp = tmp_path_factory.mktemp("pkg")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    env = {**os.environ, "VLLM_OMNI_KERNELS_BUILD_EXT": "0"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=src, check=True, env=env,
                   capture_output=True)
    return next(dist.glob("*.whl")), next(dist.glob("*.tar.gz")), tmp


def test_the_wheel_ships_the_kernel_source_the_cupy_backend_compiles(built):
    wheel, _, tmp = built
    assert "vllm_omni_kernels/kernels/vok_kernels.cuh" in zipfile.ZipFile(wheel).namelist()
    site = tmp / "site"
    zipfile.ZipFile(wheel).extractall(site)  # (what pip install --target puts there, but the scripts)
    # the installed copy, imported from outside the checkout, finds its source where it looks for it
    code = ("import sys; from vllm_omni_kernels.ops import cupy_nvrtc as c; "
            "print(c.__file__); print((c._source_dir() / c._SOURCE).is_file())")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_KERNELS_SOURCES"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp, env={**env, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(site)) and out[1] == "True", out


def test_the_sdist_holds_what_builds_the_extension_and_no_part_of_the_tests(built):
    _, sdist, _ = built
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    assert {"CMakeLists.txt", "setup.py", "vllm_omni_kernels/kernels/vok_kernels.cuh",
            "vllm_omni_kernels/kernels/vok_torch.cu"} <= names
    assert not [name for name in names if name.startswith("tests/")]  # (setuptools' default: test_*.py, no helpers)


def test_a_command_that_runs_on_vllm_says_so_without_it(tmp_path):
    code = """if True:
        import sys
        sys.modules["vllm"] = None  # (as when the vllm extra is not installed)
        from vllm_omni_kernels.cli import main
        for args in (["simulate", "--no-progress"], ["make-model", "somewhere"], ["serve", "model"]):
            try:
                rc = main(args)
            except SystemExit as exc:  # (argparse's error)
                rc = exc.code
            print(args[0], rc, file=sys.stderr)
    """
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    said = run.stderr.splitlines()
    assert run.returncode == 0 and [line for line in said if line.endswith((" 2", " 0", " 1"))] == \
        ["simulate 2", "make-model 2", "serve 2"], run.stderr[-2000:]
    assert sum("pip install 'vllm-omni-kernels[vllm]'" in line for line in said) == 3 and "Traceback" not in run.stderr
    assert not (tmp_path / "somewhere").exists()
