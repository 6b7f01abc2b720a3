"""Every kernel backend (Triton, the compiled CUDA extension, CuPy/NVRTC) against the torch
reference on CUDA, op by op and through the pools, graphs and the runner (marker gpu).

A backend that is not available here is skipped with its reason, unless
``VLLM_OMNI_KERNELS_REQUIRE`` names it (the GPU CI run sets ``cuda,cupy``), then it fails.
"""

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ALL_DTYPES
from gather_cases import check_far_apart_rows, check_gather_case
from phase_fakes import FakeRunner, FakeTalker
from ring_cases import check_case, check_complex_pool, check_graph_of_appends, make_case
from test_phase_routing import MIXED, PROMPTS, check_step
from vllm_omni_kernels import backend as _backend
from vllm_omni_kernels.gather import RowGather
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch, RingPool

pytestmark = pytest.mark.gpu
BACKENDS = ["triton", "cuda", "cupy"]
FRAMES = [((), True), ((2,), True), ((3,), False), ((16,), False)]
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=BACKENDS)
def kernel_backend(request, monkeypatch):
    name = request.param
    if torch.cuda.is_available():
        why = _backend._availability()[name]
        if why is not None:
            required = os.environ.get("VLLM_OMNI_KERNELS_REQUIRE", "").split(",")
            if name in required:
                pytest.fail(f"{name} is required here but unavailable: {why}")
            pytest.skip(f"{name}: {why}")
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", name)
    return name


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("frame_shape, last", FRAMES)
@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_ring_op_matches_reference(kernel_backend, dtype, frame_shape, last, read):
    for seed in range(3):
        check_case(seed * 7919 + 1, dtype=dtype, frame_shape=frame_shape, last=last, read=read, rows=6,
                   max_cap=3000, device="cuda", backend=kernel_backend)


def test_ring_op_wide_rows_and_many_blocks(kernel_backend):
    check_case(3, dtype=torch.bfloat16, frame_shape=(16384,), last=False, read=False, rows=8, max_cap=9,
               device="cuda", backend=kernel_backend)
    check_case(4, dtype=torch.float32, frame_shape=(), last=True, read=False, rows=4, max_cap=60000,
               device="cuda", backend=kernel_backend)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 40), max_cap=st.integers(1, 5000),
       dtype=st.sampled_from(ALL_DTYPES), layout=st.sampled_from(FRAMES), read=st.booleans())
def test_ring_op_property(kernel_backend, seed, rows, max_cap, dtype, layout, read):
    frame_shape, last = layout
    check_case(seed, dtype=dtype, frame_shape=frame_shape, last=last, read=read, rows=rows, max_cap=max_cap,
               device="cuda", backend=kernel_backend)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("width", [1, 8, 300, 4096, 16384])
def test_gather_matches_reference(kernel_backend, dtype, width, monkeypatch):
    for seed in range(3):
        check_gather_case(seed, dtype, width, "cuda", kernel_backend, monkeypatch)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOATS), width=st.integers(1, 5000))
def test_gather_property(kernel_backend, seed, dtype, width):
    with pytest.MonkeyPatch.context() as mp:
        check_gather_case(seed, dtype, width, "cuda", kernel_backend, mp)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "resident_table"])
def test_gather_rows_far_apart_keep_every_bit_of_their_offsets(kernel_backend, graph, monkeypatch):
    check_far_apart_rows("cuda", kernel_backend, monkeypatch, graph=graph)


@pytest.mark.parametrize("lengths", [[0], [0, 3]], ids=["nothing_copied", "one_row_empty"])
def test_reused_slot_gets_its_head_reset_by_an_empty_first_append(kernel_backend, lengths):
    """A reused slot's device head still holds its last owner's value; the first launch after alloc
    overrides it even when that launch copies nothing, so the next chunk lands at frame 0."""
    pool = RingPool("k", torch.float32, (), "cuda", S.CONCAT_LAST, budget_bytes=1 << 16, initial_frames=64)
    pool.alloc("old")
    pool.append(["old"], PaddedBatch(torch.ones(1, 10, device="cuda"), [10]))
    pool.free("old")
    ids = ["new", "other"][: len(lengths)]
    for r in ids:
        pool.alloc(r)
    pool.append(ids, PaddedBatch(torch.zeros(len(ids), 5, device="cuda"), lengths))
    x = torch.arange(1.0, 8.0, device="cuda").view(1, 7).expand(len(ids), 7).contiguous()
    pool.append(ids, PaddedBatch(x, [7] * len(ids)))
    got = pool.consolidate(ids)
    assert torch.equal(got[0], x[0])
    if len(ids) == 2:
        assert torch.equal(got[1], torch.cat([torch.zeros(3, device="cuda"), x[1]]))


