"""Checks on PTX text shared by the CUDA and Triton kernel tests."""

from __future__ import annotations

MEMORY_OPS = ("ld.global", "st.global", "atom.")


def waits_before_memory(body: str) -> bool:
    """Whether a kernel's PTX runs ``griddepcontrol.wait`` before its first global memory access
    (what programmatic dependent launch requires of a kernel that may start early)."""
    wait = body.find("griddepcontrol.wait")
    first_access = min((i for i in (body.find(op) for op in MEMORY_OPS) if i >= 0), default=len(body))
    return 0 <= wait < first_access
