"""Test set-up: on machines without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before triton decorates the kernels, so it is set here, at import.
Fixtures give each test the backends it should compare against the torch reference.
"""

import importlib.util
import os
import signal
import sys
import zlib
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# vLLM's own platform, for the engines the tests start (their executor puts the talker on the device
# it is given); inherited by the engine-core processes vLLM spawns.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# A test that hangs (a stream waiting for an output that never comes) fails after this many seconds,
# with the traceback of where it waited, instead of holding CI until it is killed.
TEST_LIMIT_S = int(os.environ.get("VOK_TEST_LIMIT_S", "300"))
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


class RanTooLong(BaseException):
    """Raised in a test that passed ``TEST_LIMIT_S`` (not an ``Exception``: the code under test
    catches none of it on the way out, a ``TimeoutError`` of its own included)."""


@pytest.fixture(autouse=True)
def _hang_guard():
    def expired(signum, frame):
        raise RanTooLong(f"the test ran past {TEST_LIMIT_S} s (VOK_TEST_LIMIT_S)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def use_backend(monkeypatch):
    """Call with a backend name to route every op through it for the rest of the test."""

    def _use(name: str) -> None:
        monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", name)

    return _use


def random_tensor(shape, dtype, device="cpu", generator=None):
    """Values that are never all zero, so an unwritten output cannot pass for a written one."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=torch.float32).to(dtype).to(device)
    return torch.randint(-(2**30), 2**30, shape, generator=generator, dtype=torch.int64).to(dtype).to(device)


def stable_seed(*parts) -> int:
    """A seed from a test's parameters that is the same in every process (``hash()`` of a string is
    randomised per process, so a failing case could not be replayed)."""
    return zlib.crc32(repr(tuple(str(p) for p in parts)).encode())


def profiling_script(name: str):
    """``profiling/<name>.py`` imported as module ``name`` (the scripts are not a package, and the
    tests put nothing of theirs on ``sys.path``)."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "profiling" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # (its dataclasses look their module up while it runs)
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
