"""The fused row gather (``RowGather`` / ``GatherJobs``): Triton against the torch reference.

On CPU the Triton kernel runs under the interpreter; ``test_gpu_gather.py`` repeats this on CUDA.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gather_cases import check_far_apart_rows, check_gather_case, make_gather_case, random_each_call
from vllm_omni_kernels.gather import RowGather
from vllm_omni_kernels.ops import gather_jobs
from vllm_omni_kernels.ops.each_records import check_each_numpy

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", [1, 8, 300])
def test_triton_gather_matches_reference(dtype, width, monkeypatch):
    for seed in range(3):
        check_gather_case(seed, dtype, width, "cpu", "triton", monkeypatch)


def test_triton_gather_wide_rows_16384(monkeypatch):
    check_gather_case(0, torch.bfloat16, 16384, "cpu", "triton", monkeypatch)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rows_far_apart_keep_every_bit_of_their_offsets(backend, monkeypatch):
    check_far_apart_rows("cpu", backend, monkeypatch, graph=backend == "triton")


def test_int_records_keep_48_signed_bits_of_offset_and_their_count_and_flags():
    """An int record's two words (offsets in the low 48 bits, flags and count in the top 16) give
    back offsets of either sign up to 48 bits, counts up to INT_COUNT_MAX and every flag, as the
    kernels decode them."""
    from vllm_omni_kernels.ops.gather_jobs import INT_COUNT_MAX, _put_ints, decode_table

    rng = np.random.default_rng(3)
    src = np.concatenate([rng.integers(-(2**47), 2**47, 200), [-(2**47), 2**47 - 1, -1, 0, 2**32, -(2**32) - 1]])
    dst = rng.permutation(src)
    count = rng.integers(0, INT_COUNT_MAX + 1, len(src))
    count[:2] = INT_COUNT_MAX, 0
    flags = rng.integers(0, 8, len(src))
    table = np.zeros(2 + 2 * len(src), np.int64)
    table[1] = len(src)
    _put_ints(table, 2, len(table), src, dst, count, flags)
    floats, ints = decode_table(table, 2)
    assert len(floats) == 0 and np.array_equal(ints, np.stack([src, dst, count, flags], axis=1))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOATS), width=st.sampled_from([1, 8, 33]))
def test_many_source_blocks_checked_in_numpy_copy_as_their_sources_one_by_one(seed, dtype, width):
    """Without the compiled extension, ``rows_each``/``ints_each`` are checked by its numpy twin
    and recorded as one block of many sources with their records; they copy what the same calls
    recorded source by source copy, on the reference and on the Triton kernels (interpreter)."""
    case = make_gather_case(seed, dtype, width)
    blocks = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gather_jobs, "_check_each", lambda *args: None)  # recorded source by source
        want = check_gather_case(seed, dtype, width, "cpu", "torch", mp)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gather_jobs.cuda_ext, "_module", None)
        mp.setattr(gather_jobs, "check_each_numpy", lambda *args: blocks.append(check_each_numpy(*args)) or blocks[-1])
        for backend in ("torch", "triton"):
            got = check_gather_case(seed, dtype, width, "cpu", backend, mp)
            assert all(torch.equal(got[k], want[k]) for k in want), backend
    each_calls = sum(kind.endswith("_each") for kind, *_ in case[2])
    assert len(blocks) == 4 * each_calls and all(rows >= 0 for rows, _, _ in blocks)  # twice per backend


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), floating=st.booleans())
def test_numpy_check_each_accepts_only_calls_the_element_path_records(seed, floating):
    """What the numpy ``check_each`` accepts, recording source by source accepts too (the same
    rows); where that raises for source k, the checker has declined at k or before, so the element
    path runs and its typed error names the source. It may decline sources the element path takes
    (a conversion, a 2-D int row into a 1-D destination): those are recorded one by one."""
    srcs, starts, dst = random_each_call(seed, floating)
    rows, _, notes = check_each_numpy(srcs, starts, dst, floating, 0)
    jobs = gather_jobs.GatherJobs(dst.dtype if floating else torch.float32, dst.shape[1] if floating else 1, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gather_jobs, "_check_each", lambda *args: None)  # source by source
        try:
            (jobs.rows_each if floating else jobs.ints_each)(dst, starts, srcs)
            failed = None
        except (TypeError, ValueError, IndexError) as exc:
            failed = exc.index
    if rows >= 0:
        assert failed is None and rows == jobs.n_float + jobs.n_int and len(notes) == 8 + 16 * rows
    else:
        assert notes is None and (failed is None or -rows - 1 <= failed)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), dtype=st.sampled_from(FLOATS), width=st.integers(1, 70))
def test_random_gathers_match_reference(seed, dtype, width):
    with pytest.MonkeyPatch.context() as mp:
        check_gather_case(seed, dtype, width, "cpu", "triton", mp)


def test_int_rows_convert_exactly_between_int32_and_int64(use_backend):
    use_backend("triton")
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=1, max_int_rows=8)
    src64 = torch.tensor([[-3], [2**31 - 1], [-(2**31)]], dtype=torch.int64)
    src32 = torch.tensor([[-7, 5]], dtype=torch.int32)
    d32 = torch.zeros(3, 1, dtype=torch.int32)
    d64 = torch.zeros(1, 2, dtype=torch.int64)
    g.jobs.ints(d32, [2, 0, 1], src64)
    g.jobs.ints(d64, [0], src32)
    g.launch()
    assert d32.flatten().tolist() == [2**31 - 1, -(2**31), -3]
    assert d64.tolist() == [[-7, 5]]


def test_empty_gather_launches_nothing(use_backend):
    use_backend("triton")
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=1, max_int_rows=1)
    g.jobs.rows(torch.zeros(2, 4), [], torch.zeros(0, 4))
    assert g.launch() == 0 and g.launches == 0


@pytest.mark.parametrize("bad,err", [
    (lambda j, d, s: j.rows(d, [0], s.to(torch.int32)), TypeError),
    (lambda j, d, s: j.rows(d, [0], s[:, :3]), ValueError),
    (lambda j, d, s: j.rows(d.to(torch.float16), [0], s), TypeError),
    (lambda j, d, s: j.rows(d, [4], s), IndexError),
    (lambda j, d, s: j.rows(d, [-1], s), IndexError),
    (lambda j, d, s: j.rows(d, [0, 1], s, [0, 9]), IndexError),
    (lambda j, d, s: j.rows(d, [0, 1, 2], s[:2]), IndexError),
    (lambda j, d, s: j.rows(d.t(), [0], s), ValueError),
    (lambda j, d, s: j.ints(torch.zeros(4, 2, dtype=torch.int32), [0], torch.zeros(1, 3, dtype=torch.int64)),
     ValueError),
    (lambda j, d, s: j.values(torch.zeros(3, dtype=torch.int32), [1, 2]), ValueError),
    (lambda j, d, s: j.rows(d, [0], [1.0, 2.0]), TypeError),
])
def test_bad_jobs_raise_before_anything_is_recorded(bad, err):
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=4, max_int_rows=4, max_values=4)
    dst, src = torch.zeros(4, 4), torch.ones(3, 4)
    with pytest.raises(err):
        bad(g.jobs, dst, src)
    assert g.jobs.n_float == 0 and g.jobs.n_int == 0


def test_two_jobs_writing_one_row_is_rejected():
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=4, max_int_rows=4)
    dst = torch.zeros(4, 4)
    g.jobs.rows(dst, [1, 2], torch.ones(2, 4))
    g.jobs.rows(dst, [2], torch.ones(1, 4))
    with pytest.raises(ValueError, match="same destination row"):
        g.launch()
    assert (dst == 0).all()


def test_capacity_is_checked_before_launch():
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=2, max_int_rows=1)
    dst = torch.zeros(4, 4)
    g.jobs.rows(dst, np.arange(3), torch.ones(3, 4))
    with pytest.raises(ValueError, match="capacity"):
        g.launch()
    assert (dst == 0).all()


def test_static_launch_replays_the_prepared_table(use_backend):
    """prepare_static + run_static (the captured path) under the interpreter, with changing rows."""
    use_backend("triton")
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=4, max_int_rows=1)
    src = torch.arange(12.0).view(3, 4)
    for rows in ([0, 1, 2], [3, 1]):
        dst = torch.zeros(4, 4)
        g.jobs.clear()
        g.jobs.rows(dst, rows, src)
        g.prepare_static()
        g.run_static(grid_rows=4)
        want = torch.zeros(4, 4)
        want[rows] = src[:len(rows)]
        assert torch.equal(dst, want)


def test_a_block_of_consecutive_int_rows_is_encoded_as_a_run_of_records_of_one_pass_each():
    """Ids at consecutive offsets (rows end to end on both sides) become records of ``int_run_cap``
    elements (what an int job's blocks copy in one pass); rows out of order, a gap, rows apart in
    memory or one-row jobs stay a record per row."""
    from vllm_omni_kernels.ops.gather_jobs import GatherJobs, TableLayout, decode_table, int_run_cap

    assert int_run_cap(4096, 2) == 256 and int_run_cap(2048, 2) == 128 and int_run_cap(8, 4) == 128
    j = GatherJobs(torch.float32, 8, "cpu")
    ids, out = torch.arange(300), torch.zeros(700, dtype=torch.int32)
    codes, code_out = torch.arange(200, dtype=torch.int32).view(40, 5), torch.zeros(90, 5, dtype=torch.int64)
    j.ints(out, np.arange(50, 350), ids)                      # 300 elements: records of 128, 128, 44
    j.ints(code_out, np.arange(40), codes)                    # 200 elements: 128, 72
    j.ints(out, np.array([400, 402]), ids[:2])                # a gap: a record per row
    j.ints(out, np.array([501, 500]), ids[:2])                # reversed: a record per row
    j.ints(code_out, np.arange(40, 43), codes, np.array([0, 1, 3]))   # source rows not consecutive
    j.ints(out, 600, ids, 7)                                  # one-row jobs: a record each
    j.ints(out, 601, ids, 8)
    layout = TableLayout(0, j.n_int, 0)
    table = np.zeros(layout.words, np.int64)
    words = j.encode(table, layout, 0, 0)
    _, rec = decode_table(table[:words], layout.int_off)
    assert len(rec) == 3 + 2 + 2 + 2 + 3 + 2 and words == layout.int_off + 2 * len(rec)
    base = out.data_ptr() // 4
    assert rec[0, :2].tolist() == [ids.data_ptr() // 4, base + 50]
    assert rec[1, :2].tolist() == [ids.data_ptr() // 4 + 256, base + 178]  # int64 source: 2 words each
    assert rec[4, :2].tolist() == [codes.data_ptr() // 4 + 128, code_out.data_ptr() // 4 + 256]
    assert rec[:, 2].tolist() == [128, 128, 44, 128, 72, 1, 1, 1, 1, 5, 5, 5, 1, 1]


def test_runs_of_int_rows_copy_as_their_rows(use_backend):
    """A gather whose ids and codes are runs (records of many rows, cut at ``int_run_cap``) copies
    what the reference copies, on the Triton interpreter and the reference."""
    use_backend("triton")
    ids, codes = torch.arange(300) * 7 - 1000, torch.arange(1000, dtype=torch.int32).view(200, 5)
    got = {}
    for backend in ("torch", "triton"):
        use_backend(backend)
        out, code_out = torch.zeros(400, dtype=torch.int32), torch.zeros(210, 5, dtype=torch.int64)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=600)
        g.jobs.ints(out, np.arange(50, 350), ids)
        g.jobs.ints(code_out, np.arange(5, 205), codes)
        assert g.launch() == 1
        got[backend] = (out, code_out)
    assert torch.equal(got["torch"][0], got["triton"][0]) and torch.equal(got["torch"][1], got["triton"][1])
    assert torch.equal(got["triton"][0][50:350], ids.int()) and torch.equal(got["triton"][1][5:205], codes.long())
