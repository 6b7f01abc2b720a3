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
_ENV = "VLLM_OMNI_KERNELS_BACKEND"


class BackendUnavailableError(RuntimeError):
    """The backend named in the environment cannot run here."""


# Every launch asks for its backend, and os.environ.get costs microseconds (a missed key raises and
# catches inside the Mapping); on POSIX CPython the environment's bytes live in a dict that setenv
# and monkeypatch update in place, so one dict lookup reads the setting.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENV_KEY = _ENV.encode()


# ``_raw()`` is the setting's raw value: the same object while the setting is unchanged (a new one
# after setenv, even of the same text), which is what ops.setting() promises.
if _ENV_BYTES is not None:
    _raw = functools.partial(_ENV_BYTES.get, _ENV_KEY)  # a C call: no Python frame
else:
    def _raw() -> bytes | str | None:
        return os.environ.get(_ENV)


def requested() -> str:
    return _parse(_raw())


@functools.cache
def _parse(raw: bytes | str | None) -> str:
    if raw is None:
        return "auto"
    value = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw).strip().lower() or "auto"
    if value not in BACKENDS:
        raise BackendUnavailableError(f"{_ENV}={value!r} is not one of {BACKENDS}")
    return value


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _availability() -> dict[str, str | None]:
    """backend -> None when usable on CUDA tensors, else the reason it is not."""
    from .ops import cuda_ext, cupy_nvrtc

    reasons: dict[str, str | None] = {}
    reasons["cuda"] = cuda_ext.load()
    reasons["cupy"] = cupy_nvrtc.load()
    if importlib.util.find_spec("triton") is None:
        reasons["triton"] = "triton is not installed (pip install 'vllm-omni-kernels[triton]')"
    elif not torch.cuda.is_available() and not triton_interpreted():
        reasons["triton"] = "no CUDA device (set TRITON_INTERPRET=1 to run Triton kernels on CPU)"
    else:
        reasons["triton"] = None
    reasons["torch"] = None
    return reasons


def select(device: torch.device) -> tuple[str, str]:
    """(backend, why) for tensors on ``device``.

    The environment is read on every call (tests switch backends); the decision is cached per
    (setting, device type), since every kernel launch asks.

    Raises:
        BackendUnavailableError: the environment names a backend that cannot run here.
    """
    return _decide(_raw(), device.type)


def name_for(is_cuda: bool) -> str:
    """``select``'s backend name for a CUDA (True) or CPU (False) tensor, for launch paths: a
    tensor's ``is_cuda`` is much cheaper than its ``device.type``."""
    return _decide(_raw(), "cuda" if is_cuda else "cpu")[0]


@functools.cache
def _decide(raw: bytes | str | None, device_type: str) -> tuple[str, str]:
    return _select(_parse(raw), device_type)


def _select(want: str, device_type: str) -> tuple[str, str]:
    avail = _availability()
    if want != "auto":
        if want == "torch":
            return "torch", f"{_ENV}=torch"
        if want == "triton" and device_type == "cpu" and not triton_interpreted():
            raise BackendUnavailableError(f"{_ENV}=triton on CPU tensors needs TRITON_INTERPRET=1")
        if avail[want] is not None:
            raise BackendUnavailableError(f"{_ENV}={want} but {avail[want]}")
        return want, f"{_ENV}={want}"
    if device_type != "cuda":
        return "torch", f"auto: {device_type} tensors use the torch reference"
    for name in ("cuda", "cupy", "triton"):
        if avail[name] is None:
            return name, f"auto: first available for CUDA ({', '.join(f'{k}: {v}' for k, v in avail.items() if v and k != 'torch') or 'all available'})"
    return "torch", f"auto: no kernel backend available ({avail})"


OPS = ("ring_write", "ring_read", "row_gather")
KERNEL_BACKENDS = ("triton", "cuda", "cupy")


def kernel_backends() -> list[str]:
    """The kernel backends that can run here, in the benchmarks' order (triton, cuda = the compiled
    extension, cupy = the same sources through NVRTC)."""
    avail = _availability()
    return [name for name in KERNEL_BACKENDS if avail[name] is None]


def describe() -> dict[str, dict]:
    """One call that says which backend each op uses on each device class, and why, plus every
    backend's availability, and ``programmatic_launch``: whether the compiled and Triton kernels
    launch with programmatic dependent launch on Hopper and newer (``ops/pdl.py``). Every backend
    implements every op, so the choice is per device."""
    out: dict[str, dict] = {"requested": {"value": requested()}, "availability": {
        k: ("available" if v is None else v) for k, v in _availability().items()}}
    from .ops import pdl

    out["programmatic_launch"] = pdl.enabled()  # compiled and Triton launches, on Hopper and newer
    for dev in ("cpu", "cuda"):
        try:
            name, why = select(torch.device(dev))
            out[dev] = {op: {"backend": name, "why": why} for op in OPS}
        except BackendUnavailableError as exc:
            out[dev] = {op: {"backend": "error", "why": str(exc)} for op in OPS}
    return out
