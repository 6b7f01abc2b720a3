"""The CUDA C++ sources compile (CPU CI: nvcc and cmake are present, no GPU needed).

A syntax or template error in vllm_omni_kernels/kernels/ fails here: the kernel header is compiled to PTX for
compute_90 and SASS for sm_90a with the definitions of ``ops/layout.py`` (and refuses to compile
without them), every entry point is there and waits for the kernel before it, and the CMake project
configures and builds the torch extension, whose op schemas say what each op writes.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ptx_checks import waits_before_memory
from vllm_omni_kernels.ops.layout import cuda_defines

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "vllm_omni_kernels" / "kernels"
ENTRY_POINTS = [f"vok_ring_{op}_e{s}" for op in ("write", "read") for s in (1, 2, 4, 8)] + \
    [f"vok_row_gather_e{s}_a{a}" for s in (2, 4) for a in (0, 1)]

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@needs_nvcc
def test_kernel_header_compiles_to_ptx_and_sass_with_every_entry_point(tmp_path):
    src = tmp_path / "all.cu"
    src.write_text(f'#include "{KERNELS / "vok_kernels.cuh"}"\n')
    nvcc = ["nvcc", "-std=c++17", *cuda_defines(), str(src)]
    subprocess.run([*nvcc, "-ptx", "-arch=compute_90", "-o", str(tmp_path / "k.ptx")],
                   check=True, capture_output=True, text=True)
    ptx = (tmp_path / "k.ptx").read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert entries == set(ENTRY_POINTS), entries ^ set(ENTRY_POINTS)  # one entry per element size (and alignment)
    subprocess.run([*nvcc, "-cubin", "-arch=sm_90a", "-o", str(tmp_path / "k.cubin")],
                   check=True, capture_output=True, text=True)
    # Launched with programmatic dependent launch, a kernel may start before the one ahead of it
    # ends: every entry waits for it before its first access to memory.
    for name, body in re.findall(r"\.entry\s+(\w+)(.*?)\n}", ptx, re.S):
        assert waits_before_memory(body), f"{name} touches memory before griddepcontrol.wait"


@needs_nvcc
def test_the_header_refuses_to_compile_without_the_layout_definitions(tmp_path):
    src = tmp_path / "all.cu"
    src.write_text(f'#include "{KERNELS / "vok_kernels.cuh"}"\n')
    run = subprocess.run(["nvcc", "-std=c++17", "-ptx", "-arch=compute_90", str(src), "-o", str(tmp_path / "k.ptx")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "vllm_omni_kernels.ops.layout" in run.stderr + run.stdout


def test_the_layout_module_prints_the_definitions_cmake_compiles_with():
    out = subprocess.run([sys.executable, "-m", "vllm_omni_kernels.ops.layout"], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.split() == cuda_defines() and "-DVOK_HEAD_SHIFT=24" in out.stdout


needs_cmake = pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None
                                 or torch.version.cuda is None, reason="nvcc, cmake or a CUDA torch missing")


@pytest.fixture(scope="module")
def cmake_build(tmp_path_factory):
    """Configure and build the extension once for this module, with the project's architectures (a
    host's own ``TORCH_CUDA_ARCH_LIST`` would replace them): (configure stdout, library path)."""
    build = tmp_path_factory.mktemp("build")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    run = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DPython3_EXECUTABLE={sys.executable}"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    configure = run.stdout
    run = subprocess.run(["cmake", "--build", str(build), "-j", "2"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return configure, build / "_vok_ops.so"


@needs_cmake
def test_cmake_builds_the_torch_ops_with_schemas_that_say_what_they_write(cmake_build):
    configure, lib = cmake_build
    flags = [line for line in configure.splitlines() if "NVCC flags" in line]  # (torch's CMake config says them)
    assert "arch=compute_90a,code=sm_90a" in configure and "code=compute_90" in configure, flags
    code = ("import torch; torch.ops.load_library(%r); ops = torch.ops.vllm_omni_kernels; "
            "print(ops.ring_write.default._schema); print(ops.ring_read.default._schema); "
            "print(ops.row_gather.default._schema)" % str(lib))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    write, read, gather = out.stdout.strip().splitlines()
    assert "Tensor(a!) arena, Tensor(b!) state, Tensor meta, Tensor src" in write
    assert "Tensor arena, Tensor meta, Tensor(a!) out" in read
    assert "Tensor base, Tensor table, Tensor(a!)[] outputs" in gather


@needs_cmake
@pytest.mark.parametrize("env", [None, "0"])
def test_the_library_loads_and_takes_the_programmatic_launch_setting(cmake_build, env):
    code = ("import torch; torch.ops.load_library(%r); "
            "torch.ops.vllm_omni_kernels.set_programmatic_launch(False); print('ok')" % str(cmake_build[1]))
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_KERNELS_PDL"}
    if env is not None:
        environ["VLLM_OMNI_KERNELS_PDL"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environ)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
