"""Random fused-gather cases run through a ``RowGather`` on two backends, for CPU and CUDA tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_tensor
from vllm_omni_kernels.gather import RowGather


def make_gather_case(seed: int, dtype: torch.dtype, width: int, device="cpu", rows: int = 6):
    """Destinations and a job list: float rows from two sources, int rows of every int32/int64 pairing
    (values within int32 where narrowing), and a value block."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    dsts = {"emb": random_tensor((rows * 2, width), dtype, device, g),
            "pack": random_tensor((rows, width), dtype, device, g),
            "ids32": random_tensor((rows * 2, 1), torch.int32, device, g),
            "codes64": random_tensor((rows, 5), torch.int64, device, g),
            "flags": random_tensor((rows,), torch.int32, device, g),
            "ids1d": random_tensor((rows,), torch.int32, device, g),
            "each_emb": random_tensor((rows * 3, width), dtype, device, g),
            "each_ids": random_tensor((rows * 3,), torch.int32, device, g),
            "each_codes": random_tensor((rows * 3, 5), torch.int64, device, g),
            "run_ids": random_tensor((rows * 2,), torch.int32, device, g),
            "run_codes": random_tensor((rows * 2, 5), torch.int64, device, g)}
    srcs = {"a": random_tensor((rows, width), dtype, device, g),
            "b": random_tensor((rows + 3, width), torch.float32, device, g),  # converted on the host
            "ids64": torch.randint(-2**31, 2**31, (rows, 1), generator=g).to(device),
            "ids32": random_tensor((rows, 1), torch.int32, device, g),
            "codes32": random_tensor((rows, 5), torch.int32, device, g),
            "codes64": random_tensor((rows, 5), torch.int64, device, g),
            "ids1d": random_tensor((rows,), torch.int64, device, g)}
    k = int(rng.integers(0, rows + 1))
    emb_rows = rng.permutation(rows * 2)
    code_rows = rng.permutation(rows)
    id_rows = rng.permutation(rows * 2)
    jobs = [("rows", "emb", emb_rows[:k], "a", rng.permutation(rows)[:k]),
            ("rows", "pack", rng.permutation(rows)[:rows - k], "b", rng.permutation(rows + 3)[:rows - k]),
            ("rows", "emb", emb_rows[k:k + 2], "a", None),
            ("ints", "ids32", id_rows[:k], "ids64", None),
            ("ints", "codes64", code_rows[:k], "codes32", rng.permutation(rows)[:k]),
            ("values", "flags", rng.integers(-5, 5, rows).astype(np.int32), None, None)]
    if k < rows:
        jobs.append(("ints", "codes64", int(code_rows[k]), "codes64", 0))  # single rows: the int fast path
    jobs += [("rows", "emb", int(emb_rows[k + 2]), "a", int(rng.integers(rows))),
             ("ints", "ids1d", int(rng.integers(rows)), "ids1d", int(rng.integers(rows))),
             ("ints", "ids32", int(id_rows[k]), "ids1d", 1)]
    # Blocks of consecutive int rows on both sides (a batch's ids at consecutive offsets): leading
    # rows and explicit rows; one-row jobs and one-row sources next to each other.
    first = int(rng.integers(0, rows))
    jobs += [("ints", "run_ids", np.arange(first, first + rows), "ids1d", None),
             ("ints", "run_codes", np.arange(rows - k, rows), "codes32", np.arange(k)),
             ("ints", "run_codes", rows + 1, "codes64", 2), ("ints", "run_codes", rows + 2, "codes64", 3),
             ("ints_each", "run_codes", np.array([rows + 3, rows + 4]), [("codes64", 4, 1), ("codes64", 5, 1)], None)]
    # Many small sources at once (a mixed batch's hook outputs): (name, first row, rows) each, into
    # disjoint destination spans in shuffled order.
    for kind, dst, src in (("rows_each", "each_emb", "a"), ("ints_each", "each_ids", "ids64"),
                           ("ints_each", "each_codes", "codes32")):
        spans = rng.integers(0, 3, rows)  # 0, 1 or 2 rows per source
        starts = np.concatenate(([0], np.cumsum(spans + 1)[:-1]))  # a gap row after each span
        order = rng.permutation(rows)
        pieces = [(src, int(rng.integers(0, rows - spans[i] + 1)), int(spans[i])) for i in order]
        jobs.append((kind, dst, starts[order], pieces, None))
    return dsts, srcs, jobs


def record_gather_case(jobs, dsts, srcs, case_jobs) -> None:
    """Record a case's jobs into a ``GatherJobs``."""
    for kind, dst, dst_rows, src, src_rows in case_jobs:
        if kind == "values":
            jobs.values(dsts[dst], dst_rows)
        elif kind.endswith("_each"):
            pieces = [srcs[name][i:i + n] for name, i, n in src]
            if kind == "ints_each" and dsts[dst].dim() == 1:
                pieces = [t.reshape(-1) for t in pieces]
            getattr(jobs, kind)(dsts[dst], dst_rows, pieces)
        else:
            getattr(jobs, kind)(dsts[dst], dst_rows, srcs[src], src_rows)


def run_gather_case(case, dtype, width, device, backend, monkeypatch) -> dict:
    dsts, srcs, jobs = case
    dsts = {k: v.clone() for k, v in dsts.items()}
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", backend)
    gather = RowGather(dtype, width, device, max_float_rows=64, max_int_rows=64, max_values=64)
    record_gather_case(gather.jobs, dsts, srcs, jobs)
    assert gather.launch() == 1
    return dsts


