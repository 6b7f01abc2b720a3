"""The main job (``python -m vllm_omni_kernels simulate``) end to end on CPU, both output paths:
every request's audio is checked sample for sample inside the run, and the run fails otherwise."""

import json
import struct
import sys

import numpy as np
import pytest

from vllm_omni_kernels.cli import main
from vllm_omni_kernels.serving.wav import pcm16, read_wav, wav_header, write_wav_f32


@pytest.mark.vllm
def test_main_job_serves_both_paths_sample_exact(tmp_path, capsys):
    pytest.importorskip("vllm")
    (tmp_path / "wav").mkdir()
    (tmp_path / "wav" / "req-999_delta.wav").write_bytes(b"")  # an earlier run's: it must not pass for this one's
    rc = main(["simulate", "--requests", "24", "--concurrency", "8", "--max-frames", "10", "--device", "cpu",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for path in ("worker", "upstream"):
        s = summary["paths"][path]
        assert s["finished_exact"] + s["aborted_checked"] == 24 and s["slots_held_after"] == 0
        assert s["requests_stopped"] > 0  # by default some end on their stop token, as TTS requests do
        # time to first audio counts the streaming requests; a FINAL_ONLY request's file is its own figure
        assert all(np.isfinite(s[k]) for k in ("ttfa_ms_p99", "first_chunk_delay_ms_p99", "final_only_ms_p99",
                                                  "client_loop_lag_ms_p99"))
        # the first chunk's delay by stage: every streaming request's four stamps were found, in order
        stages = [s[f"first_chunk_{stage}_ms_{q}"] for stage in ("engine_core", "to_decoder", "to_processor",
                                                                  "to_client") for q in ("p50", "p99")]
        assert all(np.isfinite(v) and v >= 0 for v in stages), stages
        assert s["stage_split_requests"] == s["streaming_requests"] > 0
        # per audio second, the paths compare the same work (per step they would not: a path's steps
        # carry as many streams as its client keeps up with)
        assert s["wire_bytes_per_audio_second"] == pytest.approx(
            s["wire_bytes_per_step"] * s["output_steps"] / s["audio_seconds"])
    assert len(list((tmp_path / "wav").glob("*.wav"))) == summary["paths"]["worker"]["finished_exact"]
    assert set(summary["ratios"]) == {"frontend_multimodal_us_per_audio_second", "wire_bytes_per_audio_second",
                                      "d2h_copies_per_step"}
    assert (tmp_path / "simulate.png").stat().st_size > 10_000
    assert "audio s / wall s" in capsys.readouterr().out


def test_the_first_chunks_stages_are_found_with_request_ids_as_the_caller_gave_them(tmp_path, monkeypatch):
    """``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1``: vLLM keeps the caller's request ids as they are;
    the worker's record of each first chunk still names its request (it cut the ids at their last
    "-", so every first-chunk figure was null)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert main(["simulate", "--requests", "6", "--concurrency", "3", "--max-frames", "4", "--paths", "worker",
                 "--kinds", "delta", "--no-wavs", "--out", str(tmp_path), "--no-progress"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())["paths"]["worker"]
    assert s["stage_split_requests"] == s["streaming_requests"] > 0 and s["first_chunk_delay_ms_p99"] is not None


def test_the_warm_up_runs_the_largest_batch_of_the_run_not_of_the_engine(tmp_path, monkeypatch):
    """Fewer requests than may be in flight: the warm-up runs as many as the run will (its requests
    make i + 2 tokens each, so warming ``--concurrency 1000`` for two requests took 100 s)."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration import simulate

    warmed = []

    async def counted(engine, requests=None, share=(0, 1)):
        warmed.append(requests)
        await real(engine, requests, share)

    real = simulate.warm_up
    monkeypatch.setattr(simulate, "warm_up", counted)
    assert main(["simulate", "--requests", "3", "--concurrency", "16", "--max-frames", "4", "--paths", "worker",
                 "--no-wavs", "--out", str(tmp_path), "--no-progress"]) == 0
    assert warmed == [3]


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
    # a chunk after the samples (an editor's LIST) is not read as samples
    tagged = (tmp_path / "x.wav").read_bytes() + b"LIST" + struct.pack("<I", 4) + b"INFO"
    assert np.array_equal(read_wav(tagged)[0], x)
    assert np.array_equal(read_wav(bytearray(tagged))[0], x) and np.array_equal(read_wav(memoryview(tagged))[0], x)
    # samples it cannot tell the format of, or of a format it does not read, are refused, not guessed
    header = wav_header(16000, float32=True, data_bytes=4 * len(x))
    fmt_at, data_at = header.index(b"fmt "), header.index(b"data")
    with pytest.raises(ValueError, match="before the fmt chunk"):
        read_wav(header[:fmt_at] + header[data_at:] + x.tobytes() + header[fmt_at:data_at])
    stereo = bytearray(header)
    struct.pack_into("<H", stereo, fmt_at + 10, 2)
    with pytest.raises(ValueError, match="2 channels"):
        read_wav(bytes(stereo) + x.tobytes())
    with pytest.raises(ValueError, match="16 at least"):  # (a file cut inside its fmt chunk)
        read_wav(header[:fmt_at + 12])


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


def test_a_model_directory_that_cannot_be_written_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["make-model", str(tmp_path / "file" / "talker")])
    assert exit_.value.code == 2 and "cannot write the model directory" in capsys.readouterr().err


def test_info_reports_backends(capsys):
    assert main(["info"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["cpu"]["ring_write"]["backend"] in ("torch", "triton")
    assert info["versions"]["vllm-omni-kernels"] and info["versions"]["torch"]


def test_output_kinds_and_paths_in_any_case_and_unknown_ones_and_counts_out_of_range_are_usage_errors(capsys):
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration.simulate import SimConfig

    cfg = SimConfig(kinds=("DELTA", " Final_Only"), paths=("Worker",))
    assert cfg.kinds == ("delta", "final_only") and cfg.paths == ("worker",)
    for argv, said in ((["--kinds", "delta,foo"], "unknown output kind 'foo'"), (["--paths", ","], "no path"),
                       (["--device", "gpu"], "device 'gpu'"), (["--clients", "0"], "clients 0"),
                       (["--clients", "2", "--in-process"], "1 with the engine core in process"),
                       (["--clients", "9", "--concurrency", "8"], "more than the 8 requests in flight"),
                       (["--requests", "0"], "requests 0: at least 1"), (["--concurrency", "0"], "concurrency 0"),
                       (["--max-frames", "0"], "max_frames 0"), (["--arrival-ms", "-1"], "arrival_ms -1.0"),
                       (["--arrival-ms", "inf"], "arrival_ms inf"), (["--arrival-ms", "nan"], "arrival_ms nan"),
                       (["--bad-every", "-1"], "bad_every -1"), (["--cadence", "-1"], "cadence -1"),
                       (["--seed", "-1"], "seed -1: at least 0"), (["--seed", str(2**63)], "below 2**63"),
                       (["--max-frames", "8154"], "max_frames 8154: at most 8153"),
                       (["--out", __file__], "a file, not a directory")):
        with pytest.raises(SystemExit) as exit_:
            main(["simulate", *argv])
        assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_make_model_refuses_another_models_directory_an_empty_path_and_a_bad_seed(tmp_path, capsys):
    """A directory with another model's ``config.json`` is left as it was (the talker's own is
    rewritten); an empty path (the current directory) and a seed vLLM cannot take are usage errors."""
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    talker = tmp_path / "talker"
    assert main(["make-model", str(talker)]) == 0 and main(["make-model", str(talker), "--seed", "3"]) == 0
    assert '"talker_seed": 3' in (talker / "config.json").read_text()
    for argv, said in (([str(other)], "another model's (['LlamaForCausalLM'])"), ([""], "give the directory"),
                       ([str(tmp_path / "x"), "--seed", "-5"], "seed -5: at least 0")):
        with pytest.raises(SystemExit) as exit_:
            main(["make-model", *argv])
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["config.json"] and not (tmp_path / "x").exists()
    assert "LlamaForCausalLM" in (other / "config.json").read_text()


def test_a_run_that_stops_early_leaves_no_results_of_the_run_before(tmp_path, monkeypatch):
    """``run`` clears the summary, plot and WAVs of the run before as it starts: a run that stops
    before writing its own (a signal, an error) leaves none that would pass for its own."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration import simulate

    out = tmp_path / "out"
    (out / "wav").mkdir(parents=True)
    for name in ("summary.json", "simulate.png", "wav/req-0000.wav"):
        (out / name).write_text("from the run before")

    def fails(*args):
        raise RuntimeError("the run stops here")

    monkeypatch.setattr(simulate, "_serve", fails)
    with pytest.raises(RuntimeError, match="stops here"):
        simulate.run(simulate.SimConfig(requests=2, concurrency=1, out_dir=str(out)))
    assert not (out / "summary.json").exists() and not (out / "simulate.png").exists()
    assert not list((out / "wav").iterdir())


@pytest.mark.vllm
def test_kinds_as_vllm_spells_them_and_a_summary_of_strict_json(tmp_path):
    """``--kinds DELTA`` (vLLM's spelling) serves and checks as ``delta`` does; figures with no
    sample (FINAL_ONLY times without FINAL_ONLY requests, the event loop of an in-process engine) are
    null in ``summary.json``, which a strict JSON parser reads."""
    pytest.importorskip("vllm")
    assert main(["simulate", "--requests", "6", "--concurrency", "3", "--max-frames", "4", "--device", "cpu",
                 "--in-process", "--paths", "worker", "--kinds", "DELTA", "--out", str(tmp_path), "--no-progress",
                 "--no-wavs"]) == 0

    def refuse(constant):
        raise ValueError(f"{constant} in summary.json")

    s = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)["paths"]["worker"]
    assert s["finished_exact"] + s["aborted_checked"] == 6
    assert s["final_only_ms_p50"] is None and s["client_loop_lag_ms_p99"] is None


def _result(kind: str = "delta", frames: int = 3, prompt=(5, 6, 7), **change):
    """A request's result as the client keeps it, exactly what its prompt makes the talker say;
    ``change``: what to spoil (``audio``: a function of the samples, ``codes``, ``tokens``,
    ``finish_reason``, ``payloads``, ``aborted``, ``inconsistent``)."""
    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _Plan, _Result, _settle

    codes = change.pop("codes", tk.rollout(tk.ToyTalker(0), list(prompt), frames))
    audio = change.pop("audio", lambda a: a)(tk.expected_audio(codes).clone())
    r = _Result(_Plan(f"req-{kind}", list(prompt), frames, kind, False, False, 0.0))
    r.audio, r.codes = list(audio.split(tk.FRAME_SAMPLES)), list(codes.split(1))
    r.tokens = (codes[:, 0] + tk.TEXT_VOCAB).tolist()
    r.finish_reason, r.payloads = "length", 1 if kind == "final_only" else frames
    for name, value in change.items():
        setattr(r, name, value)
    _settle(r)
    return r


def _spoiled():
    import torch
    from vllm_omni_kernels.serving import talker as tk

    def one_sample(a):
        a[2 * tk.FRAME_SAMPLES + 5] += 1e-3
        return a

    other = tk.rollout(tk.ToyTalker(0), [9, 9, 9], 3)
    return {
        "one sample": ({"audio": one_sample}, r"1 of 5760 samples differ, from sample 3845 .*frame 2"),
        "another prompt's codes and audio": ({"codes": other}, "not what its prompt says"),
        "a frame short": ({"codes": tk.rollout(tk.ToyTalker(0), [5, 6, 7], 3)[:2]},
                          "2 frames and 2 tokens, expected 3"),
        "a token short": ({"tokens": None}, "codes do not match"),
        "finished otherwise": ({"finish_reason": "abort"}, "finished by 'abort'"),
        "two whole files": ({"kind": "final_only", "payloads": 2}, "FINAL_ONLY got 2 payloads"),
        "a cumulative output that is no prefix": ({"kind": "cumulative", "inconsistent": "output 2 does not start"},
                                                 "does not start"),
        "an aborted request's wrong prefix": ({"codes": other[:1], "aborted": True}, "not what its prompt says"),
        "a frame of audio too many": ({"audio": lambda a: torch.cat([a, a[:tk.FRAME_SAMPLES]])}, "audio differs"),
        "a token too many": ({"tokens": "one more"}, "3 frames and 4 tokens, expected 3"),
        "a failure not the planned one": ({"bad": True, "error": "boom"}, "should have failed it"),
    }


@pytest.mark.vllm
@pytest.mark.parametrize("case", [
    "one sample", "another prompt's codes and audio", "a frame short", "a token short", "finished otherwise",
    "two whole files", "a cumulative output that is no prefix", "an aborted request's wrong prefix",
    "a frame of audio too many", "a token too many", "a failure not the planned one"])
def test_the_check_finds_what_is_lost_altered_or_anothers(case):
    """Each way a request's audio can go wrong fails the check, naming the request; an exact
    request passes, whole or aborted after its first frame."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _check

    talker = tk.ToyTalker(0)
    good = [_result(), _result("cumulative"), _result("final_only")]
    aborted = _result(codes=tk.rollout(talker, [5, 6, 7], 3)[:1], aborted=True)
    assert _check(good + [aborted], None, bad_error="dtype", talker=talker) == \
        {"finished_exact": 3, "aborted_checked": 1, "failed_as_expected": 0}
    change, message = _spoiled()[case]
    kind = change.pop("kind", "delta")
    tokens = (tk.rollout(talker, [5, 6, 7], 3)[:, 0] + tk.TEXT_VOCAB).tolist()
    if change.get("tokens", 0) is None:
        change["tokens"] = tokens[:2]
    elif change.get("tokens") == "one more":
        change["tokens"] = tokens + tokens[:1]
    if change.pop("bad", False):  # planned with a malformed output: it must fail with the planned error
        change["plan"] = _result(kind).plan
        change["plan"].bad = True
    with pytest.raises(AssertionError, match=message):
        _check(good + [_result(kind, **change)], None, bad_error="dtype", talker=talker)


@pytest.mark.vllm
def test_bad_every_on_the_upstream_path_fails_the_request_whose_value_the_wire_cannot_carry(tmp_path):
    """--bad-every on the upstream path: the talker puts a numpy int among a request's plain values
    (its sample rate), which vLLM's msgpack wire cannot carry. The scheduler in the engine core's
    own process fails that request alone, with an error its caller gets, instead of the encoder
    failing the step's message; every other request is exact."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration.simulate import SimConfig, run

    cfg = SimConfig(requests=8, concurrency=8, min_frames=3, max_frames=5, abort_every=0, bad_every=4,
                    device="cpu", paths=("upstream",), out_dir=str(tmp_path), progress=False, write_wavs=False)
    s = run(cfg)["paths"]["upstream"]
    assert (s["finished_exact"], s["failed_as_expected"], s["slots_held_after"]) == (6, 2, 0)


@pytest.mark.vllm
def test_in_process_final_only_finished_in_the_timer_step_is_not_checked_as_aborted(tmp_path, monkeypatch):
    """In-process: a FINAL_ONLY request planned to be aborted whose final output arrives in the step
    at which its timer runs out finished (vLLM made its whole file); it must be checked whole, not
    counted as aborted with its output dropped (a request is checked as aborted only when it
    was). Timer at 0 s and one-frame requests make every such request finish in that step."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration import simulate

    monkeypatch.setattr(simulate, "_FINAL_ONLY_ABORT_S", 0.0)
    cfg = simulate.SimConfig(requests=3, concurrency=3, min_frames=1, max_frames=1, abort_every=1,
                             kinds=("final_only",), arrival_ms=0, device="cpu", in_process=True,
                             paths=("worker",), out_dir=str(tmp_path), progress=False, write_wavs=False)
    s = simulate.run(cfg)["paths"]["worker"]
    assert s["aborted_checked"] == 0 and s["finished_exact"] == 3, s


def _output(audio, codes, tokens=None, finished=False):
    """A request output as ``simulate._take`` reads it: one completion with the audio and codes
    (``tokens``: its token ids, by default those of the codes)."""
    import types

    from vllm_omni_kernels.payload import MultimodalPayload
    from vllm_omni_kernels.serving import talker as tk

    comp = types.SimpleNamespace(finish_reason="length" if finished else None, stop_reason=None,
                                 token_ids=(codes[:, 0] + tk.TEXT_VOCAB).tolist() if tokens is None else tokens,
                                 multimodal_output=MultimodalPayload({"audio": audio, "codes": codes}))
    return types.SimpleNamespace(outputs=[comp], finished=finished)


@pytest.mark.vllm
def test_a_cumulative_output_wrong_when_delivered_fails_even_when_its_storage_is_shared():
    """This package's CUMULATIVE outputs are views of one GrowingTensor (output_processor._so_far):
    output k's audio and output k+1's prefix are the same memory. An output delivered with a wrong
    frame (here frame 1, set right in place before the next output) fails the check: each output
    is compared with a copy of the one before, taken as it came."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.payload import GrowingTensor
    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _check, _Plan, _Result, _settle, _take

    talker = tk.ToyTalker(0)
    codes = tk.rollout(talker, [5, 6, 7], 3)
    audio = tk.expected_audio(codes)
    F = tk.FRAME_SAMPLES
    res = _Result(_Plan("req-c", [5, 6, 7], 3, "cumulative", False, False, 0.0))
    ga, gc = GrowingTensor(audio[:F], 0, 3 * F), GrowingTensor(codes[:1], 0, 3)

    def out(finished):
        return _output(ga.view(), gc.view(), finished=finished)

    _take(res, out(False))
    wrong = audio[F:2 * F].clone()
    wrong[7] += 1.0
    ga.append(wrong), gc.append(codes[1:2])
    _take(res, out(False))  # the client gets frame 1 wrong here
    ga.view()[F + 7] = audio[F + 7]  # set right in place before the next output
    ga.append(audio[2 * F:]), gc.append(codes[2:])
    _take(res, out(True))
    _settle(res)
    with pytest.raises(AssertionError):
        _check([res], None, bad_error="dtype", talker=talker)


@pytest.mark.vllm
def test_an_aborted_cumulative_request_is_checked_as_its_last_output_came():
    """The simulator aborts a CUMULATIVE request at its first audio: that output is all the check
    sees of it, and is checked as it came, not as its storage holds it at the check (here frame 0
    is wrong when delivered and set right in place after the abort)."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.payload import GrowingTensor, MultimodalPayload
    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _abort_now, _check, _Plan, _Result, _settle, _take

    talker = tk.ToyTalker(0)
    codes = tk.rollout(talker, [5, 6, 7], 3)
    audio = tk.expected_audio(codes)
    F = tk.FRAME_SAMPLES
    res = _Result(_Plan("req-c", [5, 6, 7], 3, "cumulative", True, False, 0.0))  # planned to be aborted
    wrong = audio[:F].clone()
    wrong[7] += 1.0
    ga, gc = GrowingTensor(wrong, 0, 3 * F), GrowingTensor(codes[:1], 0, 3)
    out = _output(ga.view(), gc.view())
    _take(res, out)  # the client gets frame 0 wrong here
    assert _abort_now(res, out)
    res.aborted = True
    _settle(res)
    ga.view()[7] = audio[7]  # set right in place after the abort
    with pytest.raises(AssertionError, match="audio differs"):
        _check([res], None, bad_error="dtype", talker=talker)
    right = _Result(_Plan("req-d", [5, 6, 7], 3, "cumulative", True, False, 0.0))
    out.outputs[0].multimodal_output = MultimodalPayload({"audio": audio[:F].clone(), "codes": codes[:1].clone()})
    _take(right, out)
    right.aborted = True
    _settle(right)
    assert _check([right], None, bad_error="dtype", talker=talker)["aborted_checked"] == 1


@pytest.mark.vllm
@pytest.mark.parametrize("spoil, message", [("an earlier frame's codes changed", "does not start with the output"),
                                            ("codes a frame behind its tokens", "1 frames of codes for its 2 tokens"),
                                            ("a token not its frame's", "codes other than those of its 2 tokens")])
def test_a_cumulative_output_must_hold_the_one_before_and_the_codes_of_its_tokens(spoil, message):
    """A CUMULATIVE output whose earlier codes differ from those the output before held (its audio
    the same: only the codes tell), or that holds fewer frames of codes than the tokens it reports,
    or codes other than its tokens', marks its request inconsistent (saying which), which the check
    then fails."""
    pytest.importorskip("vllm")
    from vllm_omni_kernels.serving import talker as tk
    from vllm_omni_kernels.vllm_integration.simulate import _Plan, _Result, _take

    codes = tk.rollout(tk.ToyTalker(0), [5, 6, 7], 3)
    audio = tk.expected_audio(codes)
    F = tk.FRAME_SAMPLES
    res = _Result(_Plan("req-c", [5, 6, 7], 3, "cumulative", False, False, 0.0))
    tokens = (codes[:, 0] + tk.TEXT_VOCAB).tolist()
    _take(res, _output(audio[:F].clone(), codes[:1].clone(), tokens[:1]))
    assert res.inconsistent is None
    if spoil == "an earlier frame's codes changed":
        later = codes[:2].clone()
        later[0, 3] += 1  # (not codebook 0: the tokens stay right)
        _take(res, _output(audio[:2 * F].clone(), later, tokens[:2]))
    elif spoil == "a token not its frame's":
        _take(res, _output(audio[:2 * F].clone(), codes[:2].clone(), [tokens[0], tokens[1] + 1]))
    else:
        _take(res, _output(audio[:F].clone(), codes[:1].clone(), tokens[:2]))
    assert res.inconsistent is not None and message in res.inconsistent


@pytest.mark.vllm
def test_the_output_path_benchmark_checks_every_stream_and_its_check_can_fail():
    """``profiling/bench_output_path.py`` at a toy size on the CPU, both paths: every stream that
    finished was checked exact; its check fails a stream with a token lost or one code changed."""
    pytest.importorskip("vllm")
    import torch
    from conftest import profiling_script

    bop = profiling_script("bench_output_path")

    from vllm_omni_kernels.serving import talker as tk

    for path in ("worker", "upstream"):
        r = bop.bench(path, 4, 4, 6, torch.device("cpu"), tk.STREAM_CADENCE)
        assert r["checked_exact"] >= 4, r
    s = bop._Stream("r", 0, bop.KINDS[0], 2)
    s.sent = list(torch.randint(0, tk.CODEBOOK_SIZE, (2, tk.CODEBOOKS)).numpy())
    s.codes = [np.stack(s.sent)]
    s.audio = [tk.decode_frames(torch.from_numpy(s.codes[0]), torch.arange(2)).reshape(-1).numpy()]
    s.tokens = [int(c[0]) + tk.TEXT_VOCAB for c in s.sent]
    bop._check(s)
    s.tokens = s.tokens[1:]  # (a token lost on the way: the codes and audio are right)
    with pytest.raises(AssertionError, match="tokens are not the 2"):
        bop._check(s)
    s.tokens = [int(c[0]) + tk.TEXT_VOCAB for c in s.sent]
    s.codes[0][1, 5] += 1
    with pytest.raises(AssertionError, match="frames arrived"):
        bop._check(s)


@pytest.mark.vllm
def test_without_matplotlib_the_run_draws_no_plot_and_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    from vllm_omni_kernels.vllm_integration.simulate import _plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (as when the bench extra is not installed)
    _plot({"paths": {}}, tmp_path / "simulate.png")
    assert not (tmp_path / "simulate.png").exists()
