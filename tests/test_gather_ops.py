"""The fused row gather (``RowGather`` / ``GatherJobs``): Triton against the torch reference.

On CPU the Triton kernel runs under the interpreter; ``test_gpu_gather.py`` repeats this on CUDA.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gather_cases import check_gather_case
from vllm_omni_kernels.gather import RowGather

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", [1, 8, 300])
def test_triton_gather_matches_reference(dtype, width, monkeypatch):
    for seed in range(3):
        check_gather_case(seed, dtype, width, "cpu", "triton", monkeypatch)


def test_triton_gather_wide_rows_16384(monkeypatch):
    check_gather_case(0, torch.bfloat16, 16384, "cpu", "triton", monkeypatch)


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
