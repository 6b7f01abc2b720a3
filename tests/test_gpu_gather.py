"""The fused gather and the phase runner on CUDA (marker gpu; run on the H200 with ``pytest -m gpu``)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gather_cases import check_gather_case
from phase_fakes import FakeRunner, FakeTalker
from test_gather_ops import check_negated_sources
from test_phase_routing import MIXED, PROMPTS, check_step
from vllm_omni_kernels.ring.graph import capture
from vllm_omni_kernels.gather import RowGather

pytestmark = pytest.mark.gpu
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("width", [1, 8, 300, 2048, 4096, 16384])
def test_cuda_gather_matches_reference(dtype, width, monkeypatch):
    for seed in range(4):
        check_gather_case(seed, dtype, width, "cuda", "triton", monkeypatch)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOATS), width=st.integers(1, 5000))
def test_cuda_gather_property(seed, dtype, width):
    with pytest.MonkeyPatch.context() as mp:
        check_gather_case(seed, dtype, width, "cuda", "triton", mp)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("mtp", [True, False])
@pytest.mark.parametrize("order", sorted(MIXED))
def test_cuda_runner_step_matches_contract(dtype, mtp, order, use_backend):
    use_backend("auto")
    runner = FakeRunner(FakeTalker(64, dtype, mtp=mtp), device="cuda")
    for rid, p in PROMPTS.items():
        runner.add_request(rid, p)
    check_step(runner, MIXED[order])
    assert runner._omni_gather.launches == (2 if mtp else 1)


def test_cuda_gather_graph_replay_with_changing_offsets(use_backend):
    use_backend("auto")
    h, rows = 4096, 64
    dst = torch.zeros(256, h, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(256, dtype=torch.int32, device="cuda")
    src = torch.randn(rows, h, device="cuda").bfloat16()
    src_ids = torch.arange(rows, device="cuda", dtype=torch.int64) + 100
    gather = RowGather(torch.bfloat16, h, "cuda", max_float_rows=rows, max_int_rows=rows)
    rng = np.random.default_rng(0)

    def record(offsets):
        gather.jobs.rows(dst, offsets, src)
        gather.jobs.ints(ids.view(-1, 1), offsets, src_ids.view(-1, 1))

    record(np.arange(rows))
    gather.prepare_static()
    graph = capture(lambda: gather.run_static(2 * rows))  # its warm-up run is outside the capture
    for step in range(20):
        n = rows if step % 2 else int(rng.integers(1, rows))
        offsets = rng.permutation(256)[:n]
        gather.jobs.clear()
        dst.zero_()
        ids.zero_()
        gather.jobs.rows(dst, offsets, src[:n])
        gather.jobs.ints(ids.view(-1, 1), offsets, src_ids[:n].view(-1, 1))
        gather.prepare_static()
        graph.replay()
        torch.cuda.synchronize()
        want = torch.zeros_like(dst)
        want[torch.from_numpy(offsets).cuda()] = src[:n]
        assert torch.equal(dst, want), step
        want_ids = torch.zeros_like(ids)
        want_ids[torch.from_numpy(offsets).cuda()] = src_ids[:n].int()
        assert torch.equal(ids, want_ids), step


def test_cuda_runner_step_makes_no_host_sync_and_no_allocation_in_the_gather(use_backend):
    use_backend("auto")
    h, rows = 256, 32
    gather = RowGather(torch.bfloat16, h, "cuda", max_float_rows=2 * rows, max_int_rows=rows, max_values=rows)
    dst = torch.zeros(rows, h, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(rows, h, device="cuda").bfloat16()
    flags = torch.zeros(rows, dtype=torch.int32, device="cuda")

    def step():
        gather.jobs.rows(dst, np.arange(rows)[::-1].copy(), src)
        gather.jobs.values(flags, np.ones(rows, np.int32))
        gather.launch()

    step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert torch.equal(dst, src.flip(0)) and (flags == 1).all()


@pytest.mark.parametrize("backend", ["cuda", "triton", "cupy"])
def test_eager_tables_are_reused_only_after_their_launches_ran(backend, use_backend):
    """Far more eager launches than the staging ring has tables, queued behind long work, each
    copying other rows: every table is read before it is rewritten (the host waits on an event when
    the device is a ring behind), so every launch's rows arrive."""
    from vllm_omni_kernels.backend import kernel_backends

    if backend not in kernel_backends():
        pytest.skip(f"{backend} is not available here")
    use_backend(backend)
    launches, h = 100, 256
    src = torch.randn(launches, h, device="cuda")
    dst = torch.zeros(launches, h, device="cuda")
    ids = torch.zeros(launches, dtype=torch.int64, device="cuda")
    gather = RowGather(torch.float32, h, "cuda", max_float_rows=1, max_int_rows=1)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(8):  # tens of milliseconds of work ahead of the launches
        busy = busy @ busy / 64
    for i in range(launches):
        gather.jobs.rows(dst, i, src, i)
        gather.jobs.ints(ids, i, torch.full((1,), i + 7, device="cuda"))
        assert gather.launch() == 1
    torch.cuda.synchronize()
    assert torch.equal(dst, src) and torch.equal(ids, torch.arange(launches, device="cuda") + 7)


def test_cuda_gather_copies_lazily_negated_sources_as_their_values(use_backend):
    """``test_gather_ops``' negated sources on CUDA: the reference, Triton and the default backend
    (the compiled extension when built, else CuPy)."""
    check_negated_sources("cuda", ("torch", "triton", "auto"), use_backend)
