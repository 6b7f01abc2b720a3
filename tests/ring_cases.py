"""Random ring-copy cases shared by the CPU (interpreter) and GPU kernel tests.

A case is everything the ops take: an arena with non-overlapping slot regions, a state table with
random device heads, metadata rows (distinct slots, random positions incl. -1 = device head, lengths
0..capacity) and a linear tensor. ``run_case`` runs one backend on private copies; tests compare the
results of a kernel backend with the reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from conftest import random_tensor
from vllm_omni_kernels import ops
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ops.layout import BASE, CAP, HEAD_SHIFT, LIN_OFF, LIN_STRIDE, META_COLS, N, POS, SLOT
from vllm_omni_kernels.ring import RingPool


@dataclasses.dataclass
class Case:
    arena: torch.Tensor
    state: torch.Tensor
    meta: torch.Tensor
    lin: torch.Tensor
    rows: int
    frame_elems: int
    last: bool
    max_elems: int


def make_case(rng: np.random.Generator, *, dtype, last: bool, frame_shape=(), rows=4, max_cap=24,
              device="cpu", read=False, use_device_head=True) -> Case:
    F = math.prod(frame_shape)
    slots_total = rows + 2
    caps = rng.integers(1, max_cap + 1, size=rows)
    slot_ids = rng.permutation(slots_total)[:rows]
    bases = np.concatenate(([0], np.cumsum(caps)[:-1])) * F
    arena_elems = int(caps.sum()) * F + 7 * F  # trailing elements nobody may touch
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    arena = random_tensor((arena_elems,), dtype, generator=gen)
    heads = rng.integers(0, max_cap, size=slots_total)
    n = np.array([int(rng.integers(0, c + 1)) for c in caps], dtype=np.int64)
    meta = torch.zeros(rows + 3, META_COLS, dtype=torch.int64)  # extra rows beyond `rows` are ignored
    meta[rows:] = 999
    lin_off, off = [], 0
    strides = []
    for i in range(rows):
        pad = int(rng.integers(0, 3))
        stride = (int(n[i]) + pad) if last else F + 0
        strides.append(stride)
        lin_off.append(off + pad)
        off += pad + stride * (F if last else int(n[i])) + 1
    lin = random_tensor((off + 1,), dtype, generator=gen)
    for i in range(rows):
        cap = int(caps[i])
        heads[slot_ids[i]] %= cap
        pos = int(rng.integers(0, cap))
        if not read and use_device_head and rng.random() < 0.5:
            pos = -1
        meta[i, SLOT], meta[i, LIN_OFF], meta[i, N] = int(slot_ids[i]), lin_off[i], int(n[i])
        meta[i, BASE], meta[i, CAP], meta[i, POS], meta[i, LIN_STRIDE] = int(bases[i]), cap, pos, strides[i]
    state = torch.from_numpy(heads.astype(np.int64) << HEAD_SHIFT)
    max_elems = int(n.max()) * F if rows else 0
    dev = torch.device(device)
    return Case(arena.to(dev), state.to(dev), meta.to(dev), lin.to(dev), rows, F, last, max_elems)


def run_case(case: Case, backend: str, *, read: bool):
    """Run one backend on copies of the case; return (arena, state, lin) after the op."""
    arena, state, lin = case.arena.clone(), case.state.clone(), case.lin.clone()
    old = os.environ.get("VLLM_OMNI_KERNELS_BACKEND")
    os.environ["VLLM_OMNI_KERNELS_BACKEND"] = backend
    try:
        if read:
            ops.ring_read(arena, case.meta, lin, rows=case.rows, frame_elems=case.frame_elems, last=case.last,
                          max_elems=case.max_elems)
        else:
            ops.ring_write(arena, state, case.meta, lin, rows=case.rows, frame_elems=case.frame_elems,
                           last=case.last, max_elems=case.max_elems)
    finally:
        if old is None:
            os.environ.pop("VLLM_OMNI_KERNELS_BACKEND")
        else:
            os.environ["VLLM_OMNI_KERNELS_BACKEND"] = old
    if arena.is_cuda:
        torch.cuda.synchronize()
    return arena.cpu(), state.cpu(), lin.cpu()


def assert_same(case: Case, backend: str, *, read: bool) -> None:
    ref = run_case(case, "torch", read=read)
    got = run_case(case, backend, read=read)
    for name, r, g in zip(("arena", "state", "linear"), ref, got):
        assert torch.equal(r.view(torch.uint8) if r.dtype.itemsize else r, g.view(torch.uint8)), \
            f"{backend} differs from the reference in {name}"
    if not read:
        assert int((got[1] & ((1 << HEAD_SHIFT) - 1)).abs().sum()) == 0, "tickets must be 0 after a launch"


def check_case(seed: int, *, dtype, frame_shape, last: bool, read: bool, rows: int, max_cap: int,
               device="cpu", backend="triton") -> None:
    """One random case from ``seed``, run through ``backend`` and the reference, compared bit for bit."""
    case = make_case(np.random.default_rng(seed), dtype=dtype, last=last, frame_shape=frame_shape, rows=rows,
                     max_cap=max_cap, device=device, read=read)
    assert_same(case, backend, read=read)


def check_graph_of_appends(launches: int, replays: int = 2) -> None:
    """One CUDA graph holding ``launches`` appends of CONCAT_DIM0 rows (16 requests, lengths 0..60),
    replayed ``replays`` times: the heads advance on the device, so every request ends up with its
    chunk 1 + launches * replays times (the warm-up appended it once)."""
    pool = RingPool("codes", torch.float32, (3,), "cuda", S.CONCAT_DIM0, budget_bytes=64 << 20,
                    initial_frames=1 << 14)
    ids = [f"r{i}" for i in range(16)]
    for r in ids:
        pool.alloc(r)
    src = torch.randn(16, 64, 3, device="cuda")
    lens = np.arange(16) * 4
    sa = pool.static_append(ids, src, lens)
    graph = sa.capture_graph(launches)
    for _ in range(replays):
        sa.prepare(launches)
        graph.replay()
    for b, out in enumerate(pool.consolidate(ids)):
        assert torch.equal(out, src[b, : lens[b]].repeat(1 + launches * replays, 1))


def check_complex_pool(device: str, strategy: S, frame: tuple, *, wide_refused: bool) -> None:
    """complex64 chunks of two requests appended over three steps come back bit for bit; complex128
    is refused when a pool is made (``wide_refused``: a kernel backend), naming it, or kept."""
    def make(dtype):
        return RingPool("audio", dtype, frame, device, strategy, budget_bytes=1 << 16, initial_frames=8)

    last = strategy is S.CONCAT_LAST
    pool = make(torch.complex64)
    chunks = {r: [torch.randn(*((*frame, n) if last else (n, *frame)), dtype=torch.complex64, device=device)
                  for n in (3, 0, 5)] for r in ("a", "b")}
    for r in chunks:
        pool.alloc(r)
    for step in range(3):
        assert not pool.append(list(chunks), [chunks[r][step] for r in chunks]).errors
    for r, got in zip(chunks, pool.consolidate(list(chunks))):
        assert torch.equal(got.view(torch.int64), torch.cat(chunks[r], dim=-1 if last else 0).view(torch.int64))
    if wide_refused:
        with pytest.raises(ValueError, match="'audio'.*16 bytes"):
            make(torch.complex128)
    else:
        assert make(torch.complex128).dtype == torch.complex128
