"""The main job on CPU: every request's WAV is checked sample-exactly inside the run."""

import json

from vllm_omni_kernels.cli import main
from vllm_omni_kernels.simulate import read_wav_f32, write_wav_f32


def test_simulate_small_run_is_sample_exact(tmp_path, capsys, use_backend):
    use_backend("torch")
    rc = main(["simulate", "--requests", "12", "--concurrency", "6", "--max-frames", "12", "--device", "cpu",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished_exact"] == 12 and summary["pool"]["bytes_used"] == 0
    assert len(list(tmp_path.glob("*.wav"))) == 12
    assert "audio s / wall s" in capsys.readouterr().out


def test_simulate_through_triton_interpreter(tmp_path, use_backend):
    use_backend("triton")
    assert main(["simulate", "--requests", "4", "--concurrency", "4", "--max-frames", "9", "--device", "cpu",
                 "--out", str(tmp_path), "--no-progress"]) == 0


def test_wav_round_trip(tmp_path):
    import numpy as np

    x = np.linspace(-1, 1, 101, dtype=np.float32)
    write_wav_f32(tmp_path / "x.wav", x, 16000)
    y, sr = read_wav_f32(tmp_path / "x.wav")
    assert sr == 16000 and np.array_equal(x, y)


def test_info_reports_backends(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["cpu"]["ring_write"]["backend"] in ("torch", "triton")
