"""Grid dependency control for the Triton kernels (programmatic dependent launch: ``pdl.py``).

``wait_previous_grid()``: wait for the kernel ahead of this one in the stream to finish and its
writes to be visible; ``launch_dependents()``: let the next kernel be scheduled now. Both are
Hopper instructions, used only under a ``PDL`` constexpr that is false on other devices and under
the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_previous_grid():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)
