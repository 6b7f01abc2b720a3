"""WorkerAccumulator: what each output kind receives, the cadence, one copy per step, failures."""

import logging

import numpy as np
import pytest
import torch

from vllm_omni_kernels.accumulator import EmitPolicy
from vllm_omni_kernels.errors import TensorAccumulationError
from vllm_omni_kernels.modality import TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch
from vllm_omni_kernels.serving.worker_accumulator import OutputKey, WorkerAccumulator

KEYS = [OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=10, initial_frames=8),
        OutputKey("codes", S.CONCAT_DIM0, torch.int64, (3,), cadence=None, initial_frames=2)]


def run(device, emits, steps, seed=0, finish_at=None):
    """Random chunks for requests of the given output kinds; returns what each received per step
    (concatenated per key) and what was sent."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    acc = WorkerAccumulator(KEYS, device, budget_bytes=1 << 16, max_requests=8)
    ids = [f"r{i}" for i in range(len(emits))]
    for rid, emit in zip(ids, emits):
        acc.add_request(rid, emit)
    sent = {r: {"audio": [], "codes": []} for r in ids}
    got = {r: {"audio": [], "codes": []} for r in ids}
    deliveries = {r: 0 for r in ids}
    finish_at = finish_at or {r: steps - 1 for r in ids}
    for step in range(steps):
        live = [r for r in ids if finish_at[r] >= step]
        if not live:
            break
        lengths = rng.integers(0, 7, size=len(live))
        audio = torch.randn(len(live), 8, generator=gen).to(device)
        codes = [torch.randint(0, 99, (int(n) % 3, 3), generator=gen).to(device) for n in lengths]
        tokens = acc.head(len(live), torch.int64)
        tokens.copy_(torch.arange(len(live)) + 100 * step)
        assert acc.append(live, {"audio": PaddedBatch(audio, lengths), "codes": codes}) == {}
        for b, rid in enumerate(live):
            sent[rid]["audio"].append(audio[b, :lengths[b]].cpu())
            sent[rid]["codes"].append(codes[b].cpu())
        finishing = [r for r in live if finish_at[r] == step]
        packed = acc.collect(finishing, head_bytes=8 * len(live))
        host = packed.wait()
        assert torch.equal(host[:8 * len(live)].view(torch.int64), torch.arange(len(live)) + 100 * step)
        for rid in packed.requests():
            deliveries[rid] += 1
            for key, t in packed.tensors(rid).items():
                got[rid][key].append(t.clone())
        assert packed.final == set(finishing)
    return acc, sent, got, deliveries


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_every_output_kind_receives_exactly_what_was_sent(backend_name, use_backend):
    use_backend(backend_name)
    emits = [EmitPolicy.DELTA, EmitPolicy.CUMULATIVE, EmitPolicy.FINAL_ONLY, EmitPolicy.DELTA]
    acc, sent, got, deliveries = run("cpu", emits, steps=12, finish_at={"r0": 11, "r1": 7, "r2": 9, "r3": 3})
    for rid, emit in zip(sent, emits):
        for key, dim in (("audio", -1), ("codes", 0)):
            want = torch.cat(sent[rid][key], dim=dim)
            assert torch.equal(torch.cat(got[rid][key], dim=dim), want), (rid, key)
    assert deliveries["r2"] == 1  # FINAL_ONLY: once, at finish
    assert deliveries["r0"] > 2 and deliveries["r0"] < 12  # first chunk at once, then every >= 10 samples
    assert len(acc) == 0 and all(p.stats().slots_used == 0 for p in acc.pools)


def test_cadence_first_chunk_at_once_then_every_n_frames():
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, cadence=10, initial_frames=64)], "cpu")
    acc.add_request("a", EmitPolicy.DELTA)
    sizes = []
    for step in range(8):
        acc.append(["a"], {"audio": PaddedBatch(torch.ones(1, 4), [4])})
        packed = acc.collect(["a"] if step == 7 else [])
        if packed is not None:
            sizes.append(packed.tensors("a")["audio"].shape[-1])
    assert sizes == [4, 12, 12, 4]  # at once; then >= 10 unread; the rest at finish


def test_cadence_is_due_at_exactly_its_frames_unread():
    """A streaming request's data is due once some paced key has at least its ``cadence`` frames
    unread: exactly ``cadence`` frames go that step, not a step later."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, cadence=10, initial_frames=64)], "cpu")
    acc.add_request("a", EmitPolicy.DELTA)
    sizes = []
    for step in range(5):
        acc.append(["a"], {"audio": PaddedBatch(torch.full((1, 5), float(step)), [5])})
        packed = acc.collect(["a"] if step == 4 else [])
        if packed is not None:
            sizes.append(packed.tensors("a")["audio"].shape[-1])
    assert sizes == [5, 10, 10]  # at once; then at 10 unread (steps 2 and 4, the last also the end)


