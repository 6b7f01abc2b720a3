"""Backend selection: the auto order (compiled, CuPy, Triton, torch), explicit requests, the report."""

import pytest
import torch

from vllm_omni_kernels import backend


@pytest.fixture
def availability(monkeypatch):
    """Pretend a given set of backends is available (reasons for the others)."""

    def _set(**reasons):
        full = {"cuda": "not built", "cupy": "not installed", "triton": "not installed", "torch": None}
        full.update(reasons)
        monkeypatch.setattr(backend, "_availability", lambda: full)
        backend._decide.cache_clear()

    yield _set
    backend._decide.cache_clear()


@pytest.mark.parametrize("available, chosen", [
    ({"cuda": None, "cupy": None, "triton": None}, "cuda"),
    ({"cupy": None, "triton": None}, "cupy"),
    ({"triton": None}, "triton"),
    ({}, "torch"),
])
def test_auto_takes_the_first_available_in_order(availability, monkeypatch, available, chosen):
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "auto")
    availability(**available)
    name, why = backend.select(torch.device("cuda"))
    assert name == chosen
    assert why.startswith("auto")
    assert backend.select(torch.device("cpu"))[0] == "torch"  # CPU tensors: the reference


def test_explicit_request_of_an_unavailable_backend_says_why(availability, monkeypatch):
    availability(triton=None)
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "cuda")
    with pytest.raises(backend.BackendUnavailableError, match="not built"):
        backend.select(torch.device("cuda"))
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "cupy")
    with pytest.raises(backend.BackendUnavailableError, match="not installed"):
        backend.select(torch.device("cuda"))


@pytest.mark.parametrize("requested", ["cuda", "cupy"])
def test_a_backend_of_cuda_kernels_leaves_cpu_tensors_to_the_reference(availability, monkeypatch, requested):
    """The compiled and CuPy kernels read device memory only: asked for by name, they run the CUDA
    tensors, and CPU tensors (the frontend's accumulator, say) still take the torch reference."""
    availability(cuda=None, cupy=None)
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", requested)
    assert backend.select(torch.device("cuda"))[0] == requested
    name, why = backend.select(torch.device("cpu"))
    assert name == "torch" and "reference" in why


def test_every_change_of_the_setting_reaches_the_next_launch(availability, monkeypatch):
    """Launches read the setting through a cached fast path; set, changed and removed values all count."""
    availability(triton=None)
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "torch")
    assert backend.name_for(True) == "torch"
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", " Triton ")
    assert backend.name_for(True) == "triton" and backend.requested() == "triton"
    monkeypatch.delenv("VLLM_OMNI_KERNELS_BACKEND")
    assert backend.requested() == "auto" and backend.name_for(True) == "triton"
    assert backend.name_for(False) == "torch"


def test_unknown_backend_name_is_rejected(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "opencl")
    with pytest.raises(backend.BackendUnavailableError, match="opencl"):
        backend.requested()


def test_report_gives_every_op_its_backend_and_reason(availability, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "auto")
    availability(cupy=None)
    report = backend.describe()
    assert report["availability"]["cuda"] == "not built" and report["availability"]["cupy"] == "available"
    for op in backend.OPS:
        assert report["cuda"][op]["backend"] == "cupy" and report["cuda"][op]["why"]
        assert report["cpu"][op]["backend"] == "torch"


def test_real_availability_on_this_machine_has_a_reason_for_each_missing_backend():
    for name, why in backend._availability().items():
        assert why is None or isinstance(why, str) and why


def test_kernel_backends_lists_the_available_ones_in_order(availability):
    availability(cupy=None, triton=None)
    assert backend.kernel_backends() == ["triton", "cupy"]
