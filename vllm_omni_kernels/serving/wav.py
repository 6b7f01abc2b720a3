"""WAV files and streams: float32 (IEEE, format 3) and 16-bit PCM, written by hand (the standard
library's ``wave`` writes PCM only and cannot stream a header of unknown length)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

STREAMING_SIZE = 0xFFFFFFFF  # the data size of a header written before the length is known


def wav_header(sample_rate: int, *, float32: bool, data_bytes: int = STREAMING_SIZE) -> bytes:
    """A RIFF/WAVE header for mono audio; ``data_bytes`` left at its default for a stream whose
    length is not known yet (players read to the end). Float samples (format 3, not PCM) get what
    the format asks of a non-PCM file: a ``fmt `` chunk of 18 bytes (no extension) and a ``fact``
    chunk with the number of samples (``STREAMING_SIZE`` while unknown)."""
    width = 4 if float32 else 2
    fmt = struct.pack("<HHIIHH", 3 if float32 else 1, 1, sample_rate, sample_rate * width, width, 8 * width)
    fact = b""
    if float32:
        fmt += struct.pack("<H", 0)
        frames = STREAMING_SIZE if data_bytes == STREAMING_SIZE else data_bytes // width
        fact = b"fact" + struct.pack("<II", 4, frames)
    riff = STREAMING_SIZE if data_bytes == STREAMING_SIZE else 4 + 8 + len(fmt) + len(fact) + 8 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + fact
            + b"data" + struct.pack("<I", data_bytes))


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as little-endian 16-bit PCM: clipped to [-1, 1], times 32767, rounded to nearest
    (so -1 and anything below it are -32767, as 1 and above are 32767; NaN is 0)."""
    x = np.array(samples, np.float64)  # (one copy, worked on in place)
    np.nan_to_num(x, copy=False, nan=0.0)
    np.clip(x, -1.0, 1.0, out=x)
    x *= 32767.0
    return np.rint(x, out=x).astype("<i2").tobytes()


def write_wav_f32(path: Path, samples: np.ndarray, sample_rate: int) -> None:
    data = np.asarray(samples, "<f4").tobytes()
    Path(path).write_bytes(wav_header(sample_rate, float32=True, data_bytes=len(data)) + data)


def read_wav(path_or_bytes: Path | bytes) -> tuple[np.ndarray, int]:
    """Samples (float32 for format 3, int16 for PCM) and the sample rate; a streamed header's size
    (``STREAMING_SIZE``) reads to the end."""
    raw = bytes(path_or_bytes) if isinstance(path_or_bytes, (bytes, bytearray, memoryview)) \
        else Path(path_or_bytes).read_bytes()
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos, dtype, rate = 12, None, None
    while pos + 8 <= len(raw):
        tag, size = raw[pos:pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        if tag == b"fmt ":
            if size < 16 or pos + 24 > len(raw):
                raise ValueError(f"a fmt chunk of {size} bytes, of which {len(raw) - pos - 8} are there: 16 at least")
            fmt, channels, rate = struct.unpack_from("<HHI", raw, pos + 8)
            bits = struct.unpack_from("<H", raw, pos + 22)[0]
            dtype = {(3, 32): "<f4", (1, 16): "<i2"}.get((fmt, bits))
            if dtype is None or channels != 1:
                raise ValueError(f"format {fmt} of {bits}-bit samples in {channels} channels: this reads "
                                 "mono 32-bit float (3) and 16-bit PCM (1)")
        elif tag == b"data":
            if dtype is None:
                raise ValueError("a data chunk before the fmt chunk")
            end = len(raw) if size == STREAMING_SIZE else pos + 8 + size
            return np.frombuffer(raw[pos + 8:end], dtype=dtype), rate
        pos += 8 + size + (size & 1)
    raise ValueError("no data chunk")