def test_a_first_chunk_of_a_key_that_does_not_set_the_pace_goes_at_once():
    """A streaming request's first data goes at once whichever key brought it: a step with data of
    the unpaced key only (no audio yet) delivers it."""
    acc = WorkerAccumulator(KEYS, "cpu")
    acc.add_request("d", EmitPolicy.DELTA)
    codes = torch.arange(6, dtype=torch.int64).view(2, 3)
    assert acc.append(["d"], {"codes": [codes]}) == {}
    packed = acc.collect()
    assert packed is not None and packed.requests() == {"d"}
    got = packed.tensors("d")
    assert torch.equal(got["codes"], codes) and got["audio"].numel() == 0


def test_a_chunk_for_a_request_without_a_row_is_its_error_and_lands_nowhere():
    """A request that holds no row (never added, or gone) in a step fails by name; its chunk is
    written into no other request's slot, whichever rows are taken (the last one included)."""
    acc = WorkerAccumulator(KEYS, "cpu", max_requests=2)
    acc.add_request("a", EmitPolicy.FINAL_ONLY)
    acc.add_request("b", EmitPolicy.FINAL_ONLY)  # row 1: the last row
    failed = acc.append(["a", "ghost"], {"audio": PaddedBatch(torch.stack([torch.ones(3), torch.full((3,), 9.0)]),
                                                              [3, 3])})
    assert list(failed) == ["ghost"] and failed["ghost"].request_id == "ghost"
    acc.append(["b"], {"audio": [torch.full((2,), 2.0)]})
    packed = acc.collect(["a", "b"])
    assert torch.equal(packed.tensors("a")["audio"], torch.ones(3))
    assert torch.equal(packed.tensors("b")["audio"], torch.full((2,), 2.0))


def test_a_request_on_a_row_another_had_gets_its_first_chunk_at_once():
    """The first data of a streaming request goes at once even on a row an earlier request was
    delivered from: the row's pacing starts over."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, cadence=10, initial_frames=64)], "cpu")
    for rid in ("a", "b"):
        assert acc.add_request(rid, EmitPolicy.DELTA) == 0
        acc.append([rid], {"audio": PaddedBatch(torch.ones(1, 4), [4])})
        packed = acc.collect()
        assert packed is not None and packed.tensors(rid)["audio"].shape[-1] == 4, rid
        acc.abort(rid)


def test_head_data_survives_the_buffer_growing_in_its_step():
    """The caller's head data (the sampled token ids) written before a step's due data outgrows
    the step's buffer arrives intact with that data."""
    acc = WorkerAccumulator(KEYS, "cpu", budget_bytes=1 << 20)
    acc.add_request("d", EmitPolicy.DELTA)
    tokens = acc.head(2, torch.int64)
    tokens.copy_(torch.tensor([101, 202]))
    audio = torch.randn(1, 20000)  # 80 kB: more than the first buffer holds
    assert acc.append(["d"], {"audio": PaddedBatch(audio, [20000])}) == {}
    packed = acc.collect(head_bytes=16)
    host = packed.wait()
    assert torch.equal(host[:16].view(torch.int64), torch.tensor([101, 202]))
    assert torch.equal(packed.tensors("d")["audio"], audio[0])


def test_a_cumulative_request_streams_as_a_delta_one_does():
    """CUMULATIVE requests get their data as it comes (the frontend concatenates): the first
    chunk at once, not only at finish."""
    acc = WorkerAccumulator(KEYS, "cpu")
    acc.add_request("c", EmitPolicy.CUMULATIVE)
    acc.append(["c"], {"audio": PaddedBatch(torch.arange(4.0).view(1, 4), [4])})
    packed = acc.collect()
    assert packed is not None and torch.equal(packed.tensors("c")["audio"], torch.arange(4.0))


