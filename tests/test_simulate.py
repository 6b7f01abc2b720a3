"""The main job (``python -m vllm_omni_kernels simulate``) end to end on CPU, both output paths:
every request's audio is checked sample for sample inside the run, and the run fails otherwise."""

import json
import struct

import numpy as np
import pytest

from vllm_omni_kernels.cli import main
from vllm_omni_kernels.serving.wav import pcm16, read_wav, wav_header, write_wav_f32


@pytest.mark.vllm
def test_main_job_serves_both_paths_sample_exact(tmp_path, capsys):
    pytest.importorskip("vllm")
    rc = main(["simulate", "--requests", "24", "--concurrency", "8", "--max-frames", "10", "--device", "cpu",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for path in ("worker", "upstream"):
        s = summary["paths"][path]
        assert s["finished_exact"] + s["aborted_checked"] == 24 and s["slots_held_after"] == 0
        # time to first audio counts the streaming requests; a FINAL_ONLY request's file is its own figure
        assert all(np.isfinite(s[k]) for k in ("ttfa_ms_p99", "first_chunk_delay_ms_p99", "final_only_ms_p99",
                                                  "client_loop_lag_ms_p99"))
    assert len(list((tmp_path / "wav").glob("*.wav"))) == summary["paths"]["worker"]["finished_exact"]
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    assert "audio s / wall s" in capsys.readouterr().out


@pytest.mark.vllm
def test_main_job_in_process_through_the_triton_interpreter(tmp_path, use_backend):
    pytest.importorskip("vllm")
    use_backend("triton")
    assert main(["simulate", "--requests", "6", "--concurrency", "3", "--max-frames", "4", "--device", "cpu",
                 "--in-process", "--paths", "worker", "--out", str(tmp_path), "--no-progress"]) == 0


def test_wav_round_trip_and_streaming_header(tmp_path):
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    write_wav_f32(tmp_path / "x.wav", x, 16000)
    y, sr = read_wav(tmp_path / "x.wav")
    assert sr == 16000 and np.array_equal(x, y)
    streamed = wav_header(24000, float32=False) + pcm16(x)  # length unknown when the header went out
    z, sr = read_wav(streamed)
    assert sr == 24000 and z.dtype == np.int16 and z[0] == -32767 and z[-1] == 32767 and len(z) == 101
    assert len(wav_header(24000, float32=False)) == 44  # PCM: fmt of 16 bytes, no fact chunk
    streamed = wav_header(24000, float32=True) + x.tobytes()
    assert np.array_equal(read_wav(streamed)[0], x)


def _chunks(raw: bytes) -> dict[bytes, bytes]:
    """The chunks of a RIFF/WAVE file by tag, checking that their sizes add up to the RIFF size."""
    assert raw[:4] == b"RIFF" and raw[8:12] == b"WAVE"
    assert struct.unpack_from("<I", raw, 4)[0] == len(raw) - 8
    pos, found = 12, {}
    while pos < len(raw):
        size = struct.unpack_from("<I", raw, pos + 4)[0]
        found[raw[pos:pos + 4]] = raw[pos + 8:pos + 8 + size]
        pos += 8 + size + (size & 1)
    assert pos == len(raw)
    return found


def test_a_float_wav_has_the_chunks_a_non_pcm_file_needs(tmp_path):
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    write_wav_f32(tmp_path / "x.wav", x, 16000)
    chunks = _chunks((tmp_path / "x.wav").read_bytes())
    assert list(chunks) == [b"fmt ", b"fact", b"data"]
    tag, channels, rate, byte_rate, align, bits, extension = struct.unpack("<HHIIHHH", chunks[b"fmt "])
    assert (tag, channels, rate, byte_rate, align, bits, extension) == (3, 1, 16000, 64000, 4, 32, 0)
    assert struct.unpack("<I", chunks[b"fact"]) == (101,)
    assert list(_chunks(wav_header(16000, float32=False, data_bytes=0))) == [b"fmt ", b"data"]


def test_info_reports_backends(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["cpu"]["ring_write"]["backend"] in ("torch", "triton")


@pytest.mark.vllm
def test_the_check_finds_one_altered_sample():
    pytest.importorskip("vllm")
    import torch

    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _check, _Plan, _Result, _settle

    def result(rid: str, alter: bool) -> _Result:
        codes = torch.randint(0, tk.CODEBOOK_SIZE, (3, tk.CODEBOOKS), generator=torch.Generator().manual_seed(1))
        audio = tk.expected_audio(codes).clone()
        if alter:
            audio[2 * tk.FRAME_SAMPLES + 5] += 1e-3
        r = _Result(_Plan(rid, [5], 3, "delta", False, False, 0.0))
        r.audio, r.codes = list(audio.split(tk.FRAME_SAMPLES)), list(codes.split(1))
        r.tokens = (codes[:, 0] + tk.TEXT_VOCAB).tolist()
        r.finish_reason = "length"
        _settle(r)
        return r

    assert _check([result("req-good", alter=False)], None, bad_fails=True)["finished_exact"] == 1
    with pytest.raises(AssertionError, match=r"req-bad .*1 of 5760 samples differ, from sample 3845 .*frame 2"):
        _check([result("req-ok", alter=False), result("req-bad", alter=True)], None, bad_fails=True)
