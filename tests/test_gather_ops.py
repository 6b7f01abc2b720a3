"""The fused row gather (``RowGather`` / ``GatherJobs``): Triton against the torch reference.

On CPU the Triton kernel runs under the interpreter; ``test_gpu_gather.py`` repeats this on CUDA.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gather_cases import check_far_apart_rows, check_gather_case, make_gather_case, random_each_call, record_gather_case
from vllm_omni_kernels.gather import GatherJobs, RowGather, TableLayout
from vllm_omni_kernels.ops.layout import GATHER_ROW, INT_DST64, INT_SRC64, JOB_FLOAT, JOB_INT, ROW_WORDS, RUN_ELEMS

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


def test_rows_past_what_one_launch_or_one_record_copies_are_refused_when_recorded():
    """A float row is copied in at most 65535 blocks (a launch's grid.y), an int row's length is a
    32-bit field of its record: wider rows are refused before anything is recorded (a kernel would
    fail to launch, or copy nothing)."""
    widest = 65535 * 4096 // 4
    GatherJobs(torch.float32, widest, "cpu")
    with pytest.raises(ValueError, match="65535 blocks"):
        GatherJobs(torch.float32, widest + 1, "cpu")
    jobs = GatherJobs(torch.float32, 8, "cpu")
    wide = torch.zeros(1, 1, dtype=torch.int32).expand(1, 2**31)  # (no memory behind it)
    with pytest.raises(ValueError, match="at most 2147483647"):
        jobs.ints(wide, 0, wide)
    assert jobs.n_int == 0


def test_the_table_holds_one_plain_record_per_row():
    """The table is the record count, then ``GATHER_ROW`` records (each side's offset from the base in
    float elements or int32 words, its row stride and its row; the count and the kind), then the
    values; read back with the dtype, every record is what was recorded."""
    j = GatherJobs(torch.bfloat16, 8, "cpu")
    emb, src = torch.zeros(6, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    ids, out = torch.arange(4), torch.zeros(10, dtype=torch.int32)
    flags = torch.zeros(3, dtype=torch.int64)
    j.rows(emb, [5, 2], src, [1, 3])
    j.rows(emb, 4, src)
    j.ints(out, np.array([9, 0]), ids)
    j.values(flags, [7, -1, 2])
    base = emb.data_ptr() - 4096
    layout = TableLayout(jobs=8, values=4)
    table = np.zeros(layout.words, np.int64)
    assert j.encode(table, layout, base, table_address := 1 << 20) == 6 and table[0] == 6
    rec = table[1:1 + ROW_WORDS * 6].view(GATHER_ROW)
    e = (src.data_ptr() - base) // 2, (emb.data_ptr() - base) // 2
    assert rec[:3].tolist() == [(e[0], 8, 1, e[1], 8, 5, 8, JOB_FLOAT), (e[0], 8, 3, e[1], 8, 2, 8, JOB_FLOAT),
                                (e[0], 8, 0, e[1], 8, 4, 8, JOB_FLOAT)]
    w = (ids.data_ptr() - base) // 4, (out.data_ptr() - base) // 4
    assert rec[3:5].tolist() == [(w[0], 2, 0, w[1], 1, 9, 1, JOB_INT | INT_SRC64),
                                 (w[0], 2, 1, w[1], 1, 0, 1, JOB_INT | INT_SRC64)]
    assert rec[5].tolist() == ((table_address + 8 * layout.values_at - base) // 4, 0, 0, (flags.data_ptr() - base) // 4,
                               0, 0, 3, JOB_INT | INT_DST64)
    assert table[layout.values_at:layout.values_at + 2].view(np.int32)[:3].tolist() == [7, -1, 2]


def test_many_sources_of_two_int_widths_are_the_rows_of_each():
    """A many-source block of int32 and int64 sources is written as the rows of each width (a
    record's kind holds one source width); each row's source is its own offset, stride 1."""
    j = GatherJobs(torch.float32, 8, "cpu")
    wide, narrow, out = torch.arange(6), torch.arange(4, dtype=torch.int32), torch.zeros(9, dtype=torch.int64)
    j.ints_each(out, np.array([0, 1, 2, 5]), [wide[:1], narrow[1:2], wide[5:6], narrow[2:4]])
    table = np.zeros(TableLayout(j.n_int).words, np.int64)
    assert j.encode(table, TableLayout(j.n_int), 0, 0) == 5
    rec = table[1:1 + ROW_WORDS * 5].view(GATHER_ROW)
    assert (rec["kind"] & INT_SRC64).tolist() == [INT_SRC64] * 2 + [0] * 3
    assert rec["src_row"].tolist() == [wide.data_ptr() // 4, wide.data_ptr() // 4 + 10, narrow.data_ptr() // 4 + 1,
                                       narrow.data_ptr() // 4 + 2, narrow.data_ptr() // 4 + 3]
    assert rec["dst_row"].tolist() == [0, 2, 1, 5, 6] and set(rec["src_stride"].tolist()) == {1}


def test_many_sources_of_two_int_widths_copy_as_the_reference(use_backend):
    """The rows of a many-source block of int32 and int64 sources land where the reference puts
    them (Triton interpreter); the rest of the destination is untouched."""
    wide, narrow = torch.arange(6) * -3 - 2**40, torch.arange(4, dtype=torch.int32) * 7 - 9
    got = {}
    for backend in ("torch", "triton"):
        use_backend(backend)
        out = torch.full((9,), 5, dtype=torch.int64)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=8)
        g.jobs.ints_each(out, np.array([0, 1, 2, 5]), [wide[:1], narrow[1:2], wide[5:6], narrow[2:4]])
        assert g.launch() == 1
        got[backend] = out
    want = torch.tensor([wide[0], narrow[1], wide[5], 5, 5, narrow[2], narrow[3], 5, 5])
    assert torch.equal(got["torch"], want) and torch.equal(got["triton"], want)


def test_a_tensor_on_another_device_is_refused_by_name():
    """A source or destination on the meta device (device index -1, as a CPU tensor's) is refused
    when recorded, alone or among many sources."""
    j = GatherJobs(torch.float32, 8, "cpu")
    with pytest.raises(ValueError, match="source is on meta"):
        j.rows(torch.zeros(4, 8), 0, torch.empty(2, 8, device="meta"), 1)
    with pytest.raises(ValueError, match="destination is on meta"):
        j.ints(torch.empty(4, dtype=torch.int32, device="meta"), 0, torch.zeros(2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match=r"srcs\[1\]: source is on meta") as err:  # many sources at once
        j.rows_each(torch.zeros(4, 8), np.array([0, 1]), [torch.zeros(1, 8), torch.empty(1, 8, device="meta")])
    assert err.value.index == 1 and j.n_float == j.n_int == 0


def test_consecutive_int_rows_go_as_runs():
    """Int rows end to end on both sides (ids at consecutive offsets) are one record per
    ``RUN_ELEMS`` elements of whole rows (one record when they fit); rows out of order, a gap, source
    rows not consecutive or one-row jobs stay a record per row."""
    j = GatherJobs(torch.float32, 8, "cpu")
    ids, out = torch.arange(1300), torch.zeros(1400, dtype=torch.int32)
    codes, code_out = torch.arange(1000, dtype=torch.int32).view(200, 5), torch.zeros(210, 5, dtype=torch.int64)
    j.ints(out, np.arange(50, 1350), ids)                            # 1300 elements: three runs
    j.ints(code_out, np.arange(5, 205), codes)                       # 200 rows of 5: two runs of whole rows
    j.ints(out, np.array([1360, 1362]), ids[:2])                     # a gap
    j.ints(out, np.array([1371, 1370]), ids[:2])                     # reversed
    j.ints(code_out, np.arange(205, 208), codes, np.array([0, 1, 3]))  # source rows not consecutive
    j.ints(out, np.arange(1380, 1390), ids, np.arange(20, 30))      # ten rows from row 20: one record
    j.ints(out, 1391, ids, 4)                                        # one-row jobs: a record each
    j.ints(out, 1392, ids, 5)
    table = np.zeros(TableLayout(j.n_int).words, np.int64)
    n = j.encode(table, TableLayout(j.n_int), 0, 0)
    rec = table[1:1 + ROW_WORDS * n].view(GATHER_ROW)
    per = RUN_ELEMS // 5
    runs = [RUN_ELEMS, RUN_ELEMS, 1300 - 2 * RUN_ELEMS, per * 5, (200 - per) * 5]
    assert rec["count"].tolist() == runs + [1] * 4 + [5] * 3 + [10, 1, 1]
    assert rec[-3:][["src_row", "dst_row"]].tolist() == [(20, 1380), (4, 1391), (5, 1392)]
    assert rec["dst_row"][:5].tolist() == [50, 50 + RUN_ELEMS, 50 + 2 * RUN_ELEMS, 5, 5 + per]
    assert rec["src_row"][:5].tolist() == [0, RUN_ELEMS, 2 * RUN_ELEMS, 0, per]


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), dtype=st.sampled_from(FLOATS), width=st.sampled_from([1, 8, 33]))
def test_many_source_blocks_copy_as_their_sources_recorded_one_by_one(seed, dtype, width):
    """``rows_each``/``ints_each`` (one call for many hook outputs) copy what recording each source
    with ``rows``/``ints`` copies, on the reference and on the Triton kernels (interpreter)."""
    dsts, srcs, jobs = make_gather_case(seed, dtype, width)
    one_by_one = []
    for kind, dst, starts, pieces, _ in jobs:
        if not kind.endswith("_each"):
            one_by_one.append((kind, dst, starts, pieces, _))
            continue
        for start, (name, first, n) in zip(np.asarray(starts).tolist(), pieces):
            if n:
                one_by_one.append((kind.removesuffix("_each"), dst, np.arange(start, start + n), name,
                                   np.arange(first, first + n)))
    results = {}
    for backend in ("torch", "triton"):
        for name, case_jobs in (("each", jobs), ("one", one_by_one)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("VLLM_OMNI_KERNELS_BACKEND", backend)
                got = {k: v.clone() for k, v in dsts.items()}
                g = RowGather(dtype, width, "cpu", max_float_rows=64, max_int_rows=64, max_values=64)
                record_gather_case(g.jobs, got, srcs, case_jobs)
                g.launch()
                results[backend, name] = got
    want = results["torch", "one"]
    for key, got in results.items():
        assert all(torch.equal(got[k], want[k]) for k in want), key


@pytest.mark.parametrize("floating", [True, False])
def test_a_many_source_call_names_a_source_with_a_rows_elements_in_another_shape(floating):
    """Every source holds one row's element count, one of them as a column: that one is named, as
    ``rows``/``ints`` would refuse it alone, and nothing is recorded."""
    width = 8
    dst = torch.zeros(6, width, dtype=torch.float32 if floating else torch.int64)
    rows = torch.arange(4 * width).reshape(4, width).to(dst.dtype)
    srcs = [rows[0:1], rows[1:2], rows[2:3].reshape(width, 1), rows[3:4]]
    jobs = GatherJobs(torch.float32, width if floating else 1, "cpu")
    with pytest.raises(ValueError) as info:
        (jobs.rows_each if floating else jobs.ints_each)(dst, np.arange(4), srcs)
    assert info.value.index == 2 and jobs.n_float == jobs.n_int == 0 and not jobs.float_blocks + jobs.int_blocks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), floating=st.booleans())
def test_a_bad_source_of_a_many_source_call_is_named_and_nothing_is_recorded(seed, floating):
    """A many-source call with a source that cannot be recorded (another dtype where no conversion
    applies, another width or rank, not a tensor, rows past the destination) raises the typed error of
    recording that source alone, naming it (``index``), and records nothing; one without such a
    source records every row."""
    srcs, starts, dst = random_each_call(seed, floating)
    jobs = GatherJobs(dst.dtype if floating else torch.float32, dst.shape[1] if floating else 1, "cpu")
    alone = None
    for k, (start, src) in enumerate(zip(starts.tolist(), srcs)):
        probe = GatherJobs(jobs.dtype, jobs.width, "cpu")
        n = src.shape[0] if isinstance(src, torch.Tensor) and src.dim() else 1
        try:
            if start < 0 or start + n > dst.shape[0]:
                raise IndexError("rows out of range")
            if n:
                (probe.rows if floating else probe.ints)(dst, np.arange(start, start + n), src)
        except (TypeError, ValueError, IndexError, AttributeError):
            alone = k
            break
    try:
        (jobs.rows_each if floating else jobs.ints_each)(dst, starts, srcs)
        failed = None
    except (TypeError, ValueError, IndexError) as exc:
        failed = exc.index
    assert failed == alone
    if failed is None:
        assert jobs.n_float + jobs.n_int == sum(s.shape[0] for s in srcs)
    else:
        assert jobs.n_float == jobs.n_int == 0 and not jobs.float_blocks and not jobs.int_blocks


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
    (lambda j, d, s: j.values(torch.zeros(2, dtype=torch.int64), np.array([2**33 + 7, -2**40])), ValueError),
    (lambda j, d, s: j.values(torch.zeros(2, dtype=torch.int32), [1.5, 2.0]), TypeError),
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
    # a many-source block whose second source's rows run into a row the first one writes
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=8, max_int_rows=4)
    g.jobs.rows_each(dst, [0, 1], [torch.ones(2, 4), torch.ones(1, 4)])
    with pytest.raises(ValueError, match="same destination row"):
        g.launch()
    g.jobs.rows_each(dst, [0, 2], [torch.ones(2, 4), torch.ones(2, 4)])  # the next step: a refused one left nothing
    assert g.launch() == 1 and (dst == 1).all()
    # values over a row an int job writes
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=1, max_int_rows=4, max_values=4)
    flags = torch.zeros(4, dtype=torch.int32)
    g.jobs.ints(flags, [1, 2], torch.tensor([5, 6], dtype=torch.int32))
    g.jobs.values(flags, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="same destination row"):
        g.launch()
    assert (flags == 0).all()
    # two views of one buffer whose rows overlap in part (one starts two elements into the other's)
    g = RowGather(torch.float32, 4, "cpu", max_float_rows=4, max_int_rows=1)
    buf = torch.zeros(20)
    g.jobs.rows(buf[:16].view(4, 4), [1], torch.ones(1, 4))
    g.jobs.rows(buf[2:18].view(4, 4), [1], torch.ones(1, 4))
    with pytest.raises(ValueError, match="same destination row"):
        g.launch()
    g.jobs.rows(buf[:16].view(4, 4), [0, 2], torch.ones(2, 4))  # rows end to end: no overlap
    g.jobs.rows(buf[:16].view(4, 4), [1, 3], torch.ones(2, 4))
    assert g.launch() == 1 and (buf[:16] == 1).all()


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
    with pytest.raises(ValueError, match="grid of 1 rows"):  # fewer rows than the table's records
        g.run_static(grid_rows=1)
    g.jobs.clear()
    g.jobs.rows(torch.zeros(4, 4), [0, 1, 2, 3], torch.ones(4, 4))
    g.jobs.ints(torch.zeros(4, dtype=torch.int32), [0], torch.ones(1, dtype=torch.int32))
    assert g.prepare_static() == 5  # the records: a graph of at least 5 rows carries them out
    g.run_static(grid_rows=5)


def test_int_rows_out_of_order_between_a_runs_ends_copy_row_by_row(use_backend):
    """Destination rows whose first and last would bound a run but that are out of order between
    them (a batch with two rows swapped) are a record per row, and every row lands where it was
    sent, on the Triton interpreter as on the reference."""
    j = GatherJobs(torch.float32, 8, "cpu")
    j.ints(torch.zeros(8, dtype=torch.int32), np.array([4, 6, 5, 7]), torch.arange(4))
    table = np.zeros(TableLayout(j.n_int).words, np.int64)
    assert j.encode(table, TableLayout(j.n_int), 0, 0) == 4
    for backend in ("torch", "triton"):
        use_backend(backend)
        out = torch.zeros(8, dtype=torch.int32)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=8)
        g.jobs.ints(out, np.array([4, 6, 5, 7]), torch.arange(10, 14))
        g.launch()
        assert out.tolist() == [0, 0, 0, 0, 10, 12, 11, 13], backend


def test_int_rows_of_a_strided_source_are_read_through_its_stride(use_backend):
    """A source whose rows are not end to end (every other id of a buffer) is not a run: each row
    is read from where it is, on the Triton interpreter as on the reference."""
    ids = torch.arange(100, 116)
    for backend in ("torch", "triton"):
        use_backend(backend)
        out = torch.zeros(8, dtype=torch.int32)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=8)
        g.jobs.ints(out, np.arange(2, 6), ids[::2][:4])
        g.launch()
        assert out.tolist() == [0, 0, 100, 102, 104, 106, 0, 0], backend


def test_two_value_jobs_of_one_launch_each_write_their_own_values(use_backend):
    """Values of several ``values`` jobs lie one after another in the table: each destination gets
    its own, on the Triton interpreter as on the reference."""
    for backend in ("torch", "triton"):
        use_backend(backend)
        flags, lens = torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=4, max_values=5)
        g.jobs.values(flags, [7, -1, 2])
        g.jobs.values(lens, [40, 50])
        g.launch()
        assert flags.tolist() == [7, -1, 2] and lens.tolist() == [40, 50], backend


def test_many_int_rows_copy_as_the_reference(use_backend):
    """A gather of many int rows (2500 ids, 200 rows of codes) copies what the reference copies, on
    the Triton interpreter and the reference."""
    use_backend("triton")
    ids, codes = torch.arange(2500) * 7 - 1000, torch.arange(1000, dtype=torch.int32).view(200, 5)
    got = {}
    for backend in ("torch", "triton"):
        use_backend(backend)
        out, code_out = torch.zeros(2600, dtype=torch.int32), torch.zeros(210, 5, dtype=torch.int64)
        g = RowGather(torch.float32, 8, "cpu", max_float_rows=1, max_int_rows=3000)
        g.jobs.ints(out, np.arange(50, 2550), ids)
        g.jobs.ints(code_out, np.arange(5, 205), codes)
        assert g.launch() == 1
        got[backend] = (out, code_out)
    assert torch.equal(got["torch"][0], got["triton"][0]) and torch.equal(got["torch"][1], got["triton"][1])
    assert torch.equal(got["triton"][0][50:2550], ids.int()) and torch.equal(got["triton"][1][5:205], codes.long())


def test_lazily_negated_sources_copy_their_values_and_a_negated_destination_is_refused(use_backend):
    """A lazily negated view (``is_neg()``: its memory holds the values before the negation) is
    copied as the values it reads as, by ``rows``, ``rows_each``, ``ints`` and ``ints_each``, on the
    Triton interpreter as on the reference (the kernels read memory: the sign was lost); a
    destination that is such a view is refused, since what the kernels write reads back negated.
    ``test_gpu_gather.py`` runs it on CUDA."""
    check_negated_sources("cpu", ("torch", "triton"), use_backend)


def check_negated_sources(device, backends, use_backend):
    src = torch._neg_view(torch.arange(1.0, 17.0, device=device).view(2, 8))
    ids = torch._neg_view(torch.arange(1, 5, device=device))
    for backend in backends:
        use_backend(backend)
        g = RowGather(torch.float32, 8, device, max_float_rows=8, max_int_rows=16)
        rows, each = torch.zeros(4, 8, device=device), torch.zeros(4, 8, device=device)
        out = torch.zeros(4, dtype=torch.int64, device=device)
        out_each = torch.zeros(6, dtype=torch.int32, device=device)
        g.jobs.rows(rows, [0, 2], src, [1, 0])
        g.jobs.rows_each(each, [0, 3], [src, src[:1]])
        g.jobs.ints(out, np.arange(4), ids)
        g.jobs.ints_each(out_each, [0, 4], [ids, ids[:2]])
        g.launch()
        assert rows[[0, 2]].equal(src[[1, 0]]) and rows[[1, 3]].eq(0).all(), backend
        assert each[:2].equal(src) and each[3].equal(src[0]), backend
        assert out.tolist() == [-1, -2, -3, -4] and out_each.tolist() == [-1, -2, -3, -4, -1, -2], backend
        with pytest.raises(TypeError, match="lazily negated"):
            g.jobs.rows(torch._neg_view(torch.zeros(2, 8, device=device)), [0], src, [0])
        with pytest.raises(TypeError, match="lazily negated"):
            g.jobs.ints(torch._neg_view(torch.zeros(4, dtype=torch.int64, device=device)), np.arange(4), ids)
