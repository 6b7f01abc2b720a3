"""Ring kernels and pools on CUDA (marker gpu; run on the H200 with ``pytest -m gpu``)."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ALL_DTYPES, random_tensor, stable_seed
from ring_cases import check_case, check_graph_of_appends
from vllm_omni_kernels.errors import TensorAccumulationError
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch, RingPool

pytestmark = pytest.mark.gpu
FRAMES = [((), True), ((2,), True), ((3,), False), ((16,), False)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("frame_shape, last", FRAMES)
@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_cuda_triton_matches_reference(dtype, frame_shape, last, read):
    check_case(stable_seed(dtype, frame_shape, last, read), dtype=dtype, frame_shape=frame_shape,
               last=last, read=read, rows=6, max_cap=3000, device="cuda")


def test_cuda_wide_rows_16384_bf16():
    check_case(3, dtype=torch.bfloat16, frame_shape=(16384,), last=False, read=False, rows=8, max_cap=9,
               device="cuda")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 40), max_cap=st.integers(1, 5000),
       dtype=st.sampled_from(ALL_DTYPES), layout=st.sampled_from(FRAMES), read=st.booleans())
def test_cuda_property_random_batches(seed, rows, max_cap, dtype, layout, read):
    frame_shape, last = layout
    check_case(seed, dtype=dtype, frame_shape=frame_shape, last=last, read=read, rows=rows, max_cap=max_cap,
               device="cuda")


def cuda_pool(strategy=S.CONCAT_LAST, frame=(), dtype=torch.float32, **kw):
    kw.setdefault("budget_bytes", 64 << 20)
    kw.setdefault("initial_frames", 4096)
    return RingPool("audio", dtype, frame, "cuda", strategy, **kw)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, ()), (S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (16,))])
def test_cuda_pool_matches_cpu_pool(dtype, strategy, frame, use_backend):
    """The same random lifecycle on a CUDA pool (Triton) and a CPU pool (reference)."""
    use_backend("auto")
    rng = np.random.default_rng(11)
    last = strategy is S.CONCAT_LAST
    pools = {d: RingPool("k", dtype, frame, d, strategy, budget_bytes=1 << 20, initial_frames=16) for d in ("cpu", "cuda")}
    ids = [f"r{i}" for i in range(5)]
    for p in pools.values():
        for r in ids:
            p.alloc(r)
    g = torch.Generator().manual_seed(5)
    for step in range(12):
        lens = rng.integers(0, 40, size=5)
        data = random_tensor((5, *frame, 40) if last else (5, 40, *frame), dtype, generator=g)
        for d, p in pools.items():
            assert p.append(ids, PaddedBatch(data.to(d), lens)).errors == ()
        if step % 4 == 3:
            a, b = (p.drain(ids[:2]) for p in pools.values())
            assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))
    a, b = (p.consolidate(ids[2:]) for p in pools.values())
    assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))


def test_cpu_tensor_into_cuda_pool_is_rejected_for_that_request_only():
    pool = cuda_pool()
    pool.alloc("a")
    pool.alloc("b")
    res = pool.append(["a", "b"], [torch.ones(5, device="cuda"), torch.ones(5)])
    assert [e.request_id for e in res.errors] == ["b"] and "cpu" in str(res.errors[0])
    assert pool.unread_frames("a") == 5 and pool.unread_frames("b") == 0


def test_eager_append_makes_no_host_sync_and_no_allocation():
    pool = cuda_pool()
    ids = [f"r{i}" for i in range(64)]
    for r in ids:
        pool.alloc(r)
    data = torch.randn(64, 1920, device="cuda")
    lens = np.full(64, 1920)
    for _ in range(3):  # warm-up: compile, metadata buffers
        pool.append(ids, PaddedBatch(data, lens))
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            assert pool.append(ids, PaddedBatch(data, lens)).errors == ()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    (out,) = pool.consolidate(["r7"])
    assert torch.equal(out, data[7].repeat(23))


def test_cuda_graph_100_replays_with_growth_and_changing_data():
    pool = cuda_pool(initial_frames=2048)
    ids = [f"r{i}" for i in range(8)]
    for r in ids:
        pool.alloc(r)
    src = torch.randn(8, 1000, device="cuda")
    lens = np.array([1000, 999, 1, 0, 500, 1000, 7, 640])
    sa = pool.static_append(ids, src, lens)
    g = sa.capture_graph(1)  # its warm-up launch appends the current src once
    expected = {r: [src[b, : lens[b]].clone()] for b, r in enumerate(ids)}
    for step in range(100):
        src.copy_(torch.randn(8, 1000, device="cuda"))
        for b, r in enumerate(ids):
            expected[r].append(src[b, : lens[b]].clone())
        sa.prepare(1)  # grows slots on the host side when the next step would overflow
        g.replay()
    assert pool.stats().growths > 0
    outs = pool.consolidate(ids)
    for r, out in zip(ids, outs):
        assert torch.equal(out, torch.cat(expected[r])), r


def test_cuda_graph_of_100_appends_replayed():
    """One graph holding 100 appends (CONCAT_DIM0 rows), replayed twice: heads advance on the device."""
    check_graph_of_appends(100)


def test_ten_thousand_lifecycles_leave_the_pool_empty():
    pool = cuda_pool(initial_frames=256, budget_bytes=16 << 20, max_slots=256)
    g = torch.Generator(device="cuda").manual_seed(0)
    for wave in range(100):
        ids = [f"w{wave}-{i}" for i in range(100)]
        for r in ids:
            pool.alloc(r)
        data = torch.randn(100, 300, device="cuda", generator=g)
        lens = np.arange(100) * 3
        pool.append(ids, PaddedBatch(data, lens))
        pool.append(ids, PaddedBatch(data, lens))
        outs = pool.drain(ids)
        if wave % 25 == 0:
            for b, out in enumerate(outs):
                assert torch.equal(out, data[b, : lens[b]].repeat(2))
        for r in ids:
            pool.free(r)
    st = pool.stats()
    assert st.slots_used == 0 and st.bytes_used == 0 and st.unread_bytes == 0
    assert pool.allocator.live_regions == 0
    with pytest.raises(TensorAccumulationError):
        pool.free("w0-0")


def test_a_staging_buffer_is_handed_out_again_only_after_the_work_of_its_last_use_ran():
    """``PinnedStaging.host`` reuses a buffer ``depth`` hand-outs later, and first waits for the work
    queued with its last use: here each hand-out's work is a long sleep on the stream, and the
    buffer about to be rewritten was read by the first of them."""
    from vllm_omni_kernels.ring.staging import MIN_DEPTH, PinnedStaging

    staging = PinnedStaging(1, 8, torch.device("cuda"), depth=MIN_DEPTH)
    first_read = torch.cuda.Event()
    for k in range(MIN_DEPTH):
        i, _ = staging.host()
        staging.read_in_place(i)
        torch.cuda._sleep(10_000_000)  # the kernel that reads the buffer, still running long after
        if k == 0:
            first_read.record()
    assert not first_read.query()  # the device is far behind the host
    i, _ = staging.host()  # the first buffer again: its reader must have run
    assert i == 0 and first_read.query()
    torch.cuda.synchronize()
