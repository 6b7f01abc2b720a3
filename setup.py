"""Package build. Metadata lives in pyproject.toml; this file drives the CUDA extension build.

When torch with CUDA and nvcc are both importable/findable at build time (``pip install
--no-build-isolation -e .``, or ``python setup.py build_ext --inplace``), CMakeLists.txt builds
``vllm_omni_kernels/_vok_ops*.so`` (a Python module with torch custom ops, from vllm_omni_kernels/kernels/).
Otherwise, including pip's default isolated build where torch is absent, the package installs as
pure Python and the CUDA ops come from CuPy/NVRTC or Triton at run time.
``VLLM_OMNI_KERNELS_BUILD_EXT=0`` skips the build; ``=1`` makes a failed build an error instead of a
warning.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _why_not_build() -> str | None:
    if os.environ.get("VLLM_OMNI_KERNELS_BUILD_EXT") == "0":
        return "VLLM_OMNI_KERNELS_BUILD_EXT=0"
    if shutil.which("cmake") is None:
        return "cmake not found"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found"
    try:
        import torch
    except ImportError:
        return "torch not importable at build time (use --no-build-isolation)"
    if torch.version.cuda is None:
        return "torch is built without CUDA"
    return None


class CMakeBuild(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except subprocess.CalledProcessError as exc:
            if os.environ.get("VLLM_OMNI_KERNELS_BUILD_EXT") == "1":
                raise
            print(f"vllm-omni-kernels: CUDA extension build failed ({exc}); installing without it")
            self.extensions = []  # nothing to install: the package runs on CuPy/Triton/torch

    def build_extension(self, ext: Extension) -> None:
        build = Path(self.build_temp) / "cmake"
        build.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}",
                        "-DCMAKE_BUILD_TYPE=Release"], check=True)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True)
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "_vok_ops.so", target)


_WHY_NOT = _why_not_build()
if _WHY_NOT is not None:
    print(f"vllm-omni-kernels: not building the CUDA extension ({_WHY_NOT})")
setup(ext_modules=[] if _WHY_NOT else [Extension("vllm_omni_kernels._vok_ops", sources=[])],
      cmdclass={"build_ext": CMakeBuild})
