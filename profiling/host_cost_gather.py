"""Host time of the fused gather's eager step: how much of ``ours_eager`` in bench_gather.py is
bookkeeping on this host. On CPU (default) the kernels are stubbed (the Triton backend's encoding
runs); with ``--device cuda`` everything runs on the selected backend.

Per scenario (``mtp``: one batched MTP run of B rows; ``non_mtp``: B decode rows of a model without
MTP; ``mixed``: B single-row MTP runs, each row its own hook output, recorded with one call per
destination as the runner does) it reports the host time of a whole step and of one launch call
alone (``launch_pre``/``launch_post``, recording excluded), and the host's floor: one small torch op
(``tiny.zero_()``). The scenarios and the floor are timed in interleaved rounds and each figure is
the median round, so they are compared under the same drift of a shared host's speed.

``--sync-every 1`` waits for the device after every step, as a serving loop does when it reads the
step's sampled tokens back: each launch call then starts with the device idle and the host fresh
from a wait (by default only each round ends with a wait).

``--after-profiler`` runs one short ``torch.profiler`` session (CUDA activities) before the timing,
as a benchmark that counts its kernels with the profiler does. The profiler leaves CUPTI attached
to the process when the session ends (Kineto finalizes it only with ``TEARDOWN_CUPTI=1``), and every
later launch pays for its callbacks: this flag shows how much, against a run without it.

Usage: python profiling/host_cost_gather.py [--batches 64] [--H 2048] [--kinds mtp,non_mtp,mixed]
       [--device cpu|cuda] [--steps 500] [--rounds 7] [--profile] [--extension build/_vok_ops.so]
       [--per-row] [--sync-every N] [--after-profiler]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_omni_kernels import ops  # noqa: E402
from vllm_omni_kernels.decode_gather import DecodeGather  # noqa: E402


class Scenario:
    """One decode step's gather work on prepared tensors; ``step()`` returns the seconds spent in
    its launch calls."""

    def __init__(self, kind: str, B: int, H: int, dev: str, per_row: bool = False):
        self.kind, self.B, self.per_row = kind, B, per_row
        mtp = kind != "non_mtp"
        self.g = g = DecodeGather(hidden_size=H, dtype=torch.bfloat16, device=dev, max_rows=B, max_tokens=B,
                                  mtp=mtp)
        self.ids, self.emb = torch.arange(B, device=dev), torch.zeros(B, H, dtype=torch.bfloat16, device=dev)
        self.input_ids = torch.zeros(B, dtype=torch.int32, device=dev)
        self.inputs_embeds = torch.zeros(B, H, dtype=torch.bfloat16, device=dev)
        self.codes = torch.zeros(B, 16, dtype=torch.int64, device=dev)
        if mtp:
            g.codes = torch.zeros(B, 16, dtype=torch.int64, device=dev)
        self.off, self.flags = np.arange(B), np.ones(B, np.int32)
        self.row_ids = [self.ids[i:i + 1] for i in range(B)]
        self.row_embs = [self.emb[i:i + 1] for i in range(B)]

    def step(self) -> float:
        g, clock = self.g, time.perf_counter
        if self.kind == "mixed" and self.per_row:  # the same outputs, one record call each (before rows_each)
            for i, (row_ids, row_emb) in enumerate(zip(self.row_ids, self.row_embs)):
                g.add_ids(self.input_ids, i, row_ids)
                g.add_mtp_inputs(i, row_ids, row_emb, row_emb, row_emb)
        elif self.kind == "mixed":  # B one-row hook outputs, collected and recorded as the runner does
            ids, embs = self.row_ids, self.row_embs
            g.add_ids_each(self.input_ids, self.off, ids)
            g.add_mtp_inputs_each(self.off, ids, embs, embs, embs)
        else:
            g.add_ids(self.input_ids, self.off, self.ids)
            if self.kind == "mtp":
                g.add_mtp_inputs(self.off, self.ids, self.emb, self.emb, self.emb)
            else:
                g.add_embeds(self.inputs_embeds, self.off, self.emb)
        if self.kind != "non_mtp":
            g.add_flags(self.flags)
        t0 = clock()
        g.launch_pre()
        spent = clock() - t0
        if self.kind != "non_mtp":
            g.add_mtp_outputs(self.inputs_embeds, self.off, self.emb, self.codes, self.off)
            t0 = clock()
            g.launch_post()
            spent += clock() - t0
        return spent

    @property
    def launches(self) -> int:
        return 1 if self.kind == "non_mtp" else 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64")
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kinds", default="mtp,non_mtp,mixed")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--extension", help="on CPU: a built _vok_ops.so whose steps run host-only (they encode "
                                        "without launching): the compiled backend's host work")
    ap.add_argument("--per-row", action="store_true", help="mixed: one record call per row (no rows_each)")
    ap.add_argument("--sync-every", type=int, default=0, help="wait for the device after every N steps (cuda; "
                                                              "0: at the end of each round only)")
    ap.add_argument("--after-profiler", action="store_true",
                    help="cuda: run one torch.profiler session before timing (it leaves CUPTI attached)")
    args = ap.parse_args()
    dev = args.device
    sync_every = args.sync_every if dev == "cuda" else 0
    if dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("VLLM_OMNI_KERNELS_BACKEND", "triton")
        ops.row_gather = lambda *a, **k: None  # the table is still encoded and "uploaded" (host buffer)
        if args.extension:
            from vllm_omni_kernels.ops import cuda_ext

            cuda_ext._module = cuda_ext.import_extension(Path(args.extension))
            ops.gather_step = lambda is_cuda: cuda_ext.gather_step
    scenarios = [Scenario(kind, int(B), args.H, dev, args.per_row)
                 for B in args.batches.split(",") for kind in args.kinds.split(",")]
    step_us = {id(sc): [] for sc in scenarios}
    launch_us = {id(sc): [] for sc in scenarios}
    tiny, floor_us = torch.zeros(1, device=dev), []  # one torch op per round: this host's floor
    if args.after_profiler and dev == "cuda":
        from cuda_timing import profiler_session

        profiler_session()
        print("after one torch.profiler session (CUPTI left attached unless TEARDOWN_CUPTI=1)")
    for r in range(args.rounds + 1):  # round 0 warms up
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tiny.zero_()
        if dev == "cuda":
            torch.cuda.synchronize()
        if r:
            floor_us.append((time.perf_counter() - t0) / args.steps * 1e6)
        for sc in scenarios:
            steps = args.steps if sc.kind != "mixed" else max(1, args.steps // 10)
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            in_launch = 0.0
            for k in range(steps):
                in_launch += sc.step()
                if sync_every and (k + 1) % sync_every == 0:
                    torch.cuda.synchronize()
            if dev == "cuda":
                torch.cuda.synchronize()
            if r:
                step_us[id(sc)].append((time.perf_counter() - t0) / steps * 1e6)
                launch_us[id(sc)].append(in_launch / (steps * sc.launches) * 1e6)
    what = "kernels launched" if dev == "cuda" else "kernels stubbed"
    print(f"floor: tiny.zero_() (one torch op: dispatcher + launch) {statistics.median(floor_us):6.2f} us "
          f"(median of {len(floor_us)} rounds, {min(floor_us):.2f} to {max(floor_us):.2f})")
    for sc in scenarios:
        lu = launch_us[id(sc)]
        print(f"{sc.kind:8s} B={sc.B:5d}: {statistics.median(step_us[id(sc)]):8.1f} us of host work per step "
              f"({what}); one launch call alone {statistics.median(lu):6.2f} us (median of {len(lu)} rounds, "
              f"{min(lu):.2f} to {max(lu):.2f})", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        sc = scenarios[0]
        prof.runcall(lambda: [sc.step() for _ in range(args.steps)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
