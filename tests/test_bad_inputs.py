"""Every kind of bad input, one table: a typed error naming the bad request and the key, for that
request only; every other request of the step exact; the bad request's earlier data kept; the
accumulator (and the processor, for what arrives over the wire) usable after.

Each case runs three steps for requests ``g1``, ``bad`` and ``g2``: a good step, the step where
``bad`` (or a request that is not there) sends the bad input, and a good step again.
"""

from dataclasses import dataclass, field

import pytest
import torch

from vllm_omni_kernels.accumulator import AccumulatorConfig, MultimodalAccumulator
from vllm_omni_kernels.errors import TensorAccumulationError
from vllm_omni_kernels.modality import OutputModality, TensorAccumulationStrategy as S
from vllm_omni_kernels.ring import PaddedBatch

IDS = ["g1", "bad", "g2"]


def chunk(n: int, step: int, row: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 1000 * step + 100 * row


@dataclass
class Case:
    name: str
    bad_step: object  # (step chunks of the good requests) -> (ids, outputs)
    bad_ids: tuple = ("bad",)
    kept: int = 0  # frames of the bad step kept for "bad" (a duplicate's first chunk)
    config: dict = field(default_factory=dict)
    message: str = ""


def lists(ids, values):
    return ids, {"audio": values}


def padded(lengths, axis=6):
    data = torch.stack([torch.cat([chunk(n, 1, i), torch.zeros(axis - n)]) if n >= 0 else torch.zeros(axis)
                        for i, n in enumerate([3, 2, 4])])
    return IDS, {"audio": PaddedBatch(data, lengths)}


CASES = [
    Case("dtype", lambda g: lists(IDS, [g[0], chunk(2, 1, 1).double(), g[2]]), message="dtype"),
    Case("frame shape", lambda g: lists(IDS, [g[0], torch.zeros(2, 2), g[2]]), message="frame shape"),
    Case("device", lambda g: lists(IDS, [g[0], torch.zeros(2, device="meta"), g[2]]), message="meta"),
    Case("unknown request", lambda g: lists(["g1", "ghost", "g2"], [g[0], chunk(2, 1, 1), g[2]]),
         bad_ids=("ghost",), message="unknown"),
    Case("freed request", lambda g: lists(["g1", "gone", "g2"], [g[0], chunk(2, 1, 1), g[2]]),
         bad_ids=("gone",), message="unknown"),
    Case("duplicate", lambda g: lists(["g1", "bad", "g2", "bad"], [g[0], chunk(2, 1, 1), g[2], chunk(5, 1, 9)]),
         kept=2, message="twice"),
    Case("overflow with growth off", lambda g: lists(IDS, [g[0], chunk(20, 1, 1), g[2]]),
         config={"growth": False, "initial_frames": 16}, message="growth is off"),
    Case("budget spent", lambda g: lists(IDS, [g[0], chunk(100, 1, 1), g[2]]),
         config={"pool_budget_bytes": 64 * 4}, message="budget"),
    Case("negative length", lambda g: padded([3, -1, 4]), message="length -1"),
    Case("length past the batch", lambda g: padded([3, 7, 4]), message="length 7"),
    Case("non-tensor value", lambda g: lists(IDS, [g[0], "oops", g[2]]), message="replace"),
    Case("0-d tensor for a concatenating key", lambda g: lists(IDS, [g[0], torch.tensor(1.0), g[2]]),
         message="replace"),
    Case("list for a concatenating key", lambda g: lists(IDS, [g[0], [1.0, 2.0], g[2]]), message="replace"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_bad_input_fails_only_its_request_and_key(case, backend_name, use_backend):
    use_backend(backend_name)
    cfg = dict(modality=OutputModality.AUDIO, strategies={"audio": S.CONCAT_LAST}, initial_frames=8,
               pool_budget_bytes=1 << 16)
    acc = MultimodalAccumulator(AccumulatorConfig(**{**cfg, **case.config}), "cpu")
    for rid in [*IDS, "gone"]:
        acc.add_request(rid)
    expect = {rid: [] for rid in IDS}

    def good_step(step):
        values = [chunk(3 + i, step, i) for i in range(3)]
        assert acc.append_step(IDS, {"audio": values}) == []
        for rid, v in zip(IDS, values):
            expect[rid].append(v)
        return values

    good_step(0)
    acc.abort("gone")
    ids, outputs = case.bad_step([chunk(3, 1, 0), None, chunk(4, 1, 2)])
    errors = acc.append_step(ids, outputs)
    assert errors and all(isinstance(e, TensorAccumulationError) for e in errors)
    assert {e.request_id for e in errors} == set(case.bad_ids) and {e.key for e in errors} == {"audio"}
    assert all(case.message in str(e) and repr(e.request_id) in str(e) for e in errors), [str(e) for e in errors]
    # the good requests' chunks of the bad step, as they were sent
    audio = outputs["audio"]
    for rid in ("g1", "g2"):
        i = ids.index(rid)
        if isinstance(audio, PaddedBatch):
            expect[rid].append(audio.data[i, : audio.lengths[i]])
        else:
            expect[rid].append(audio[i])
    if case.kept:
        expect["bad"].append(audio[ids.index("bad")][: case.kept])
    good_step(2)  # the accumulator goes on, for the bad request too
    got = acc.collect(IDS)
    for rid in IDS:
        assert torch.equal(got[rid].tensors["audio"], torch.cat(expect[rid])), rid
    assert acc.accumulation_errors == len(errors) and acc.stats()["bytes_used"] == 0
