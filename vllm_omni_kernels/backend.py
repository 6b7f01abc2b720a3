"""Backend selection for the kernel ops.

``VLLM_OMNI_KERNELS_BACKEND=auto|cuda|cupy|triton|torch`` (default auto). For CPU tensors every op
uses the torch reference, except that ``triton`` with ``TRITON_INTERPRET=1`` runs the Triton kernels
on the CPU (that is how CI tests them). For CUDA tensors ``auto`` takes the first available of
cuda (the compiled extension), cupy (the same sources through NVRTC), triton, torch.
``describe()`` reports the choice per device and why.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "cuda", "cupy", "triton", "torch")
KERNEL_BACKENDS = ("triton", "cuda", "cupy")
OPS = ("ring_write", "ring_read", "row_gather")
_ENV = "VLLM_OMNI_KERNELS_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The backend named in the environment cannot run here."""


def requested() -> str:
    return _parse(os.environ.get(_ENV))


@functools.cache
def _parse(raw: str | None) -> str:
    value = (raw or "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise BackendUnavailableError(f"{_ENV}={value!r} is not one of {BACKENDS}")
    return value


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _availability() -> dict[str, str | None]:
    """backend -> None when usable on CUDA tensors, else the reason it is not."""
    from .ops import cuda_ext, cupy_nvrtc

    reasons: dict[str, str | None] = {"cuda": cuda_ext.load(), "cupy": cupy_nvrtc.load()}
    if importlib.util.find_spec("triton") is None:
        reasons["triton"] = "triton is not installed (pip install 'vllm-omni-kernels[triton]')"
    elif not torch.cuda.is_available() and not triton_interpreted():
        reasons["triton"] = "no CUDA device (set TRITON_INTERPRET=1 to run Triton kernels on CPU)"
    else:
        reasons["triton"] = None
    reasons["torch"] = None
    return reasons


def select(device: torch.device) -> tuple[str, str]:
    """(backend, why) for tensors on ``device``. The environment is read on every call (tests and
    benchmarks switch backends); the decision is cached per (setting, device type).

    Raises:
        BackendUnavailableError: the environment names a backend that cannot run here.
    """
    return _decide(os.environ.get(_ENV), device.type)


def name_for(is_cuda: bool) -> str:
    """``select``'s backend name for a CUDA (True) or CPU (False) tensor."""
    return _decide(os.environ.get(_ENV), "cuda" if is_cuda else "cpu")[0]


@functools.cache
def _decide(raw: str | None, device_type: str) -> tuple[str, str]:
    want, avail = _parse(raw), _availability()
    if want != "auto":
        if want == "torch":
            return "torch", f"{_ENV}=torch"
        if want in ("cuda", "cupy") and device_type != "cuda":  # (their kernels read device memory only)
            return "torch", f"{_ENV}={want} runs CUDA tensors; {device_type} tensors use the torch reference"
        if want == "triton" and device_type == "cpu" and not triton_interpreted():
            raise BackendUnavailableError(f"{_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1")
        if avail[want] is not None:
            raise BackendUnavailableError(f"{_ENV}={want} but {avail[want]}")
        return want, f"{_ENV}={want}"
    if device_type != "cuda":
        return "torch", f"auto: {device_type} tensors use the torch reference"
    for name in ("cuda", "cupy", "triton"):
        if avail[name] is None:
            missing = ", ".join(f"{k}: {v}" for k, v in avail.items() if v and k != "torch")
            return name, f"auto: first available for CUDA ({missing or 'all available'})"
    reasons = "; ".join(f"{k}: {v}" for k, v in avail.items() if v)
    return "torch", f"auto: no kernel backend available ({reasons})"


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA device without an index is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(device: torch.device):
    """A test of whether a tensor is on ``device`` (CUDA with an index, or the CPU), made once by its
    owner: hot paths call it per tensor without making a ``torch.device`` per call. The type is
    checked with the index, as a meta tensor's index (-1) is a CPU tensor's."""
    if device.type == "cuda":
        index = resolve_device(device).index
        return lambda t: t.is_cuda and t.get_device() == index
    if device.type == "cpu":
        return lambda t: t.is_cpu
    return lambda t: t.device == device


def kernel_backends() -> list[str]:
    """The kernel backends that can run here, in the benchmarks' order."""
    avail = _availability()
    return [name for name in KERNEL_BACKENDS if avail[name] is None]


def describe() -> dict[str, dict]:
    """Which backend each op uses on each device class, and why; every backend's availability; and
    ``programmatic_launch``: whether the compiled and Triton kernels launch with programmatic
    dependent launch on Hopper and newer (``ops/pdl.py``)."""
    from .ops import pdl

    out: dict[str, dict] = {"requested": {"value": requested()}, "availability": {
        k: ("available" if v is None else v) for k, v in _availability().items()}, "programmatic_launch": pdl.enabled()}
    for dev in ("cpu", "cuda"):
        try:
            name, why = select(torch.device(dev))
            out[dev] = {op: {"backend": name, "why": why} for op in OPS}
        except BackendUnavailableError as exc:
            out[dev] = {op: {"backend": "error", "why": str(exc)} for op in OPS}
    return out
