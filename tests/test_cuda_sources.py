"""The CUDA C++ sources compile (CPU CI: nvcc and cmake are present, no GPU needed).

A syntax or template error in kernels/ fails here: the kernel header is compiled to PTX for
compute_90 and SASS for sm_90a with every entry point checked, and the CMake project configures and
builds the torch extension (host and device code).
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
ENTRY_POINTS = [f"vok_ring_{op}_e{s}_{k}" for op in ("write", "read") for s in (2, 4, 8) for k in ("dim0", "last")] + \
    [f"vok_row_gather_e{s}_a{a}" for s in (2, 4) for a in (0, 1)]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@needs_nvcc
def test_kernel_header_compiles_to_ptx_and_sass_with_every_entry_point(tmp_path):
    src = tmp_path / "all.cu"
    src.write_text(f'#include "{KERNELS / "vok_kernels.cuh"}"\n')
    subprocess.run(["nvcc", "-std=c++17", "-ptx", "-arch=compute_90", str(src), "-o", str(tmp_path / "k.ptx")],
                   check=True, capture_output=True, text=True)
    ptx = (tmp_path / "k.ptx").read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert set(ENTRY_POINTS) <= entries, set(ENTRY_POINTS) - entries
    subprocess.run(["nvcc", "-std=c++17", "-cubin", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                   check=True, capture_output=True, text=True)


@needs_nvcc
@pytest.mark.skipif(shutil.which("cmake") is None or torch.version.cuda is None, reason="cmake or CUDA torch missing")
def test_cmake_configures_and_builds_the_torch_extension(tmp_path):
    build = tmp_path / "build"
    run = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "arch=compute_90a,code=sm_90a" in run.stdout and "code=compute_90" in run.stdout
    run = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lib = build / "_vok_ops.so"
    assert lib.is_file()
    # The library registers its ops with the dispatcher (loading needs no GPU).
    code = (f"import torch; torch.ops.load_library({str(lib)!r}); "
            "print(torch.ops.vllm_omni_kernels.ring_write.default._schema)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "Tensor(a!) arena" in out.stdout, out.stderr[-2000:]