def test_a_request_whose_every_frame_is_left_out_leaves_the_step():
    """``drop_newest`` of all of a request's frames of every key: the step no longer names it
    (its output gets no data), and the other request's data stays as it was."""
    acc = WorkerAccumulator(KEYS, "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.DELTA)
    codes = [torch.zeros(1, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64)]
    acc.append(list("ab"), {"audio": [torch.ones(3), torch.full((2,), 2.0)], "codes": codes})
    packed = acc.collect()
    packed.drop_newest("a", {"audio": 3, "codes": 1})
    assert packed.requests() == {"b"} and packed.tensors("a") == {}
    got = packed.tensors("b")
    assert torch.equal(got["audio"], torch.full((2,), 2.0)) and torch.equal(got["codes"], codes[1])


def test_each_clients_share_of_a_step_holds_its_requests_data_alone():
    """``PackedStep.split``: the message to each of several clients carries a copy of its own
    requests' data, each key's region on a 16-byte boundary, the same pieces as the whole step's,
    and the closing requests among them; a stereo CONCAT_LAST key's pieces stay whole; a request
    no client owns goes nowhere."""
    keys = [*KEYS, OutputKey("stereo", S.CONCAT_LAST, torch.float32, (2,), cadence=None)]
    acc = WorkerAccumulator(keys, "cpu")
    ids = list("abcd")
    for rid in ids:
        acc.add_request(rid, EmitPolicy.DELTA)
    gen = torch.Generator().manual_seed(0)
    acc.append(ids, {"audio": [torch.randn(n, generator=gen) for n in (3, 5, 2, 4)],
                     "codes": [torch.randint(0, 9, (n, 3), generator=gen) for n in (1, 0, 2, 1)],
                     "stereo": [torch.randn(2, n, generator=gen) for n in (1, 3, 1, 2)]})
    packed = acc.collect(["c"], head_bytes=24)
    shares = packed.split({"a": 0, "c": 0, "b": 1, "x": 2})  # (an owner with no data here gets nothing)
    assert set(shares) == {0, 1}
    assert shares[0].requests() == {"a", "c"} and shares[0].final == {"c"} and shares[0].head_bytes == 0
    assert shares[1].requests() == {"b"} and shares[1].final == set()
    for share in shares.values():
        assert all(r.offset % 16 == 0 for r in share.regions)
        for rid in share.requests():
            whole, mine = packed.tensors(rid), share.tensors(rid)
            assert mine.keys() == whole.keys() and all(torch.equal(mine[k], whole[k]) for k in whole)
    assert sum(s.host.numel() for s in shares.values()) < packed.host.numel() - 24  # ("d" went nowhere)
    assert packed.split({}) == {}


def test_nothing_due_means_no_step_and_no_copy():
    acc = WorkerAccumulator(KEYS, "cpu")
    acc.add_request("f", EmitPolicy.FINAL_ONLY)
    acc.append(["f"], {"audio": PaddedBatch(torch.ones(1, 4), [4])})
    assert acc.collect() is None
    packed = acc.collect(["f"])
    assert torch.equal(packed.tensors("f")["audio"], torch.ones(4)) and "f" not in acc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_request_that_finds_no_free_row_makes_more_and_the_rows_held_keep_their_data(device):
    """More requests than rows (vLLM's preempted requests keep theirs): the accumulator makes twice
    as many, or up to a row the caller names past the end; every pool's slots grow with them, and
    the requests held keep their rows, unread data and pacing."""
    acc = WorkerAccumulator(KEYS, device, budget_bytes=1 << 16, max_requests=2)

    def audio(*pieces):
        return PaddedBatch(torch.stack([torch.full((4,), v) for v, _ in pieces]).to(device), [n for _, n in pieces])

    assert [acc.add_request(r, EmitPolicy.FINAL_ONLY) for r in ("a", "b")] == [0, 1]
    acc.append(["a", "b"], {"audio": audio((1.0, 4), (2.0, 3))})
    assert acc.add_request("c", EmitPolicy.DELTA) == 2 and acc.rows == 4
    assert acc.add_request("d", EmitPolicy.DELTA, row=9) == 9 and acc.rows == 10
    assert all(pool.stats().slots_capacity == 10 for pool in acc.pools)
    with pytest.raises(TensorAccumulationError, match="row 65535 is not free"):  # past what one launch takes
        acc.add_request("e", EmitPolicy.DELTA, row=65535)
    codes = [torch.ones(n, 3, dtype=torch.int64, device=device) for n in (0, 1, 0)]
    acc.append(["a", "c", "d"], {"audio": audio((5.0, 2), (6.0, 2), (7.0, 1)), "codes": codes})
    packed = acc.collect(["a", "b"], ends=[np.full(acc.rows, 1 << 40, np.int64) for _ in acc.keys])
    packed.wait()
    assert torch.equal(packed.tensors("a")["audio"], torch.tensor([1.0, 1, 1, 1, 5, 5]))
    assert torch.equal(packed.tensors("b")["audio"], torch.tensor([2.0, 2, 2]))
    assert torch.equal(packed.tensors("c")["audio"], torch.tensor([6.0, 6]))  # a new stream's first data at once
    assert torch.equal(packed.tensors("d")["audio"], torch.tensor([7.0]))
    assert torch.equal(packed.tensors("c")["codes"], torch.ones(1, 3, dtype=torch.int64))


def test_rows_given_by_the_caller_and_slots_sized_for_what_a_request_will_hold():
    acc = WorkerAccumulator(KEYS, "cpu", budget_bytes=1 << 16, max_requests=8)
    assert acc.add_request("f", EmitPolicy.FINAL_ONLY, row=5, frames={"audio": 100, "codes": 9}) == 5
    assert acc.add_request("d", EmitPolicy.DELTA, row=2) == 2 and acc.row_of("f") == 5
    with pytest.raises(TensorAccumulationError, match="row 5 is not free"):
        acc.add_request("g", EmitPolicy.DELTA, row=5)
    audio, codes = acc.pools[0], acc.pools[1]
    assert audio.capacity_frames("f") >= 100 and codes.capacity_frames("f") >= 9  # at once, no growth later
    assert audio.capacity_frames("d") == 8
    for step in range(10):
        assert acc.append(["f"], {"audio": PaddedBatch(torch.full((1, 10), float(step)), [10]),
                                  "codes": PaddedBatch(torch.full((1, 1, 3), step, dtype=torch.int64), [1])},
                          np.array([5], np.int64)) == {}
        packed = acc.collect(["f"] if step == 9 else [])
    assert audio.growths == 0 and codes.growths == 0
    assert torch.equal(packed.tensors("f")["audio"], torch.arange(10.0).repeat_interleave(10))
    assert torch.equal(packed.tensors("f")["codes"][:, 0], torch.arange(10))


def test_an_end_after_several_reads_closes_a_stream_at_that_frame():
    """A stream read at its cadence more than once, then closed at an end (``ends``: its stop token's
    frame, seen a step late) gets exactly the frames up to that end: the end counts from everything
    read before, not from the last read alone."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=8, initial_frames=64)],
                            "cpu", budget_bytes=1 << 16, max_requests=4)
    row = acc.add_request("s", EmitPolicy.DELTA)
    got = []
    for step in range(4):
        acc.append(["s"], {"audio": [torch.arange(4.0 * step, 4.0 * step + 4)]})
        ends = None
        if step == 3:  # frames 14 and 15 lie past its end
            ends = [np.full(acc.rows, np.iinfo(np.int64).max, np.int64)]
            ends[0][row] = 14
        packed = acc.collect(["s"] if step == 3 else [], ends=ends)
        if packed is not None:
            got.append(packed.tensors("s")["audio"].clone())
    assert len(got) == 3  # the first chunk at once, one cadence interval, the close
    assert torch.equal(torch.cat(got), torch.arange(14.0))


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_frames_past_an_end_found_a_step_late_never_reach_the_request(backend_name, use_backend):
    """A step's token is known on the host only once its copy has landed, and under async scheduling
    the next step has run by then. Request "s" ends with its frame of step 5, which the caller
    learns after step 6 ran: step 6's data leaves out its frame there (``drop_newest``; "s" is due
    there, between "a" and "o" in their regions), and its close at step 7 reads up to its end
    (``ends``) whether that frame went out or was never due; "a" and "o" lose nothing; every output
    kind."""
    use_backend(backend_name)
    big = np.iinfo(np.int64).max
    for emit in (EmitPolicy.DELTA, EmitPolicy.CUMULATIVE, EmitPolicy.FINAL_ONLY):
        acc = WorkerAccumulator(KEYS, "cpu", budget_bytes=1 << 16, max_requests=4)
        acc.add_request("a", emit)
        s_row, _ = acc.add_request("s", emit), acc.add_request("o", emit)
        got = {rid: {"audio": [], "codes": []} for rid in "aso"}
        for step in range(8):
            ids = ["a", "s", "o"] if step < 7 else ["a", "o"]  # "s" is not scheduled after its end is seen
            n = len(ids)
            acc.append(ids, {"audio": PaddedBatch(torch.arange(10.0 * step, 10.0 * step + 6).repeat(n, 1),
                                                  [6, 5, 6] if n == 3 else [6, 6]),
                             "codes": PaddedBatch(torch.full((n, 1, 3), step, dtype=torch.int64), [1] * n)})
            ends = None
            if step == 7:
                ends = [np.full(4, big), np.full(4, big)]
                ends[0][s_row], ends[1][s_row] = 6 * 5, 6
            packed = acc.collect(["a", "s", "o"] if step == 7 else [], ends=ends)
            if step == 6 and packed is not None:
                if emit is not EmitPolicy.FINAL_ONLY:
                    assert packed.regions[0].request_ids == ["a", "s", "o"]
                packed.drop_newest("s", {"audio": 5, "codes": 1})
            for rid in "aso" if packed is not None else ():
                for key, value in packed.tensors(rid).items():
                    got[rid][key].append(value)
        assert packed.final == {"a", "s", "o"} and len(acc) == 0
        audio_s, codes_s = torch.cat(got["s"]["audio"]), torch.cat(got["s"]["codes"])
        assert torch.equal(audio_s, torch.cat([torch.arange(10.0 * k, 10.0 * k + 5) for k in range(6)])), emit
        assert codes_s[:, 0].tolist() == list(range(6)), emit
        for rid in "ao":
            assert torch.equal(torch.cat(got[rid]["audio"]),
                               torch.cat([torch.arange(10.0 * k, 10.0 * k + 6) for k in range(8)])), (rid, emit)
            assert torch.cat(got[rid]["codes"])[:, 0].tolist() == list(range(8)), (rid, emit)


@pytest.mark.parametrize("landed", [False, True], ids=["before-the-copy-landed", "after"])
def test_the_newest_frames_of_a_multichannel_concat_last_key_are_left_out(landed):
    """A ``[C, n]`` piece shortened to ``[C, keep]``: each channel's kept frames, closed up in host
    memory once the copy has landed (``tensors`` waits for it); the requests before and after it
    in the region keep theirs."""
    acc = WorkerAccumulator([OutputKey("stereo", S.CONCAT_LAST, torch.float32, (2,), cadence=0)], "cpu")
    for rid in "arb":
        acc.add_request(rid, EmitPolicy.DELTA)
    pieces = {rid: torch.arange(8.0).view(2, 4) + 100 * k for k, rid in enumerate("arb")}
    acc.append(list("arb"), {"stereo": list(pieces.values())})
    packed = acc.collect()
    if landed:
        packed.wait()
    packed.drop_newest("r", {"stereo": 1})
    packed.drop_newest("r", {"stereo": 1})  # twice: [2, 4] -> [2, 3] -> [2, 2]
    assert torch.equal(packed.tensors("r")["stereo"], pieces["r"][:, :2])
    for rid in "ab":
        assert torch.equal(packed.tensors(rid)["stereo"], pieces[rid])


def test_a_negative_count_to_leave_out_is_refused():
    """``drop_newest`` with a negative count would hand the request the next request's frames."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=0)], "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.DELTA)
    acc.append(["a", "b"], {"audio": [torch.arange(4.0), torch.arange(4.0) + 10]})
    packed = acc.collect()
    with pytest.raises(ValueError, match="negative"):
        packed.drop_newest("a", {"audio": -2})
    assert packed.tensors("a")["audio"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("outputs, match", [
    ({"audio": PaddedBatch(torch.zeros(2, 4), [4, 4]), "codes": PaddedBatch(torch.zeros(3, 1, 2), [1, 1, 1])},
     "PaddedBatch of 3 rows"),
    ({"audio": PaddedBatch(torch.zeros(2, 4), [4, 4]), "codes": [torch.zeros(1, 2)]}, "1 chunks for 2"),
    ({"audio": PaddedBatch(torch.zeros(2, 4), [4, 4]), "cods": [torch.zeros(1, 2)] * 2}, "'cods' is not one"),
    # the later key's lengths: as many rows as requests, but four lengths; or not integers
    ({"audio": PaddedBatch(torch.zeros(2, 4), [4, 4]),
      "codes": PaddedBatch(torch.zeros(2, 1, 2), np.ones((2, 2), np.int64))}, "2 rows and 4 lengths"),
    ({"audio": PaddedBatch(torch.zeros(2, 4), [4, 4]),
      "codes": PaddedBatch(torch.zeros(2, 1, 2), np.array([1.0, 1.0]))}, "must be integers"),
], ids=["batch-rows", "list-length", "unknown-key", "lengths-2d", "lengths-float"])
def test_a_step_not_aligned_with_its_requests_appends_nothing(outputs, match):
    """A caller's bug in a step's shape is a ValueError (TypeError for lengths that are not
    integers) before any key is appended: no key holds the step's data without the others."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=0),
                             OutputKey("codes", S.CONCAT_DIM0, torch.float32, (2,), cadence=None)], "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.DELTA)
    with pytest.raises((ValueError, TypeError), match=match):
        acc.append(["a", "b"], outputs)
    assert [pool.unread().sum() for pool in acc.pools] == [0, 0]


def test_a_step_split_by_owner_gives_an_owner_of_empty_pieces_views_too():
    """``PackedStep.split``: each owner's data back to back; an owner whose only request closes
    with nothing unread gets empty pieces of its keys (its buffer empty, and viewable as any dtype)."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=0),
                             OutputKey("codes", S.CONCAT_DIM0, torch.int16, (2,), cadence=None)], "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.DELTA)
    acc.append(["a", "b"], {"audio": [torch.arange(3.0), torch.arange(2.0)],
                            "codes": [torch.ones(1, 2, dtype=torch.int16), torch.ones(1, 2, dtype=torch.int16)]})
    acc.collect()
    acc.append(["a"], {"audio": [torch.arange(4.0) + 10], "codes": [torch.full((1, 2), 7, dtype=torch.int16)]})
    shares = acc.collect(finishing=["b"]).split({"a": "x", "b": "y"})
    assert shares["x"].tensors("a")["audio"].tolist() == [10.0, 11.0, 12.0, 13.0]
    assert shares["x"].tensors("a")["codes"].tolist() == [[7, 7]] and shares["x"].final == set()
    empty = shares["y"].tensors("b")
    assert empty["audio"].shape == (0,) and empty["codes"].shape == (0, 2) and shares["y"].final == {"b"}


