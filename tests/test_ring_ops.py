"""Triton ring kernels (interpreter on CPU) against the torch reference, on identical inputs."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ALL_DTYPES
from ring_cases import assert_same, make_case

FRAMES = [((), True), ((2,), True), ((3,), False), ((2, 3), False), ((), False)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("frame_shape, last", FRAMES)
@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_triton_matches_reference_every_dtype_and_layout(dtype, frame_shape, last, read):
    rng = np.random.default_rng(hash((str(dtype), frame_shape, last, read)) % 2**32)
    case = make_case(rng, dtype=dtype, last=last, frame_shape=frame_shape, rows=4, read=read)
    assert_same(case, "triton", read=read)


def test_triton_wide_rows_up_to_16384():
    rng = np.random.default_rng(7)
    case = make_case(rng, dtype=ALL_DTYPES[1], last=False, frame_shape=(16384,), rows=2, max_cap=3)
    assert_same(case, "triton", read=False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 5), max_cap=st.integers(1, 40),
       dtype=st.sampled_from(ALL_DTYPES), layout=st.sampled_from(FRAMES), read=st.booleans())
def test_property_random_batches_lengths_and_wrap(seed, rows, max_cap, dtype, layout, read):
    frame_shape, last = layout
    case = make_case(np.random.default_rng(seed), dtype=dtype, last=last, frame_shape=frame_shape, rows=rows,
                     max_cap=max_cap, read=read)
    assert_same(case, "triton", read=read)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("frame_shape, last, max_cap", [((), True, 6000), ((2,), True, 3000), ((700,), False, 12)])
def test_triton_multi_program_rows_advance_head_once(seed, frame_shape, last, max_cap):
    """Rows longer than one program's block: several programs per row, the last ticket publishes."""
    rng = np.random.default_rng(seed)
    for read in (False, True):
        case = make_case(rng, dtype=ALL_DTYPES[0], last=last, frame_shape=frame_shape, rows=2, max_cap=max_cap,
                         read=read)
        assert_same(case, "triton", read=read)