def _backend_for(device: str, kernel_backend: str, monkeypatch) -> None:
    """The backend setting is process-wide: a CUDA pool runs ``kernel_backend``, a CPU pool the
    reference."""
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", kernel_backend if device == "cuda" else "torch")


@pytest.mark.parametrize("max_len", [40, 5000], ids=["metadata read in place", "metadata uploaded"])
@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, ()), (S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (16,))])
def test_pool_lifecycle_matches_cpu_pool(kernel_backend, strategy, frame, max_len, monkeypatch):
    """The same lifecycle on a CUDA pool (this backend) and a CPU pool (the reference). Rows of up to
    5000 frames run several programs per row: appends, growth copies and reads then copy their
    metadata to the device first (``ring.pool.UPLOAD_ELEMS``); short rows read it in place."""

    rng = np.random.default_rng(3)
    last = strategy is S.CONCAT_LAST
    pools = {d: RingPool("k", torch.bfloat16, frame, d, strategy, budget_bytes=1 << 27, initial_frames=16)
             for d in ("cpu", "cuda")}
    ids = [f"r{i}" for i in range(5)]
    for p in pools.values():
        for r in ids:
            p.alloc(r)
    g = torch.Generator().manual_seed(5)
    for _ in range(12):
        lens = rng.integers(0, max_len, size=5)
        shape = (5, *frame, int(lens.max())) if last else (5, int(lens.max()), *frame)
        data = torch.randn(shape, generator=g).to(torch.bfloat16)
        for d, p in pools.items():
            _backend_for(d, kernel_backend, monkeypatch)
            p.append(ids, PaddedBatch(data.to(d), lens))
        if rng.random() < 0.4:
            outs = {}
            for d, p in pools.items():
                _backend_for(d, kernel_backend, monkeypatch)
                outs[d] = p.drain(ids[:3])
            for a, b in zip(outs["cpu"], outs["cuda"]):
                assert torch.equal(a, b.cpu())
    # consolidate the requests never drained (a drained request cannot be consolidated)
    _backend_for("cpu", kernel_backend, monkeypatch)
    want = pools["cpu"].consolidate(ids[3:])
    _backend_for("cuda", kernel_backend, monkeypatch)
    for a, b in zip(want, pools["cuda"].consolidate(ids[3:])):
        assert torch.equal(a, b.cpu())


