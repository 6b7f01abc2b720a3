"""The main job: a streaming TTS accumulation run on the default device.

Many concurrent requests start and finish at staggered steps; every step each live request emits a
chunk of its own 24 kHz tone (chunk sizes vary per request and step) plus codec codes ``[n, Q]`` and
the sample rate as metadata. Everything goes through ``MultimodalAccumulator``: half the requests
stream in DELTA mode (written to their WAV as they arrive), half in FINAL_ONLY. Each finished
request's WAV is written, read back and checked sample-exactly against its expected tone; codes are
checked exactly too. Prints throughput (audio seconds accumulated per wall second) and pool stats.

Tones are table lookups (``sin`` tabulated once per request, period ``sr / f`` samples), so the
device-generated chunks and the host-computed expectation are bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from pathlib import Path

import numpy as np
import torch

from .accumulator import AccumulatorConfig, EmitPolicy, MultimodalAccumulator
from .modality import OutputModality, TensorAccumulationStrategy
from .ring import PaddedBatch

SR = 24_000
FRAME = 1920  # one 12.5 Hz codec frame at 24 kHz
Q = 16  # codebooks per codec frame
_FREQS = [f for f in range(100, 2001) if SR % f == 0]


@dataclasses.dataclass
class SimConfig:
    requests: int = 96
    concurrency: int = 48
    min_frames: int = 8  # request length in codec frames
    max_frames: int = 60
    max_chunk_frames: int = 4  # a step emits 1..max_chunk_frames codec frames' worth of audio
    seed: int = 0
    out_dir: str = "out/simulate"
    device: str = "auto"
    progress: bool = True


@dataclasses.dataclass
class _Req:
    rid: str
    freq: int
    total: int  # samples
    emit: EmitPolicy
    interval: int
    done: int = 0  # samples emitted by the "model"
    frames_done: int = 0
    streamed: list = dataclasses.field(default_factory=list)


def write_wav_f32(path: Path, samples: np.ndarray, sr: int = SR) -> None:
    """Mono IEEE-float WAV (format 3), written by hand: the stdlib ``wave`` only does PCM."""
    data = samples.astype("<f4").tobytes()
    header = b"RIFF" + struct.pack("<I", 4 + 26 + 12 + 8 + len(data)) + b"WAVE"
    fmt = b"fmt " + struct.pack("<IHHIIHHH", 18, 3, 1, sr, sr * 4, 4, 32, 0)
    fact = b"fact" + struct.pack("<II", 4, len(samples))
    path.write_bytes(header + fmt + fact + b"data" + struct.pack("<I", len(data)) + data)


def read_wav_f32(path: Path) -> tuple[np.ndarray, int]:
    raw = path.read_bytes()
    sr = struct.unpack_from("<I", raw, 24)[0]
    pos = 12
    while pos < len(raw):
        tag, size = raw[pos:pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        if tag == b"data":
            return np.frombuffer(raw[pos + 8:pos + 8 + size], dtype="<f4"), sr
        pos += 8 + size + (size & 1)
    raise ValueError(f"{path}: no data chunk")


def _codes(rid_index: int, frame0: int, n: int) -> np.ndarray:
    frames = np.arange(frame0, frame0 + n, dtype=np.int64)[:, None]
    return (rid_index * 1_000_003 + frames * Q + np.arange(Q, dtype=np.int64)[None, :]) % 4096


def run(cfg: SimConfig) -> dict:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    rng = np.random.default_rng(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    # Tone tables, one period per request, flattened: the "model" gathers from them on the device.
    reqs: list[_Req] = []
    tables, offsets = [], []
    for i in range(cfg.requests):
        f = int(rng.choice(_FREQS))
        period = SR // f
        offsets.append(sum(len(t) for t in tables))
        tables.append((0.5 * np.sin(2 * np.pi * np.arange(period) / period)).astype(np.float32))
        n_frames = int(rng.integers(cfg.min_frames, cfg.max_frames + 1))
        emit = EmitPolicy.DELTA if i % 2 == 0 else EmitPolicy.FINAL_ONLY
        reqs.append(_Req(f"req-{i:04d}", f, n_frames * FRAME, emit, int(rng.integers(1, 4))))
    table_host = np.concatenate(tables)
    table_dev = torch.from_numpy(table_host).to(device)
    period_of = {r.rid: SR // r.freq for r in reqs}
    offset_of = {r.rid: offsets[i] for i, r in enumerate(reqs)}
    index_of = {r.rid: i for i, r in enumerate(reqs)}

    acc = MultimodalAccumulator(AccumulatorConfig(
        modality=OutputModality.AUDIO,
        strategies={"codes": TensorAccumulationStrategy.CONCAT_DIM0}, pool_budget_bytes=256 << 20,
        initial_frames={"audio": 4 * FRAME, "codes": 8}), device=device)
    pending = list(reversed(reqs))
    live: list[_Req] = []
    finished_ok = 0
    audio_samples = 0
    steps = 0
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.requests, desc=f"simulate[{device.type}]", unit="req")
    max_chunk = cfg.max_chunk_frames * FRAME
    ar = torch.arange(max_chunk, device=device)
    t0 = time.perf_counter()
    while pending or live:
        # Staggered arrivals: at most two new requests a step, up to the concurrency limit.
        for _ in range(2):
            if pending and len(live) < cfg.concurrency:
                r = pending.pop()
                acc.add_request(r.rid, emit=r.emit, stream_interval=r.interval)
                live.append(r)
        ids = [r.rid for r in live]
        lengths = np.array([min(r.total - r.done, FRAME * int(rng.integers(1, cfg.max_chunk_frames + 1)))
                            - (int(rng.integers(0, 480)) if r.total - r.done > max_chunk else 0)
                            for r in live], dtype=np.int64)
        starts = torch.tensor([r.done for r in live], device=device)
        period = torch.tensor([period_of[r.rid] for r in live], device=device)
        toff = torch.tensor([offset_of[r.rid] for r in live], device=device)
        audio = table_dev[toff[:, None] + (starts[:, None] + ar[None, :]) % period[:, None]]  # [B, max_chunk]
        code_frames = [(r.done + n) // FRAME - r.frames_done for r, n in zip(live, lengths)]
        codes = [torch.from_numpy(_codes(index_of[r.rid], r.frames_done, k)).to(device)
                 for r, k in zip(live, code_frames)]
        errors = acc.append_step(ids, {
            "audio": PaddedBatch(audio, lengths),
            "codes": codes,
            "sr": [SR] * len(live),
        })
        if errors:
            raise RuntimeError(f"unexpected accumulation errors: {errors}")
        for r, n, k in zip(live, lengths, code_frames):
            r.done += int(n)
            r.frames_done += k
        audio_samples += int(lengths.sum())
        finished = [r.rid for r in live if r.done >= r.total]
        payloads = acc.collect(finished, to_cpu=True).wait()
        for rid, payload in payloads.items():
            r = reqs[index_of[rid]]
            r.streamed.append(payload)
        for rid in finished:
            r = reqs[index_of[rid]]
            _finish(r, index_of[rid], table_host[offset_of[rid]:offset_of[rid] + period_of[rid]], out_dir)
            finished_ok += 1
            if bar is not None:
                bar.update(1)
        live = [r for r in live if r.done < r.total]
        steps += 1
        if steps == 1 or steps % 50 == 0:
            high = acc.stats()["high_water_bytes"]
            if bar is not None:
                bar.set_postfix(live=len(live), pool_mib=f"{high / 2**20:.1f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    stats = acc.stats()
    summary = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "backend": _backend_name(device),
        "requests": cfg.requests, "finished_exact": finished_ok, "steps": steps,
        "audio_seconds": audio_samples / SR, "wall_seconds": wall,
        "audio_seconds_per_wall_second": audio_samples / SR / wall,
        "pool": {k: v for k, v in stats.items() if k != "pools"},
        "pools": {k: dataclasses.asdict(v) for k, v in stats["pools"].items()},
        "wav_dir": str(out_dir),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _finish(r: _Req, index: int, period_table: np.ndarray, out_dir: Path) -> None:
    """Assemble the request's audio from its emissions, write + re-read its WAV, check it exactly."""
    pieces = [p.tensors["audio"] for p in r.streamed if "audio" in p.tensors]
    codes = [p.tensors["codes"] for p in r.streamed if "codes" in p.tensors]
    if r.emit is EmitPolicy.FINAL_ONLY and len(pieces) != 1:
        raise AssertionError(f"{r.rid}: FINAL_ONLY emitted {len(pieces)} times")
    audio = torch.cat([p.reshape(-1) for p in pieces]).cpu().numpy()
    expected = period_table[np.arange(r.total) % len(period_table)]
    path = out_dir / f"{r.rid}_{r.freq}hz_{r.emit.value}.wav"
    write_wav_f32(path, audio)
    back, sr = read_wav_f32(path)
    if sr != SR or not np.array_equal(back, expected) or not np.array_equal(audio, expected):
        bad = np.flatnonzero(back != expected[: len(back)])[:5] if len(back) == len(expected) else "length"
        raise AssertionError(f"{r.rid}: audio differs from its {r.freq} Hz tone (first bad samples {bad})")
    got_codes = torch.cat([c.cpu() for c in codes]).numpy()
    if not np.array_equal(got_codes, _codes(index, 0, r.total // FRAME)):
        raise AssertionError(f"{r.rid}: codec codes differ")
    if r.streamed[-1].metadata.get("sr") != SR:
        raise AssertionError(f"{r.rid}: sr metadata missing")
    r.streamed.clear()


def _backend_name(device: torch.device) -> str:
    from . import backend

    return backend.select(device)[0]
