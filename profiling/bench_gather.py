"""Fused decode gather vs the baselines, per engine step, in one process.

Scenarios (bf16, B rows, hidden size H; B in 8, 64, 256, 1024; H in 2048, 4096):
  mtp      B single-token decode rows of an MTP model (one batched hook run): before MTP, ids into
           input_ids and the MTP inputs packed (ids, embeddings, last hidden, text step); after MTP,
           embeddings to their token offsets and codes (16 per row) into the per-request code buffer
  non_mtp  B single-token decode rows of a model without MTP: ids and embeddings into the buffers
  mixed    B rows alternating a 4-token prefill chunk (scalar hook: its embeddings) and an MTP decode
           row (each its own hook run, as the prefill rows flush them); like the runner, ours
           collects those per-row outputs and records them with one call per destination
           (``ints_each``/``rows_each``)

Paths (the hooks' and MTP's outputs are prepared tensors: only the data movement is measured):
  row_loop     upstream style: one copy per row per tensor (7 per MTP row, 2 per non-MTP row, 1 per
               prefill chunk)
  index_copy   index tensors built on the host per step (torch.tensor -> H2D), index_copy_ for the
               scattered writes and slice copies for the dense MTP packing
  ours_eager   DecodeGather: jobs recorded on the host, pre.launch() + post.launch() (one table upload
               and one kernel each; one of each without MTP)
  ours_graph   the same two kernels captured ``graph_steps`` times in one CUDA graph (table prepared
               per step outside the graph); also reported per launch
  ours_eager[b], ours_graph[b]
               the same per kernel backend b (triton, cuda, cupy, and cuda_no_pdl, triton_no_pdl:
               launched without programmatic dependent launch); for each also the host time of one
               eager launch call alone (``pre.launch()``/``post.launch()``, recording excluded)
  copy_graph   one plain copy of the same float bytes per step, captured the same way (the copy
               bandwidth the kernels are compared with)
  copy2_graph  with MTP: two plain copies in turn, of the bytes each launch moves (the post launch's
               sources exist only after MTP, so any implementation makes two dependent launches);
               also each launch alone in a graph against a copy of its own bytes (``per_launch``)

Launches per step of the eager paths are counted with the CUDA profiler (kernels and memcpys), in
a last pass after all timings: a profiler session leaves CUPTI attached to the process, and every
later launch pays for its callbacks; those of the captured paths are what they capture (a plain
``copy_`` of one dtype is a device-to-device memcpy). In the mixed step the baselines read the
hooks' outputs as the dense tensors they are views of (the per-row views' concatenation that an
``index_copy`` of per-row outputs would need is not counted), and with MTP this package's step
also writes the per-row code flags, which they do not. Medians of ``repeats`` timings of ``steps`` steps, CUDA
events, after a warm-up. JSON out; PNG with ``plot.py``.

Usage: python profiling/bench_gather.py [--steps 50] [--repeats 5] [--out out/bench_gather.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import (backend_variant, backend_variants, count_device_ops, graph_us_per_step,  # noqa: E402
                         host_floor_us, us_per_call)
from vllm_omni_kernels import backend  # noqa: E402
from vllm_omni_kernels.gather import DecodeGather  # noqa: E402
from vllm_omni_kernels.profiling import nvtx_range  # noqa: E402

Q = 16
PREFILL_SPAN = 4
DTYPE = torch.bfloat16


class Scenario:
    """Runner buffers, the hooks' outputs and the MTP outputs of one step shape."""

    def __init__(self, kind: str, B: int, H: int):
        dev = torch.device("cuda")
        self.kind, self.B, self.H = kind, B, H
        if kind == "mixed":
            self.n_dec = B // 2
            self.n_pre = B - self.n_dec
            spans = np.array([PREFILL_SPAN if r % 2 == 0 else 1 for r in range(B)])
        else:
            self.n_dec, self.n_pre = B, 0
            spans = np.ones(B, np.int64)
        starts = np.concatenate(([0], np.cumsum(spans)[:-1])).astype(np.int64)
        self.tokens = int(spans.sum())
        dec_rows = np.flatnonzero(spans == 1) if kind == "mixed" else np.arange(B)
        self.dec_off = starts[dec_rows]
        self.pre_off = starts[spans != 1]
        self.mtp = kind != "non_mtp"
        n = self.n_dec
        self.input_ids = torch.zeros(self.tokens, dtype=torch.int32, device=dev)
        self.inputs_embeds = torch.zeros(self.tokens, H, dtype=DTYPE, device=dev)
        self.ids = torch.randint(0, 30000, (n,), device=dev)
        self.emb = torch.randn(n, H, device=dev).to(DTYPE)
        self.hid = torch.randn(n, H, device=dev).to(DTYPE)
        self.txt = torch.randn(n, H, device=dev).to(DTYPE)
        self.pre_emb = torch.randn(self.n_pre * PREFILL_SPAN, H, device=dev).to(DTYPE)
        self.mtp_emb = torch.randn(n, H, device=dev).to(DTYPE)
        self.codes = torch.randint(0, 4096, (n, Q), device=dev)
        self.slots = np.arange(n, dtype=np.int64)
        self.mtp_index = np.arange(n, dtype=np.int64)
        self.flags = (spans == 1).astype(np.int32) if self.mtp else None
        self.g = DecodeGather(hidden_size=H, dtype=DTYPE, device=dev, max_rows=B, max_tokens=self.tokens,
                              mtp=self.mtp)
        if self.mtp:
            self.g.codes = torch.zeros(B, Q, dtype=torch.int64, device=dev)
        # per-row views, made once (a real runner gets them from the hooks)
        self.row_ids = [self.ids[i:i + 1] for i in range(n)]
        self.row_emb = [self.emb[i:i + 1] for i in range(n)]
        self.row_hid = [self.hid[i:i + 1] for i in range(n)]
        self.row_txt = [self.txt[i:i + 1] for i in range(n)]
        self.row_pre = [self.pre_emb[k * PREFILL_SPAN:(k + 1) * PREFILL_SPAN] for k in range(self.n_pre)]

    def float_rows(self) -> int:
        return self.n_dec * (4 if self.mtp else 1) + self.n_pre * PREFILL_SPAN

    # ------------------------------------------------------------ ours
    def record_pre(self):
        g, n = self.g, self.n_dec
        if self.kind == "mixed":  # one hook output per row, recorded with one call per destination (the runner)
            g.pre.jobs.ints_each(self.input_ids, self.dec_off, self.row_ids)
            g.add_mtp_inputs_each(self.mtp_index, self.row_ids, self.row_emb, self.row_hid, self.row_txt)
            g.pre.jobs.rows_each(self.inputs_embeds, self.pre_off, self.row_pre)
        else:
            g.pre.jobs.ints(self.input_ids, self.dec_off, self.ids)
            if self.mtp:
                g.add_mtp_inputs(np.arange(n), self.ids, self.emb, self.hid, self.txt)
            else:
                g.pre.jobs.rows(self.inputs_embeds, self.dec_off, self.emb)
        if self.mtp:
            g.add_flags(self.flags)

    def record_post(self):
        self.g.add_mtp_outputs(self.inputs_embeds, self.dec_off, self.mtp_emb, self.codes, self.slots)

    def static_step(self):
        """Record the step's jobs again and upload them at the gathers' capacity layout (what precedes
        a replay); returns the step's kernels (``run_static``, to capture) and the (gather, jobs) of
        each launch."""
        gathers = [(self.g.pre, self.record_pre)] + ([(self.g.post, self.record_post)] if self.mtp else [])
        for g, record in gathers:
            g.jobs.clear()
            record()
            g.prepare_static()
        launches = [(g, g.jobs.n_float + g.jobs.n_int) for g, _ in gathers]

        def kernels():
            for g, jobs in launches:
                g.run_static(jobs)

        return kernels, launches

    def ours_eager(self):
        self.record_pre()
        self.g.pre.launch()
        if self.mtp:
            self.record_post()
            self.g.post.launch()

    def launch_host_us(self, steps: int, repeats: int) -> tuple[list[float], list[float]]:
        """Host microseconds per eager launch call alone (recording excluded): ``pre.launch()`` and
        ``post.launch()`` timed with the host clock around the calls; the kernels run asynchronously.
        Each run is followed by ``steps`` calls of one small torch op, this host's floor at that
        moment (a shared host's speed drifts); returns the runs and the floors."""
        runs, floors = [], []
        clock = time.perf_counter
        for _ in range(repeats + 1):  # the first run warms up
            spent = 0.0
            for _ in range(steps):
                self.record_pre()
                t0 = clock()
                self.g.pre.launch()
                spent += clock() - t0
                if self.mtp:
                    self.record_post()
                    t0 = clock()
                    self.g.post.launch()
                    spent += clock() - t0
            torch.cuda.synchronize()
            runs.append(spent * 1e6 / (steps * (2 if self.mtp else 1)))
            floors.append(host_floor_us(steps))
        return runs[1:], floors[1:]

    def eager_paths(self) -> dict:
        return {"ours_eager": self.ours_eager, "index_copy": self.index_copy, "row_loop": self.row_loop}

    # ------------------------------------------------------------ baselines
    def row_loop(self):
        g = self.g
        for k in range(self.n_pre):
            o = int(self.pre_off[k])
            self.inputs_embeds[o:o + PREFILL_SPAN].copy_(self.row_pre[k])
        for i in range(self.n_dec):
            o = int(self.dec_off[i])
            self.input_ids[o:o + 1].copy_(self.row_ids[i])
            if self.mtp:
                g.mtp_input_ids[i:i + 1].copy_(self.row_ids[i])
                g.mtp_inputs_embeds[i:i + 1].copy_(self.row_emb[i])
                g.last_hidden[i:i + 1].copy_(self.row_hid[i])
                g.text_step[i:i + 1].copy_(self.row_txt[i])
            else:
                self.inputs_embeds[o:o + 1].copy_(self.row_emb[i])
        if self.mtp:
            for i in range(self.n_dec):
                o = int(self.dec_off[i])
                self.inputs_embeds[o:o + 1].copy_(self.mtp_emb[i:i + 1])
                g.codes[i:i + 1].copy_(self.codes[i:i + 1])

    def index_copy(self):
        g, n, dev = self.g, self.n_dec, self.input_ids.device
        idx = torch.tensor(self.dec_off.tolist(), device=dev)
        self.input_ids.index_copy_(0, idx, self.ids.to(torch.int32))
        if self.n_pre:
            pidx = torch.tensor((self.pre_off[:, None] + np.arange(PREFILL_SPAN)).reshape(-1).tolist(), device=dev)
            self.inputs_embeds.index_copy_(0, pidx, self.pre_emb)
        if self.mtp:
            g.mtp_input_ids[:n].copy_(self.ids)
            g.mtp_inputs_embeds[:n].copy_(self.emb)
            g.last_hidden[:n].copy_(self.hid)
            g.text_step[:n].copy_(self.txt)
            self.inputs_embeds.index_copy_(0, idx, self.mtp_emb)
            sidx = torch.tensor(self.slots.tolist(), device=dev)
            g.codes.index_copy_(0, sidx, self.codes)
        else:
            self.inputs_embeds.index_copy_(0, idx, self.emb)

    # ------------------------------------------------------------ checks
    def check(self, fn) -> None:
        """fn must leave the runner buffers as the reference semantics say."""
        self.input_ids.zero_()
        self.inputs_embeds.zero_()
        fn()
        torch.cuda.synchronize()
        o = torch.from_numpy(self.dec_off).cuda()
        want = self.mtp_emb if self.mtp else self.emb
        assert torch.equal(self.inputs_embeds[o], want), "embeddings"
        assert torch.equal(self.input_ids[o], self.ids.int()), "ids"
        if self.n_pre:
            p = torch.from_numpy((self.pre_off[:, None] + np.arange(PREFILL_SPAN)).reshape(-1)).cuda()
            assert torch.equal(self.inputs_embeds[p], self.pre_emb), "prefill embeddings"
        if self.mtp:
            g = self.g
            assert torch.equal(g.last_hidden[:self.n_dec], self.hid) and torch.equal(g.codes[:self.n_dec], self.codes)


