"""Triton ring kernels (interpreter on CPU) against the torch reference, on identical inputs."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ALL_DTYPES, stable_seed
from ring_cases import check_case

FRAMES = [((), True), ((2,), True), ((3,), False), ((2, 3), False), ((), False)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("frame_shape, last", FRAMES)
@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_triton_matches_reference_every_dtype_and_layout(dtype, frame_shape, last, read):
    check_case(stable_seed(dtype, frame_shape, last, read), dtype=dtype, frame_shape=frame_shape,
               last=last, read=read, rows=4, max_cap=24)


def test_triton_wide_rows_up_to_16384():
    check_case(7, dtype=ALL_DTYPES[1], frame_shape=(16384,), last=False, read=False, rows=2, max_cap=3)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), rows=st.integers(0, 5), max_cap=st.integers(1, 40),
       dtype=st.sampled_from(ALL_DTYPES), layout=st.sampled_from(FRAMES), read=st.booleans())
def test_property_random_batches_lengths_and_wrap(seed, rows, max_cap, dtype, layout, read):
    frame_shape, last = layout
    check_case(seed, dtype=dtype, frame_shape=frame_shape, last=last, read=read, rows=rows, max_cap=max_cap)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("frame_shape, last, max_cap", [((), True, 6000), ((2,), True, 3000), ((700,), False, 12)])
def test_triton_multi_program_rows_advance_head_once(seed, frame_shape, last, max_cap):
    """Rows longer than one program's block: several programs per row, the last ticket publishes."""
    for read in (False, True):
        check_case(seed, dtype=ALL_DTYPES[0], frame_shape=frame_shape, last=last, read=read, rows=2,
                   max_cap=max_cap)


def test_triton_puts_a_rows_programs_on_the_grids_first_axis(monkeypatch):
    """A row may have up to 2**31 - 1 elements (twelve 1080p RGB frames are 75 million): its
    programs go on the grid's first axis, which CUDA lets hold that many, and the rows on the
    second (65535 at most), as the CUDA kernels do."""
    from vllm_omni_kernels.ops import triton_ring

    grids = []
    monkeypatch.setattr(triton_ring, "_write", lambda grid, *args, **kwargs: grids.append(grid))
    monkeypatch.setattr(triton_ring, "_read", lambda grid, *args, **kwargs: grids.append(grid))
    x, frame = torch.empty(0), 3 * 1080 * 1920
    triton_ring.ring_write(x, x, x, x, rows=3, frame_elems=frame, last=False, max_elems=12 * frame)
    triton_ring.ring_read(x, x, x, rows=3, frame_elems=frame, last=False, max_elems=12 * frame)
    assert [g[1] for g in grids] == [3, 3] and all(g[0] > 65535 for g in grids)