def test_large_steps_match_the_reference(kernel_backend, monkeypatch):
    """Steps larger than any fixed buffer a launcher might assume: ring steps of 20 to 600 rows
    (staged in a grown ring of pinned metadata) and gather tables of 700 to 2100 float rows plus an
    int job and values. Every backend matches the reference."""
    rng = np.random.default_rng(11)
    for rows in (20, 100, 200, 300, 511, 512, 600):
        pools = {}
        for d in ("cpu", "cuda"):
            _backend_for(d, kernel_backend, monkeypatch)
            pools[d] = p = RingPool("k", torch.float32, (), d, S.CONCAT_LAST, budget_bytes=1 << 26,
                                    initial_frames=64, max_slots=rows)
            for r in range(rows):
                p.alloc(f"r{r}")
        ids = [f"r{r}" for r in range(rows)]
        for _ in range(2):
            lens = rng.integers(0, 33, rows)
            data = torch.randn(rows, 32)
            for d, p in pools.items():
                _backend_for(d, kernel_backend, monkeypatch)
                p.append(ids, PaddedBatch(data.to(d), lens))
        _backend_for("cuda", kernel_backend, monkeypatch)
        got = pools["cuda"].consolidate(ids)
        _backend_for("cpu", kernel_backend, monkeypatch)
        for a, b in zip(pools["cpu"].consolidate(ids), got):
            assert torch.equal(a, b.cpu())
    _backend_for("cuda", kernel_backend, monkeypatch)
    for rows in (700, 1200, 2000, 2100):
        gather = RowGather(torch.bfloat16, 8, "cuda", max_float_rows=rows, max_int_rows=2, max_values=8)
        src = torch.randn(rows, 8, device="cuda").bfloat16()
        dst = torch.zeros(rows, 8, dtype=torch.bfloat16, device="cuda")
        ids_src = torch.arange(6, device="cuda").view(1, 6) - 3
        ids_dst = torch.zeros(1, 6, dtype=torch.int32, device="cuda")
        flags = torch.zeros(5, dtype=torch.int64, device="cuda")
        order = rng.permutation(rows)
        gather.jobs.rows(dst, order, src)
        gather.jobs.ints(ids_dst, np.arange(1), ids_src)
        gather.jobs.values(flags, np.arange(5, dtype=np.int32) - 2)
        assert gather.launch() == 1
        assert torch.equal(dst[torch.from_numpy(order).cuda()], src)
        assert torch.equal(ids_dst, ids_src.int()) and torch.equal(flags.cpu(), torch.arange(5) - 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_launches_a_source_of_every_alignment_with_a_kernel_of_its_own(dtype, monkeypatch):
    """The Triton backend launches its compiled kernels directly (``ops/triton_launch.py``), each
    specialization asked of Triton once. Sources at addresses 2 or 4 bytes off an aligned one,
    through the planned and the repeated append, are each launched with a kernel of their own
    alignment, and every request's data equals plain concatenation."""
    from vllm_omni_kernels.ops import triton_launch, triton_ring

    why = _backend._availability()["triton"]
    if why is not None:
        pytest.skip(f"triton: {why}")
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", "triton")
    assert triton_ring._write.direct and triton_ring._read.direct
    pool = RingPool("audio", dtype, (), "cuda", S.CONCAT_LAST, budget_bytes=1 << 20, initial_frames=1024,
                    max_slots=4, growth=False)
    ids, lengths = ["a", "b", "c"], [128, 100, 7]
    for rid in ids:
        pool.alloc(rid)
    big = torch.randn(3, 131, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(dtype)
    chunks = [big[:, :128], big[:, 1:129], big[:, 3:131], big[:, :128], big[:, 1:129]]
    assert len({triton_launch._spec(c)[1] % 16 for c in chunks}) == 3
    for chunk in chunks:
        assert not pool.append(ids, PaddedBatch(chunk, lengths)).errors
    got = pool.consolidate(ids)
    for b, n in enumerate(lengths):
        assert torch.equal(got[b], torch.cat([c[b, :n] for c in chunks]))
    assert pool.repeated_launches >= 1


def test_graph_of_appends_replayed(kernel_backend):
    check_graph_of_appends(50)


@pytest.mark.parametrize("programmatic", [True, False], ids=["pdl", "no_pdl"])
def test_kernels_in_a_graph_read_what_the_kernel_just_before_them_wrote(kernel_backend, programmatic):
    """A graph of 30 steps, each a torch kernel rewriting the source, then an append of it, a gather
    of its rows, and a torch kernel summing the gather's output: every kernel sees the one before it
    complete, also when the compiled and Triton kernels launch with programmatic dependent launch
    (they may start early and must wait before touching memory)."""
    from vllm_omni_kernels import ops
    from vllm_omni_kernels.ring.graph import capture

    if not programmatic and kernel_backend == "cupy":
        pytest.skip("CuPy launches without programmatic dependent launch")
    ops.set_programmatic_launch(programmatic)
    try:
        steps, rows, T, h = 30, 8, 48000, 2048
        pool = RingPool("k", torch.float32, (), "cuda", S.CONCAT_LAST, budget_bytes=1 << 28,
                        initial_frames=steps * T + T)
        ids = [f"r{i}" for i in range(rows)]
        for r in ids:
            pool.alloc(r)
        src = torch.zeros(rows, T, device="cuda")
        base = torch.arange(rows * T, device="cuda", dtype=torch.float32).view(rows, T) % 1000
        lens = np.full(rows, T)
        sa = pool.static_append(ids, src, lens)
        emb = torch.zeros(rows, h, dtype=torch.bfloat16, device="cuda")
        dst = torch.zeros(rows, h, dtype=torch.bfloat16, device="cuda")
        acc = torch.zeros(rows, h, dtype=torch.float32, device="cuda")
        gather = RowGather(torch.bfloat16, h, "cuda", max_float_rows=rows, max_int_rows=1)
        gather.jobs.rows(dst, np.arange(rows)[::-1].copy(), emb)
        gather.prepare_static()

        def step():
            src.add_(base).add_(1)  # step k's source: k * (base + 1)
            sa.launch()
            emb.add_(1)  # step k's rows: k
            gather.run_static(rows)
            acc.add_(dst.float())

        graph = capture(step, steps, warmup=lambda: (sa.prepare(1), step()))
        sa.prepare(steps)
        graph.replay()
        torch.cuda.synchronize()
        k = torch.arange(1, steps + 2, device="cuda", dtype=torch.float32).view(-1, 1)
        for b, out in enumerate(pool.consolidate(ids)):
            assert torch.equal(out, (k * (base[b] + 1)).reshape(-1)), b
        assert torch.equal(acc, torch.full_like(acc, (steps + 1) * (steps + 2) / 2))
    finally:
        ops.set_programmatic_launch(True)


@pytest.mark.parametrize("mtp", [True, False])
def test_runner_step_matches_contract(kernel_backend, mtp):
    runner = FakeRunner(FakeTalker(64, torch.bfloat16, mtp=mtp), device="cuda")
    for rid, p in PROMPTS.items():
        runner.add_request(rid, p)
    for order in sorted(MIXED):
        check_step(runner, MIXED[order])


def test_backend_report_names_every_op():
    report = _backend.describe()
    for dev in ("cpu", "cuda"):
        assert set(report[dev]) == set(_backend.OPS)
    assert set(report["availability"]) == {"cuda", "cupy", "triton", "torch"}
    assert report["programmatic_launch"] is (os.environ.get("VLLM_OMNI_KERNELS_PDL") != "0")


def _compiled_ops():
    from vllm_omni_kernels.ops import cuda_ext

    why = cuda_ext.load()
    if why is not None:
        if "cuda" in os.environ.get("VLLM_OMNI_KERNELS_REQUIRE", "").split(","):
            pytest.fail(f"the compiled extension is required here but unavailable: {why}")
        pytest.skip(why)
    return torch.ops.vllm_omni_kernels


@pytest.mark.parametrize("read", [False, True], ids=["ring_write", "ring_read"])
@pytest.mark.parametrize("last", [False, True], ids=["dim0", "last"])
def test_opcheck_ring_ops(read, last):
    """``torch.library.opcheck`` on the registered ring ops: schema (what they mutate), fake
    implementation, autograd registration and AOT dispatch."""
    lib = _compiled_ops()
    case = make_case(np.random.default_rng(5), dtype=torch.bfloat16, last=last, frame_shape=(3,), rows=5,
                     max_cap=40, device="cuda", read=read)
    if read:
        args = (case.arena, case.meta, case.lin, case.rows, case.frame_elems, case.last, case.max_elems)
        torch.library.opcheck(lib.ring_read.default, args)
    else:
        args = (case.arena, case.state, case.meta, case.lin, case.rows, case.frame_elems, case.last, case.max_elems)
        torch.library.opcheck(lib.ring_write.default, args)


def test_row_gather_registration():
    """``row_gather``'s registration: its schema marks the outputs (and only them) as written, and its
    fake implementation runs under ``FakeTensorMode`` (what ``torch.compile`` traces with).

    ``opcheck`` does not apply to it: the job table addresses every row as an offset from ``base``,
    and ``opcheck`` runs the op on deep copies of its arguments, which moves ``base`` away from the
    rows the table was encoded for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lib = _compiled_ops()
    schema = lib.row_gather.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["outputs"] and len(schema.returns) == 0
    with FakeTensorMode() as mode:
        base = mode.from_tensor(torch.zeros(8, dtype=torch.bfloat16, device="cuda"))
        table = mode.from_tensor(torch.zeros(16, dtype=torch.int64, device="cuda"))
        out = mode.from_tensor(torch.zeros(4, 8, dtype=torch.bfloat16, device="cuda"))
        assert lib.row_gather(base, table, [out], 8, 4, True) is None


@pytest.mark.parametrize("strategy, frame", [(S.CONCAT_LAST, (2,)), (S.CONCAT_DIM0, (3,))])
def test_complex_chunks_go_through_as_their_bits_and_wider_ones_are_refused(kernel_backend, strategy, frame):
    check_complex_pool("cuda", strategy, frame, wide_refused=True)