def test_a_key_whose_frame_holds_no_element_is_refused():
    with pytest.raises(ValueError, match="holds no element"):
        WorkerAccumulator([OutputKey("empty", S.CONCAT_DIM0, torch.float32, (2, 0))], "cpu")


def test_a_malformed_chunk_fails_only_its_request():
    acc = WorkerAccumulator(KEYS, "cpu")
    for rid in "abc":
        acc.add_request(rid, EmitPolicy.FINAL_ONLY)
    acc.append(list("abc"), {"audio": [torch.ones(2), torch.ones(2), torch.ones(2)]})
    failed = acc.append(list("abc"), {"audio": [torch.ones(3), torch.ones(3, dtype=torch.float64), torch.ones(3)],
                                      "codes": [torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int64),
                                                torch.zeros(1, 4, dtype=torch.int64)]})
    assert set(failed) == {"b", "c"} and all(isinstance(e, TensorAccumulationError) for e in failed.values())
    assert failed["b"].key == "audio" and failed["c"].key == "codes" and "b" not in acc and "c" not in acc
    packed = acc.collect(["a"])
    assert torch.equal(packed.tensors("a")["audio"], torch.ones(5)) and packed.tensors("a")["codes"].shape == (1, 3)
    assert acc.failed == 2 and all(p.stats().slots_used == 0 for p in acc.pools)


