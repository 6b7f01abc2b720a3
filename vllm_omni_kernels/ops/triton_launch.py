"""Launching a Triton kernel without Triton's per-call dispatch: ``Launcher``; and the kernels' grid
dependency control (programmatic dependent launch: ``pdl.py``).

``kernel[grid](...)`` binds and specializes every argument, builds its cache key and checks the
kernel's globals on every call: 33 to 42 µs of host time per launch on the H200's host, against 8.5
to 10.6 µs for launching the compiled kernel itself (7 for the compiled extension's op). A
``Launcher`` asks Triton for the compiled kernel once per specialization (``JITFunction.warmup``:
Triton's own binding, cache and compilation) and from then on launches that ``CompiledKernel``
directly, on the current stream as Triton does.

Its cache key is finer than anything Triton specializes on: the current device, each tensor's
dtype and the low 8 bits of its address (Triton looks at divisibility by 16), every other argument
by type and value (``_spec``), and the constexprs and launch options by name and value. A call
therefore never reuses a kernel that Triton would not have chosen for it. Triton's runtime knobs
(``TRITON_DEBUG``, instrumentation) apply as they were at a specialization's first launch. Under
the interpreter (``TRITON_INTERPRET=1``) the kernel is an ``InterpretedFunction`` and every call
goes through ``kernel[grid]``.

``wait_previous_grid()``: wait for the kernel ahead of this one in the stream to finish and its
writes to be visible; ``launch_dependents()``: let the next kernel be scheduled now. Both are
Hopper instructions, used only under a ``PDL`` constexpr that is false on other devices and under
the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import driver
from triton.runtime.jit import JITFunction

_ALIGN_BITS = 255  # the address bits a key holds: alignment classes up to 256 bytes


def _spec(arg):
    """What of one positional argument may select a kernel: a tensor's dtype and the low bits of
    its address, anything else its type and value."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & _ALIGN_BITS
    return type(arg), arg


class Launcher:
    """``launcher(grid, *args, **kwargs)`` does what ``kernel[grid](*args, **kwargs)`` does.

    ``args``: the kernel's leading parameters, positionally; ``kwargs``: every other parameter
    (its constexprs) and Triton's launch options (``num_warps``, ``launch_pdl``, ...), by name.
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.direct = isinstance(kernel, JITFunction)
        self._params = [p.name for p in kernel.params] if self.direct else []
        self._compiled: dict[tuple, tuple] = {}  # key -> (CompiledKernel, the constexpr values in the kernel's order)

    def __call__(self, grid: tuple[int, ...], *args, **kwargs) -> None:
        if not self.direct:
            self.kernel[grid](*args, **kwargs)
            return
        key = (driver.active.get_current_device(), *map(_spec, args), *kwargs.items())
        found = self._compiled.get(key)
        if found is None:
            rest = self._params[len(args):]
            missing = set(rest) - kwargs.keys()
            if missing:  # the compiled kernel takes every parameter, defaults included
                raise TypeError(f"{self.kernel.__name__}: pass {sorted(missing)} by name")
            compiled = self.kernel.warmup(*args, grid=grid, **kwargs)
            found = self._compiled[key] = (compiled, tuple(kwargs[name] for name in rest))
        compiled, constexprs = found
        compiled[(*grid, 1, 1)[:3]](*args, *constexprs)


@triton.jit
def wait_previous_grid():
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)