def check_gather_case(seed, dtype, width, device, backend, monkeypatch):
    case = make_gather_case(seed, dtype, width, device)
    want = run_gather_case(case, dtype, width, device, "torch", monkeypatch)
    got = run_gather_case(case, dtype, width, device, backend, monkeypatch)
    if device != "cpu":
        torch.cuda.synchronize()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs ({backend}, {dtype}, width {width}, seed {seed})"
    return got


def check_far_apart_rows(device, backend, monkeypatch, graph: bool = False):
    """Rows 2**32 elements and more apart (the two ends of 10 GB of address space, touched only
    there) gathered both ways, as float rows, int rows and each-blocks: every offset the table
    carries keeps its high bits and sign (int64 records, ops/layout.py). ``graph``: also through the
    resident table a captured step reads (``prepare_static``/``run_static``)."""
    monkeypatch.setenv("VLLM_OMNI_KERNELS_BACKEND", backend)
    width, n = 64, 4
    big = torch.empty(5 * 2**30, dtype=torch.bfloat16, device=device)
    low, high = big[:n * width].view(n, width), big[-n * width:].view(n, width)
    ints, past = big.view(torch.int32), n * width // 2  # int rows next to the float rows
    ilow, ihigh = ints[past:past + 2 * n].view(n, 2), ints[-past - 2 * n:-past].view(n, 2)
    gather = RowGather(torch.bfloat16, width, device, max_float_rows=3 * n, max_int_rows=3 * n)
    anchor = gather.anchor.data_ptr()
    assert max(abs(t.data_ptr() - anchor) for t in (low, high)) >= 2**33  # offsets past 32 bits
    for step in range(2):
        low.copy_(torch.randn(n, width).to(torch.bfloat16))
        ihigh.copy_(torch.randint(-(2**31), 2**31 - 1, (n, 2), dtype=torch.int32))
        high.zero_()
        ilow.zero_()
        want_high, want_ilow = low.clone(), ihigh.clone()
        j = gather.jobs
        j.rows(high, np.arange(n)[::-1].copy(), low, np.arange(n)[::-1].copy())
        j.ints(ilow, np.arange(n - 1), ihigh, np.arange(n - 1))
        j.ints_each(ilow, np.array([n - 1]), [ihigh[n - 1:]])
        if graph and step:
            gather.prepare_static()
            gather.run_static(2 * n)
            j.clear()
        else:
            assert gather.launch() == 1
        if device != "cpu":
            torch.cuda.synchronize()
        assert torch.equal(high, want_high) and torch.equal(ilow, want_ilow)
    del big


def random_each_call(seed: int, floating: bool, device="cpu"):
    """One random ``rows_each``/``ints_each`` call, ``(srcs, starts, dst)``, for the many-source
    checkers: mostly plain sources (views at any row of a larger tensor, so aligned or not, 0 to 3
    rows), now and then one that is not (another dtype, a strided row, another width or rank, a
    row's element count in another shape, not a tensor), and start rows that may fall outside
    ``dst``."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    if floating:
        dtype = [torch.float32, torch.bfloat16, torch.float16][int(rng.integers(3))]
        width = int(rng.choice([1, 8, 33]))
        dst = random_tensor((12, width), dtype, device, g)
        big = random_tensor((16, width), dtype, device, g)
        wrong = [big.to(torch.float64 if dtype is torch.float32 else torch.float32)[:1],
                 random_tensor((2, 2 * width), dtype, device, g)[:, ::2], big[:1, :max(width - 1, 0)],
                 big[0], "not a tensor"]
        if width > 1:  # a row's element count in another shape
            wrong.append(big[:1].reshape(width, 1))
    else:
        one_d = rng.random() < 0.5
        width = 1 if one_d else 5
        dtypes = [torch.int32, torch.int64]
        dst = random_tensor((12,) if one_d else (12, 5), dtypes[int(rng.integers(2))], device, g)
        big = random_tensor((16,) if one_d else (16, 5), dtypes[int(rng.integers(2))], device, g)
        other = random_tensor((16,) if one_d else (16, 5), dtypes[int(rng.integers(2))], device, g)
        wrong = [big.float()[:1], big[:1].unsqueeze(0) if one_d else big[:1, :4], "not a tensor"]
        if not one_d:
            wrong += [random_tensor((2, 10), torch.int32, device, g)[:, ::2], big[:1].reshape(5, 1)]
    srcs = []
    for _ in range(int(rng.integers(1, 9))):
        if rng.random() < 0.08:
            srcs.append(wrong[int(rng.integers(len(wrong)))])
        else:
            pick = big if floating or rng.random() < 0.5 else other
            first = int(rng.integers(0, 13))
            srcs.append(pick[first:first + int(rng.integers(0, 4))])
    starts = rng.integers(-1, 12, len(srcs)).astype(np.int64)
    if rng.random() < 0.7:  # mostly in range
        starts = np.clip(starts, 0, 12 - np.array([s.shape[0] if isinstance(s, torch.Tensor) and s.dim() else 1
                                                    for s in srcs]))
    return srcs, starts, dst


__all__ = ["make_gather_case", "record_gather_case", "run_gather_case", "check_gather_case", "check_far_apart_rows",
           "random_each_call", "pytest"]