def test_a_failed_request_kept_by_the_caller_is_read_up_to_the_end_it_is_given():
    """``append(keep=)``: a request whose chunk fails keeps its slots and earlier data (the chunk's
    other keys were appended); ``collect(hold=)`` reads none of it however due it is, finishing
    too; a later ``collect`` with its ``ends`` closes it at the frames before the failure, every
    key alike."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), cadence=0),
                             OutputKey("codes", S.CONCAT_DIM0, torch.int64, (2,), cadence=None)], "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.DELTA)
    codes = [torch.full((1, 2), k, dtype=torch.int64) for k in range(3)]
    acc.append(list("ab"), {"audio": [torch.zeros(3), torch.zeros(3)], "codes": codes[:2]})
    acc.append(list("ab"), {"audio": [torch.ones(3), torch.ones(3)], "codes": codes[1:]})
    failed = acc.append(list("ab"), {"audio": [torch.full((3,), 2.0), torch.ones(3, dtype=torch.float64)],
                                     "codes": [codes[2], codes[2]]}, keep=lambda rid: True)
    assert list(failed) == ["b"] and "b" in acc
    held = acc.collect(["b"], hold={"b"})  # held over finishing too: nothing read, the slots kept
    assert held.requests() == {"a"} and held.tensors("a")["audio"].tolist() == [0.0] * 3 + [1.0] * 3 + [2.0] * 3
    assert "b" in acc and not held.final
    ends = [np.full(acc.rows, 1 << 40, np.int64) for _ in acc.keys]
    ends[0][acc.row_of("b")], ends[1][acc.row_of("b")] = 6, 2  # its two frames before the failing one
    closed = acc.collect(["b"], ends=ends)
    got = closed.tensors("b")
    assert got["audio"].tolist() == [0.0] * 3 + [1.0] * 3 and got["codes"].tolist() == [[1, 1], [2, 2]]
    assert "b" not in acc and closed.final == {"b"}



@pytest.mark.parametrize("form", ["list", "padded"])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_a_request_named_twice_in_one_step_fails_with_its_error(form, backend_name, use_backend):
    """Both chunks would be planned at the same head, the second over the first: the request
    fails with an error naming it, and the other request of the step is appended exactly."""
    use_backend(backend_name)
    acc = WorkerAccumulator(KEYS, "cpu")
    for rid in "ab":
        acc.add_request(rid, EmitPolicy.FINAL_ONLY)
    chunks = [torch.ones(3), torch.full((3,), 2.0), torch.full((3,), 5.0)]
    audio = chunks if form == "list" else PaddedBatch(torch.stack(chunks), [3, 3, 3])
    failed = acc.append(["a", "a", "b"], {"audio": audio})
    assert set(failed) == {"a"} and "twice" in str(failed["a"]) and failed["a"].key == "audio" and "a" not in acc
    assert torch.equal(acc.collect(["b"]).tensors("b")["audio"], chunks[2])
    assert all(p.stats().slots_used == 0 for p in acc.pools)


def test_a_request_named_twice_with_its_rows_given_fails_and_the_others_stay_exact():
    """Rows given by the caller that name one row twice are not trusted: the request fails as
    when the accumulator looks its rows up (launched twice at one slot, its second chunk over its
    first, the pool counted the slot's new head twice, and a fresh slot of another request then
    kept writing at its first position)."""
    acc = WorkerAccumulator([OutputKey("audio", S.CONCAT_LAST, torch.float32, (), initial_frames=16)], "cpu",
                            budget_bytes=1 << 12, max_requests=4)
    a, b = acc.add_request("a", EmitPolicy.FINAL_ONLY), acc.add_request("b", EmitPolicy.FINAL_ONLY)
    failed = acc.append(["a", "a"], {"audio": [torch.tensor([1., 2., 3.]), torch.tensor([4., 5.])]},
                        rows=np.array([a, a], np.int64))
    assert set(failed) == {"a"} and "twice" in str(failed["a"])
    for v in (10., 20., 30.):
        assert acc.append(["b"], {"audio": [torch.tensor([v, v + 1])]}, rows=np.array([b], np.int64)) == {}
    assert acc.collect(["b"]).tensors("b")["audio"].tolist() == [10., 11., 20., 21., 30., 31.]


@pytest.mark.parametrize("hint", [np.int64(50), 50.0, "50"], ids=["numpy", "float", "str"])
def test_a_frames_hint_is_an_integer_of_any_kind_and_anything_else_holds_nothing(hint):
    """A numpy integer sizes the slot as an int does; a hint that is no integer is a typed error
    naming the request and key, and the slots other keys had given it are given back."""
    keys = [OutputKey("audio", S.CONCAT_LAST, torch.float32, (), initial_frames=4),
            OutputKey("codes", S.CONCAT_DIM0, torch.int64, (2,), initial_frames=4)]
    acc = WorkerAccumulator(keys, "cpu", budget_bytes=1 << 14, max_requests=2)
    frames = {"audio": 100, "codes": hint}
    if isinstance(hint, np.integer):
        acc.add_request("a", EmitPolicy.FINAL_ONLY, row=0, frames=frames)
        assert [p.capacity_frames("a") for p in acc.pools] == [128, 64]
        acc.abort("a")
    else:
        with pytest.raises(TensorAccumulationError, match="frames hint") as err:
            acc.add_request("a", EmitPolicy.FINAL_ONLY, row=0, frames=frames)
        assert err.value.request_id == "a" and err.value.key == "codes"
    assert "a" not in acc and all(len(p) == 0 and p.allocator.used_frames == 0 for p in acc.pools)
    assert acc.add_request("c", EmitPolicy.DELTA, row=0) == 0

def test_abort_frees_slots():
    acc = WorkerAccumulator(KEYS, "cpu")
    acc.add_request("a", EmitPolicy.DELTA)
    acc.append(["a"], {"audio": PaddedBatch(torch.ones(1, 4), [4])})
    acc.abort("a")
    acc.abort("a")  # twice: ignored
    assert len(acc) == 0 and all(p.stats().slots_used == 0 for p in acc.pools)
    with pytest.raises(TensorAccumulationError):
        acc.add_request("b", EmitPolicy.DELTA)
        acc.add_request("b", EmitPolicy.DELTA)


def test_a_request_refused_for_want_of_memory_holds_nothing_and_can_be_added_later():
    """A request whose slot of a later key cannot be had (that key's budget spent) gets the error
    and holds nothing in any pool: once memory is free again it is added like any other."""
    acc = WorkerAccumulator(KEYS, "cpu", budget_bytes={"audio": 1 << 16, "codes": 2 * 24}, max_requests=4)
    acc.add_request("a", EmitPolicy.DELTA)
    with pytest.raises(TensorAccumulationError, match="budget"):
        acc.add_request("b", EmitPolicy.DELTA)  # the audio slot is had, the codes slot is not
    assert "b" not in acc and all(p.stats().slots_used == 1 for p in acc.pools)
    acc.abort("a")
    assert acc.add_request("b", EmitPolicy.DELTA) == 0
    acc.append(["b"], {"audio": [torch.ones(2)]})
    assert torch.equal(acc.collect(["b"]).tensors("b")["audio"], torch.ones(2))


@pytest.mark.gpu
def test_cuda_one_copy_per_step_and_exact(use_backend):
    use_backend("auto")
    emits = [EmitPolicy.DELTA, EmitPolicy.CUMULATIVE, EmitPolicy.FINAL_ONLY] * 2
    acc, sent, got, _ = run("cuda", emits, steps=20, seed=3)
    for rid in sent:
        assert torch.equal(torch.cat(got[rid]["audio"], -1), torch.cat(sent[rid]["audio"], -1))
        assert torch.equal(torch.cat(got[rid]["codes"]), torch.cat(sent[rid]["codes"]))
    assert acc.copies == 20


def test_host_buffers_handed_back_on_other_threads_are_reused_only_when_free():
    """A step's host tensor often dies on another thread (the engine's output thread, after
    sending it): buffers come back from there while the step's thread takes new ones, and a buffer
    is never handed out while a tensor made of it is alive, nor smaller than asked."""
    import queue
    import threading

    from vllm_omni_kernels.serving.worker_accumulator import _HostBuffers

    buffers = _HostBuffers(keep=3, pinned=False)
    handed: queue.Queue = queue.Queue()
    live: set[int] = set()
    lock = threading.Lock()

    def output_thread():
        while (item := handed.get()) is not None:
            with lock:
                live.discard(item.data_ptr())
            del item  # the last reference: the buffer goes back from this thread

    thread = threading.Thread(target=output_thread)
    thread.start()
    try:
        for k in range(3000):
            nbytes = 1 << (16 + k % 6)  # sizes across the 1 MiB floor, so buffers of several sizes circulate
            host, note_copy = buffers.take(nbytes)
            note_copy(None)
            assert host.numel() == nbytes
            with lock:
                assert host.data_ptr() not in live, f"take {k}: a buffer still in use was handed out"
                live.add(host.data_ptr())
            host.fill_(k % 251)
            handed.put(host)
            del host
    finally:
        handed.put(None)
        thread.join()
    assert buffers.allocations < 3000


def test_host_buffers_kept_by_a_caller_are_reported_once(caplog):
    """A caller that keeps every step's buffer makes the worker allocate one a step: said once, when
    64 are alive. Bursts of buffers in flight that come back are not that: however many bursts,
    the buffers dropped from the free list do not count."""
    from vllm_omni_kernels.serving.worker_accumulator import _HostBuffers

    buffers = _HostBuffers(keep=4, pinned=False)
    with caplog.at_level(logging.WARNING, logger="vllm_omni_kernels.serving.worker_accumulator"):
        for _ in range(20):  # bursts of 20 in flight (a backlog), then all given back
            burst = []
            for _ in range(20):
                host, note_copy = buffers.take(4096)
                note_copy(None)
                burst.append(host)
            del burst, host
        assert buffers.allocations > 64 and buffers.alive <= 20 and not caplog.records
        kept = []
        for _ in range(100):
            host, note_copy = buffers.take(4096)
            note_copy(None)
            kept.append(host)
    assert [r.getMessage().split(" host buffers")[0] for r in caplog.records] == ["64"]


def test_host_buffer_is_not_reused_while_anything_made_of_it_lives():
    """What outlives a step's host tensor: the memoryview vLLM's encoder hands zmq (of a
    ``view(uint8)`` of it), a request's piece (a view of another dtype), a numpy array. While any
    of them is alive its bytes must not be handed out again; once all are gone the buffer is reused."""
    from vllm.v1.utils import tensor_data

    from vllm_omni_kernels.serving.worker_accumulator import _HostBuffers, split_region

    makers = {"zmq frame": tensor_data,
              "piece": lambda h: split_region(h, torch.float32, (), -1, 16, [4, 8])[1],
              "numpy": lambda h: h.numpy()[16:]}
    for name, make in makers.items():
        buffers = _HostBuffers(keep=4, pinned=False)
        host, note_copy = buffers.take(4096)
        note_copy(None)
        host.fill_(7)
        held = make(host)
        del host
        for _ in range(8):  # later steps: none of them may write into the held bytes
            other, note_other = buffers.take(4096)
            note_other(None)
            other.fill_(1)
            del other
        assert set(bytes(memoryview(held if not isinstance(held, torch.Tensor) else held.numpy()).cast("B"))) == {7}, name
        allocated = buffers.allocations
        del held
        again, _ = buffers.take(4096)  # now everything made of the first buffer is gone: it is reused
        assert buffers.allocations == allocated, name


class _Pending:
    """A copy's event that has not completed: what ``torch.cuda.Event.query()`` says while the
    step's device-to-host copy is still queued; ``done`` completes it."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_host_buffer_whose_copy_may_still_run_stays_on_the_free_list():
    """A step whose output nobody waited for (vLLM drops a step it never resolves) gives its buffer
    back before its copy has run. More buffers free than kept must not let that one go: pinned
    memory let go goes back to torch's host allocator, which does not know of the copy (it went
    through a ``frombuffer`` tensor) and would hand the memory to the next pinned allocation while
    the copy still writes it. Once the copy has run, the buffer may go."""
    import gc
    import weakref

    from vllm_omni_kernels.serving.worker_accumulator import _HostBuffers

    buffers = _HostBuffers(keep=1, pinned=False)
    host, note_copy = buffers.take(1 << 20)
    pending = _Pending()
    note_copy(pending)
    del host  # dropped before its copy ran
    big, note_big = buffers.take(4 << 20)  # the first one is free but its copy has not run: a new one
    note_big(None)
    first = weakref.ref(buffers._free[0][0])
    del big
    small, note_small = buffers.take(1 << 20)  # two free, one kept: the smaller (the first) would go
    note_small(None)
    gc.collect()
    assert first() is not None and buffers.alive == buffers.allocations == 2
    del small
    pending.done = True
    buffers.take(1 << 20)[1](None)  # its copy has run: now it goes as any other would
    gc.collect()
    assert first() is None and buffers.alive == 1 and buffers.allocations == 2


def test_an_accumulator_that_starts_with_no_rows_makes_one_for_its_first_request():
    acc = WorkerAccumulator(KEYS, "cpu", budget_bytes=1 << 16, max_requests=0)
    assert acc.add_request("a", EmitPolicy.DELTA) == 0 and acc.rows == 1
    assert acc.add_request("b", EmitPolicy.DELTA) == 1 and acc.rows == 2
