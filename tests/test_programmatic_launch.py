"""Programmatic dependent launch (``ops/pdl.py``): the one setting, and the Triton kernels' wait.

The CUDA C++ kernels' PTX is checked in ``test_cuda_sources.py``; here the Triton kernels are
compiled for sm_90 (no GPU needed) with and without ``PDL``. The GPU tests run every backend with
the setting on and off (``test_gpu_backends.py``).
"""

import os
import subprocess
import sys

import pytest
import torch

from ptx_checks import waits_before_memory
from vllm_omni_kernels import backend, ops
from vllm_omni_kernels.ops import pdl


@pytest.mark.parametrize("env, want", [(None, True), ("1", True), ("0", False)])
def test_the_setting_is_on_unless_the_environment_turns_it_off(env, want):
    code = ("from vllm_omni_kernels.ops import pdl; from vllm_omni_kernels import ops; a = pdl.enabled(); "
            "ops.set_programmatic_launch(not a); print(a, pdl.enabled())")
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_OMNI_KERNELS_PDL"}
    if env is not None:
        environ["VLLM_OMNI_KERNELS_PDL"] = env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(want), str(not want)]


def test_cpu_tensors_never_launch_with_it_and_the_report_names_the_setting():
    assert not pdl.for_tensor(torch.zeros(1))
    assert backend.describe()["programmatic_launch"] is pdl.enabled()
    ops.set_programmatic_launch(False)
    try:
        assert backend.describe()["programmatic_launch"] is False
    finally:
        ops.set_programmatic_launch(True)


def test_the_triton_launcher_keys_tensors_by_dtype_and_address_bits_and_goes_through_the_interpreter_here():
    """``ops/triton_launch.py``: what selects a kernel is a tensor's dtype and the low 8 bits of
    its address and any other argument's type and value; under the interpreter (these tests) every
    launch goes through ``kernel[grid]``."""
    from vllm_omni_kernels.ops import triton_launch, triton_ring

    t = torch.zeros(64)
    assert [triton_launch._spec(t[k:]) for k in (0, 1, 2, 4)] == [
        (torch.float32, (t.data_ptr() + 4 * k) % 256) for k in (0, 1, 2, 4)]
    assert triton_launch._spec(1) != triton_launch._spec(True) and triton_launch._spec(16) == (int, 16)
    assert not triton_ring._write.direct


# Compiled in a fresh process: under TRITON_INTERPRET (set for these tests) kernels do not compile.
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from vllm_omni_kernels.ops.triton_gather import BLOCK_I, _row_gather_kernel
from vllm_omni_kernels.ops.triton_ring import _ring_read_kernel, _ring_write_kernel

on = sys.argv[1] == "1"
ring = {"LAST": True, "MONO": True, "BLOCK": 1024, "PDL": on}
kernels = {
    "ring_write": (_ring_write_kernel, {"arena_ptr": "*fp32", "state_ptr": "*i64", "meta_ptr": "*i64",
                                        "src_ptr": "*fp32", "F": "i64"}, ring | {"SINGLE": False}),
    "ring_read": (_ring_read_kernel, {"arena_ptr": "*fp32", "meta_ptr": "*i64", "out_ptr": "*fp32", "F": "i64"}, ring),
    "gather": (_row_gather_kernel, {"fbase": "*bf16", "ibase": "*i32", "table": "*i64", "W": "i64"},
               {"BLOCK_F": 2048, "BLOCK_I": BLOCK_I, "ALIGN": 8, "PDL": on}),
}
out = {}
for name, (fn, args, consts) in kernels.items():
    src = triton.compiler.ASTSource(fn=fn, signature=args | {k: "constexpr" for k in consts}, constexprs=consts)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print(json.dumps(out))
"""


@pytest.mark.parametrize("on", [True, False], ids=["pdl", "no_pdl"])
def test_triton_kernels_wait_for_the_kernel_before_them_before_touching_memory(on):
    """Compiled for sm_90 with ``PDL``, each kernel waits (``griddepcontrol.wait``) before its first
    global access; the ring kernels also let the next kernel start (after their loads), the gather
    does not. Without ``PDL`` neither instruction is there."""
    pytest.importorskip("triton")
    import json

    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, "1" if on else "0"], capture_output=True, text=True,
                         env=environ)
    assert run.returncode == 0, run.stderr[-3000:]
    for name, ptx in json.loads(run.stdout.splitlines()[-1]).items():
        triggers = "griddepcontrol.launch_dependents" in ptx
        if on:
            assert waits_before_memory(ptx), name
            assert triggers is (name != "gather"), name
        else:
            assert "griddepcontrol.wait" not in ptx and not triggers, name