def bench(kind: str, B: int, H: int, steps: int, repeats: int, graph_steps: int) -> dict:
    sc = Scenario(kind, B, H)
    es = torch.empty((), dtype=DTYPE).element_size()
    res = {"kind": kind, "B": B, "H": H, "float_rows": sc.float_rows(), "paths": {}}

    def record(name, runs, ops=None, note=""):
        res["paths"][name] = {"us_per_step_median": statistics.median(runs), "us_per_step_all": runs,
                              "device_ops_per_step": ops, "note": note}
        print(f"  {kind:8s} B={B:5d} H={H} {name:12s} {statistics.median(runs):10.2f} us/step  ops {ops}  {note}",
              flush=True)

    for name, fn in sc.eager_paths().items():
        sc.check(fn)
        n = steps if name != "row_loop" or B <= 256 else max(3, steps // 10)
        with nvtx_range(f"{kind}.{name}"):
            record(name, us_per_call(fn, n, repeats))

    # In a CUDA graph: the two kernels captured graph_steps times, tables prepared outside the graph.
    g = sc.g
    launches = 2 if sc.mtp else 1
    runs = graph_us_per_step(sc.static_step()[0], graph_steps, repeats, check=sc.check)
    record("ours_graph", runs, {"kernels": launches, "memcpys": 0}, f"{graph_steps} steps in one graph")
    res["ours_graph_us_per_launch"] = statistics.median(runs) / launches

    # Every kernel backend available here: eager steps and the two kernels in a graph.
    for name in backend_variants(backend.kernel_backends()):
        with backend_variant(name):
            g.pre.jobs.clear()  # the graph's recorded jobs
            g.post.jobs.clear()
            sc.check(sc.ours_eager)
            record(f"ours_eager[{name}]", us_per_call(sc.ours_eager, steps, repeats))
            runs, floors = sc.launch_host_us(steps, repeats)
            res.setdefault("eager_launch_host_us", {})[name] = statistics.median(runs)
            res.setdefault("host_floor_us", {})[name] = statistics.median(floors)
            print(f"  {kind:8s} B={B:5d} H={H} eager launch call [{name}] {statistics.median(runs):7.2f} us (host; "
                  f"floor: tiny.zero_() {statistics.median(floors):.2f} us)", flush=True)
            runs = graph_us_per_step(sc.static_step()[0], graph_steps, repeats, check=sc.check)
            record(f"ours_graph[{name}]", runs, {"kernels": launches, "memcpys": 0})

    rows = sc.float_rows()
    src = torch.randn(rows, H, device="cuda").to(DTYPE)
    dst = torch.empty_like(src)
    runs = graph_us_per_step(functools.partial(dst.copy_, src), graph_steps, repeats)
    record("copy_graph", runs, {"kernels": 0, "memcpys": 1}, "the same float bytes, one copy_")
    if sc.mtp:
        mtp_baselines(sc, src, dst, res, record, graph_steps, repeats)
    step_bytes = 2 * rows * H * es
    k = res["paths"]["ours_graph"]["us_per_step_median"]
    c = res["paths"]["copy_graph"]["us_per_step_median"]
    res["ours_GBps"] = step_bytes / (k * 1e3)
    res["copy_GBps"] = step_bytes / (c * 1e3)
    res["ours_vs_copy"] = c / k
    loop = res["paths"]["row_loop"]["us_per_step_median"]
    res["speedup_vs_row_loop"] = {p: loop / v["us_per_step_median"] for p, v in res["paths"].items()}
    res["GBps_by_backend"] = {name: step_bytes / (res["paths"][f"ours_graph[{name}]"]["us_per_step_median"] * 1e3)
                              for name in backend_variants(backend.kernel_backends())}
    del src, dst, sc
    torch.cuda.empty_cache()
    return res


def mtp_baselines(sc: Scenario, src: torch.Tensor, dst: torch.Tensor, res: dict, record, graph_steps: int,
                  repeats: int) -> None:
    """A step with MTP: two plain copies in turn of the float bytes each launch moves (``copy2_graph``)
    and each launch alone against a copy of its own float bytes (``per_launch``, the default
    backend). The post launch's float rows are the MTP embeddings, one per decode row; its codes are
    ints, which these copies leave out, as every figure here counts float bytes."""
    split = src.shape[0] - sc.n_dec
    pre, post, pre_out, post_out = src[:split], src[split:], dst[:split], dst[split:]

    def two_copies():
        pre_out.copy_(pre)
        post_out.copy_(post)

    runs = graph_us_per_step(two_copies, graph_steps, repeats)
    record("copy2_graph", runs, {"kernels": 0, "memcpys": 2}, "each launch's float bytes, two copy_ in turn")
    res["ours_vs_two_copies"] = res["paths"]["copy2_graph"]["us_per_step_median"] / \
        res["paths"]["ours_graph"]["us_per_step_median"]
    (pre_gather, pre_grid), (post_gather, post_grid) = sc.static_step()[1]
    res["per_launch"] = {}
    for label, gather, grid, copy in (("pre", pre_gather, pre_grid, functools.partial(pre_out.copy_, pre)),
                                      ("post", post_gather, post_grid, functools.partial(post_out.copy_, post))):
        k = statistics.median(graph_us_per_step(functools.partial(gather.run_static, grid), graph_steps, repeats))
        c = statistics.median(graph_us_per_step(copy, graph_steps, repeats))
        res["per_launch"][label] = {"us": k, "copy_us": c, "vs_copy": c / k}
        print(f"  {sc.kind:8s} B={sc.B:5d} H={sc.H} {label} launch alone {k:6.2f} us, a copy of its bytes {c:6.2f} us "
              f"({100 * c / k:5.1f}%)", flush=True)


def count_ops(res: dict) -> None:
    """Device ops per step of each eager path of one result (``count_device_ops``), filled in."""
    sc = Scenario(res["kind"], res["B"], res["H"])
    for name, fn in sc.eager_paths().items():
        ops = res["paths"][name]["device_ops_per_step"] = count_device_ops(fn)
        print(f"  {res['kind']:8s} B={res['B']:5d} H={res['H']} {name:12s} ops {ops}", flush=True)
    del sc
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graph-steps", type=int, default=20)
    ap.add_argument("--batches", default="8,64,256,1024")
    ap.add_argument("--hidden", default="2048,4096")
    ap.add_argument("--kinds", default="mtp,non_mtp,mixed")
    ap.add_argument("--out", default="out/bench_gather.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gather needs a CUDA device")
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "backend": backend.select(torch.device("cuda"))[0], "steps": args.steps, "repeats": args.repeats,
            "graph_steps": args.graph_steps, "dtype": str(DTYPE), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(json.dumps(meta), flush=True)
    results = []
    for H in (int(h) for h in args.hidden.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            for kind in args.kinds.split(","):
                results.append(bench(kind, B, H, args.steps, args.repeats, args.graph_steps))
    print("device ops per step (CUDA profiler, after all timings):", flush=True)
    for res in results:
        count_ops(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print("\nsummary (median us/step):")
    for r in results:
        p = r["paths"]
        print(f"{r['kind']:8s} B={r['B']:5d} H={r['H']}  loop {p['row_loop']['us_per_step_median']:9.1f}  "
              f"index {p['index_copy']['us_per_step_median']:7.1f}  eager {p['ours_eager']['us_per_step_median']:6.1f} "
              f"({r['speedup_vs_row_loop']['ours_eager']:6.1f}x)  graph {p['ours_graph']['us_per_step_median']:6.2f} "
              f"({r['ours_graph_us_per_launch']:5.2f}/launch, {r['speedup_vs_row_loop']['ours_graph']:7.1f}x)  "
              f"{r['ours_GBps']:6.0f} GB/s = {100 * r['ours_vs_copy']:5.1f}% of copy ({r['copy_GBps']:.0f})"
              + (f", {100 * r['ours_vs_two_copies']:5.1f}% of two copies in turn" if "ours_vs_two_copies" in r else ""))
        for name, gbps in r["GBps_by_backend"].items():
            print(f"          {name:6s}: eager {p[f'ours_eager[{name}]']['us_per_step_median']:7.1f} us/step "
                  f"({r['eager_launch_host_us'][name]:5.2f} us per launch call, "
                  f"floor {r['host_floor_us'][name]:5.2f}), graph "
                  f"{p[f'ours_graph[{name}]']['us_per_step_median']:6.2f} us/step "
                  f"({p[f'ours_graph[{name}]']['us_per_step_median'] / (2 if r['kind'] != 'non_mtp' else 1):5.2f}"
                  f"/launch) = {100 * gbps / r['copy_GBps']:5.1f}% of copy"
                  + (f", {100 * p['copy2_graph']['us_per_step_median'] / p[f'ours_graph[{name}]']['us_per_step_median']:5.1f}"
                     "% of two copies in turn" if "copy2_graph" in p else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
