"""The speech server as users run it (marker vllm): ``python -m vllm_omni_kernels serve`` in its own
process on a free loopback port, its engine core in another, and real HTTP clients (httpx, and
OpenAI's client). Every sample is checked against the talker's own rollout; a disconnect must
free the request's slots; the bound must answer 503; bad requests 400 without touching the engine;
vLLM's own routes stay vLLM's."""

import asyncio
import base64
import contextlib
import json
import math
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
import httpx  # noqa: E402  (the test extra installs it)

from conftest import profiling_script  # noqa: E402
from vllm_omni_kernels.serving import talker as tk  # noqa: E402
from vllm_omni_kernels.serving.server_process import speech_server  # noqa: E402
from vllm_omni_kernels.serving.wav import pcm16, read_wav  # noqa: E402
from vllm_omni_kernels.vllm_integration.speech import SpeechLimits  # noqa: E402
from vllm_omni_kernels.vllm_integration.talker_model import VOICES, make_model_dir  # noqa: E402

pytestmark = pytest.mark.vllm
BOUND = 4
STALL_S = 4  # the test servers' --stall-timeout
ROOT = Path(__file__).resolve().parents[1]


def running_server(tmp_path_factory, *options: str, env: dict[str, str] | None = None, api_key: str | None = None):
    model = make_model_dir(tmp_path_factory.mktemp("talker"))
    log = tmp_path_factory.mktemp("log") / "server.log"
    with speech_server(model, log, "--talker-device", "cpu", "--max-num-seqs", str(BOUND + 2),
                       "--max-inflight", str(BOUND), "--max-input-chars", "3000", "--stall-timeout", str(STALL_S),
                       "--enable-log-requests", "--enable-request-id-headers", "--enable-server-load-tracking",
                       *options,
                       *(("--api-key", api_key) if api_key else ()), cwd=ROOT, env=env) as (url, proc):
        from transformers import AutoTokenizer

        yield {"url": url, "model": model, "tokenizer": AutoTokenizer.from_pretrained(str(model)), "log": log,
               "headers": {"Authorization": f"Bearer {api_key}"} if api_key else None, "proc": proc}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from running_server(tmp_path_factory)


@pytest.fixture(scope="module")
def two_api_servers(tmp_path_factory):
    """The same server with vLLM's ``--api-server-count 2``: two API server processes on one socket."""
    yield from running_server(tmp_path_factory, "--api-server-count", "2")


def expected(server, text: str, voice: str = "alloy", speed: float = 1.0) -> np.ndarray:
    ids = [VOICES[voice], *server["tokenizer"](text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]
    frames = max(1, math.ceil(Fraction(len(ids) - 1) / Fraction(str(speed))))  # a frame a character, exactly
    return tk.expected_audio(tk.rollout(tk.ToyTalker(0), ids, frames)).numpy()


def s16(samples: np.ndarray) -> bytes:
    """16-bit PCM by its definition, sample by sample: the oracle apart from ``serving.wav.pcm16``
    (clipped to [-1, 1], times 32767, rounded half to even; NaN is 0)."""
    values = [0.0 if math.isnan(v) else min(max(v, -1.0), 1.0) for v in np.asarray(samples, np.float64).tolist()]
    return struct.pack(f"<{len(values)}h", *(round(v * 32767) for v in values))


def stats(server) -> dict:
    return httpx.get(f"{server['url']}/v1/audio/speech/stats", headers=server["headers"], timeout=30).json()


def metrics(server) -> dict[str, float]:
    """The speech route's samples on vLLM's ``/metrics``: each outcome's request count, the audio
    seconds sent, and the number of first-audio times observed."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{server['url']}/metrics", headers=server["headers"],
                                                           timeout=30).text):
        for sample in family.samples:
            if sample.name == "vllm_omni:speech_requests_total":
                found[sample.labels["outcome"]] = sample.value
            elif sample.name in ("vllm_omni:speech_audio_seconds_total",
                                 "vllm_omni:speech_time_to_first_audio_seconds_count"):
                found[sample.name.split(":")[1]] = sample.value
    return found


def counted_alike(server, s: dict) -> dict[str, float]:
    """The route's counts on ``/metrics`` are those of its stats (``s``, taken while idle): the
    warm-up's requests in neither."""
    m = metrics(server)
    assert {k: m.get(k, 0) for k in ("served", "rejected", "failed", "cancelled")} == \
        {k: s[k] for k in ("served", "rejected", "failed", "cancelled")}, (m, s)
    return m


def idle(server, timeout: float = 30.0) -> dict:
    """The stats once nothing is in flight and the worker holds no request."""
    t0 = time.time()
    while True:
        s = stats(server)
        pools = s["worker"]["accumulator"]["pools"].values()
        if s["inflight"] == 0 and s["worker"]["requests_held"] == 0 and all(p["slots_used"] == 0 for p in pools):
            return s
        assert time.time() - t0 < timeout, s
        time.sleep(0.1)


def test_the_servers_own_warm_up_counts_nowhere(server):
    """The server warmed its engine and its speech route before it took clients (the worker has
    stepped), and none of that is counted: every outcome is 0 in the stats and on ``/metrics``,
    where each has its series from the start."""
    s = idle(server)
    assert s["worker"]["steps"] > 0
    assert {k: s[k] for k in ("served", "rejected", "failed", "cancelled")} == dict.fromkeys(
        ("served", "rejected", "failed", "cancelled"), 0)
    m = counted_alike(server, s)
    assert all(k in m for k in ("served", "rejected", "failed", "cancelled"))


def test_vllm_routes_stay_vllms(server):
    url = server["url"]
    assert httpx.get(f"{url}/health").status_code == 200
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == str(server["model"])
    r = httpx.post(f"{url}/v1/completions", json={"model": str(server["model"]), "prompt": "hello", "max_tokens": 3},
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    metrics = httpx.get(f"{url}/metrics").text
    assert "vllm:generation_tokens_total" in metrics and "vllm:num_requests_running" in metrics
    r = httpx.post(f"{url}/v1/completions", json={"model": str(server["model"]), "prompt": "hello", "max_tokens": 3,
                                                  "logprobs": 1}, timeout=60)  # the talker has none: 400
    assert r.status_code == 400 and "the talker returns no logprobs" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("fmt, sample_format", [("pcm", "f32"), ("pcm", "s16"), ("wav", "f32"), ("wav", "s16")])
def test_streamed_audio_is_the_talkers_samples(server, fmt, sample_format):
    text = "Streams arrive as they are spoken."
    body = {"input": text, "voice": "nova", "response_format": fmt, "sample_format": sample_format, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{server['url']}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["transfer-encoding"] == "chunked" and "content-length" not in r.headers
        assert r.headers["content-type"] == f"audio/{fmt}"
        assert r.headers["x-audio-sample-rate"] == str(tk.SAMPLE_RATE)
        assert r.headers["x-audio-format"] == fmt and r.headers["x-audio-sample-format"] == f"{sample_format}le"
        chunks = list(r.iter_raw())
    data = b"".join(chunks)
    want = expected(server, text, "nova")
    if fmt == "wav":  # a header of unknown length: RIFF and data sizes 0xFFFFFFFF, then the samples
        header = 44 if sample_format == "s16" else 58  # float: an 18-byte fmt chunk and a fact chunk
        assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"
        assert data[header - 8:header] == b"data\xff\xff\xff\xff"
        samples, rate = read_wav(data)
        assert rate == tk.SAMPLE_RATE
        data = samples.tobytes()
    assert data == (want.astype("<f4").tobytes() if sample_format == "f32" else s16(want))


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_whole_file_is_the_talkers_samples(server, fmt):
    text = "One complete file, at a faster speed."
    r = httpx.post(f"{server['url']}/v1/audio/speech", timeout=60,
                   json={"input": text, "voice": "echo", "response_format": fmt, "sample_format": "f32", "speed": 1.5})
    assert r.status_code == 200
    assert int(r.headers["content-length"]) == len(r.content)
    assert r.headers["content-type"] == f"audio/{fmt}" and r.headers["x-audio-format"] == fmt
    assert r.headers["x-audio-sample-rate"] == str(tk.SAMPLE_RATE) and r.headers["x-audio-sample-format"] == "f32le"
    if fmt == "wav":  # a complete file: its sizes are the real ones
        assert struct.unpack_from("<I", r.content, 4)[0] == len(r.content) - 8
        assert r.content[38:42] == b"fact" and r.content[50:54] == b"data"  # a float file: its sample frames
        assert struct.unpack_from("<I", r.content, 46)[0] * 4 == struct.unpack_from("<I", r.content, 54)[0] \
            == len(r.content) - 58
    want = expected(server, text, "echo", 1.5)
    got = read_wav(r.content)[0] if fmt == "wav" else np.frombuffer(r.content, "<f4")
    assert got.tobytes() == want.astype("<f4").tobytes()


def test_openai_client_streams_speech(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0)
    text = "Through the OpenAI client."
    with client.audio.speech.with_streaming_response.create(model=str(server["model"]), voice="sage", input=text,
                                                            response_format="pcm") as resp:
        data = b"".join(resp.iter_bytes())
    assert data == s16(expected(server, text, "sage"))


def test_serve_without_a_talker_directory_says_how_to_make_one(tmp_path):
    """No model directory (vLLM would take its default model from a hub) or one without a config:
    the command stops at once and names ``make-model``."""
    from vllm_omni_kernels.vllm_integration.server import main as serve

    with pytest.raises(SystemExit, match="make-model MODEL_DIR"):
        serve([])
    for argv in ([str(tmp_path / "none")], ["--model", str(tmp_path)]):
        with pytest.raises(SystemExit, match="no config.json there"):
            serve(argv)


def sse_events(lines) -> list[dict]:
    """The JSON of every ``data:`` line of a server-sent event stream."""
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


def test_openai_client_streams_speech_as_server_sent_events(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="none", max_retries=0)
    text = "Events through the OpenAI client."
    with client.audio.speech.with_streaming_response.create(model=str(server["model"]), voice="sage", input=text,
                                                            response_format="pcm", stream_format="sse") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    *deltas, done = events
    assert deltas and {e["type"] for e in deltas} == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == s16(expected(server, text, "sage"))
    prompt = 1 + len(server["tokenizer"](text, add_special_tokens=False)["input_ids"])
    frames = len(expected(server, text, "sage")) // tk.FRAME_SAMPLES
    assert done == {"type": "speech.audio.done",
                    "usage": {"input_tokens": prompt, "output_tokens": frames, "total_tokens": prompt + frames}}


def test_server_sent_events_carry_the_bytes_a_stream_carries(server):
    """A wav of float samples as events: the deltas joined are the streamed response's bytes (its
    header of unknown length first); ``stream: false`` with events is a 400."""
    text = "The same bytes, as events."
    body = {"input": text, "voice": "nova", "response_format": "wav", "sample_format": "f32"}
    streamed = httpx.post(f"{server['url']}/v1/audio/speech", json={**body, "stream": True}, timeout=60)
    with httpx.stream("POST", f"{server['url']}/v1/audio/speech", json={**body, "stream_format": "sse"},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-audio-format"] == "wav"
        events = sse_events(r.iter_lines())
    assert events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == streamed.content
    assert read_wav(streamed.content)[0].tobytes() == expected(server, text, "nova").astype("<f4").tobytes()
    r = httpx.post(f"{server['url']}/v1/audio/speech", json={**body, "stream_format": "sse", "stream": False},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_a_client_behind_the_engine_gets_server_sent_events_of_bounded_size(server):
    """A client that pauses after its first event (3 s, under the stall timeout) while the engine
    runs ahead: the audio made meanwhile, merged into one span, comes as events of at most 64 KiB of
    audio each (whole samples), and all of them joined are the talker's samples. As one event it
    was a line of megabytes, past what SSE clients read as one (aiohttp's 512 KiB: its reader
    raised ``LineTooLong`` in the middle of the audio)."""
    text = "d" * 600
    body = {"input": text, "speed": 0.5, "response_format": "pcm", "sample_format": "f32", "stream_format": "sse"}
    with httpx.stream("POST", f"{server['url']}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        time.sleep(3.0)
        events = sse_events([first, *lines])
    *deltas, done = events
    assert done["type"] == "speech.audio.done"
    audio = [base64.b64decode(e["audio"]) for e in deltas]
    assert max(map(len, audio)) == 1 << 16 and all(len(a) % 4 == 0 for a in audio)
    assert b"".join(audio) == expected(server, text, speed=0.5).astype("<f4").tobytes()


def test_an_input_of_lone_surrogates_is_invalid_text_not_an_empty_one(server):
    for text in ("\\ud800", "\\udc00\\ud800"):  # (JSON escapes of lone surrogates: no pair, no character)
        r = httpx.post(f"{server['url']}/v1/audio/speech", content=f'{{"input": "{text}"}}', timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "input is not valid text" in r.json()["error"]["message"], r.text


def test_a_disconnect_aborts_the_request_and_frees_its_slots(server):
    counted = idle(server)
    before = stats(server)["worker"]["samples"]
    frames = 2900
    body = {"input": "a" * frames, "response_format": "pcm", "sample_format": "f32", "stream": True}
    with httpx.stream("POST", f"{server['url']}/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    after = idle(server)  # the stream closed after its first chunk
    assert after["worker"]["samples"] - before < frames * tk.FRAME_SAMPLES, "the request ran to its end"
    assert all(p["bytes_used"] == 0 for p in after["worker"]["accumulator"]["pools"].values())
    assert (after["cancelled"] - counted["cancelled"], after["served"] - counted["served"]) == (1, 0)
    counted_alike(server, after)


@contextlib.contextmanager
def _posted(server, body: dict):
    """A socket with a receive buffer of a few KiB (its window fills at once) that has posted
    ``body`` to the speech route."""
    data = json.dumps(body).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        url = urllib.parse.urlsplit(server["url"])
        sock.connect((url.hostname, url.port))
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(data) + data)
        yield sock


_TCP_ESTABLISHED, _TCP_CLOSE = 1, 7  # Linux's TCP states (tcp_states.h)


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_stops_reading_loses_its_stream_and_frees_its_slot(server, streamed):
    """A client that keeps its connection open and reads nothing past the headers: once the server's
    send has waited ``--stall-timeout`` seconds for room, its stream is given up (the request aborted
    if it still runs: a CPU talker may have made all of its audio by then), its slot and output
    memory are given back, it counts as cancelled, and the connection is reset at once. Without the timeout
    the slot stays held as long as the client keeps its connection. A whole file (22 MB here) goes
    out the same way: handed to the HTTP server at once, it would stay in the server's memory for as
    long as its client kept the connection, and count as served."""
    counted = idle(server)
    with _posted(server, {"input": "a" * 2900, "response_format": "pcm", "sample_format": "f32",
                          "stream": streamed}) as sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        t0 = time.time()
        time.sleep(1.0)
        assert stats(server)["inflight"] == counted["inflight"] + 1  # held while its send waits
        after = idle(server, timeout=STALL_S + 30)
        assert time.time() - t0 >= STALL_S - 1.5
        # the server has reset the connection, while this client still reads nothing (a close would
        # wait for the unsent bytes to go, keeping its socket for as long as the client likes)
        state = lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]  # noqa: E731 (tcpi_state)
        deadline = time.time() + 10
        while state() == _TCP_ESTABLISHED and time.time() < deadline:
            time.sleep(0.1)
        assert state() == _TCP_CLOSE
    assert all(p["bytes_used"] == 0 for p in after["worker"]["accumulator"]["pools"].values())
    assert (after["cancelled"] - counted["cancelled"], after["served"] - counted["served"]) == (1, 0)


def _read_at(server, body: dict, rate: float) -> bytes:
    """A streamed response's body read through a socket buffer of a few KiB at about ``rate`` bytes a
    second (AssertionError when the server ends it early)."""
    raw = bytearray()
    with _posted(server, body) as sock:
        t0 = time.time()
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            got = sock.recv(1 << 16)
            assert got, f"the server closed the connection after {len(raw)} bytes"
            raw += got
            time.sleep(max(0.0, t0 + len(raw) / rate - time.time()))
    head, _, chunked = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    out, at = bytearray(), 0
    while True:  # each chunk: its size in hex, CRLF, its bytes, CRLF; size 0 ends the body
        end = chunked.index(b"\r\n", at)
        size = int(chunked[at:end], 16)
        if not size:
            return bytes(out)
        out += chunked[end + 2:end + 2 + size]
        at = end + 2 + size + 2


def test_a_client_that_reads_slower_than_the_engine_but_steadily_gets_all_its_audio(server):
    """The engine makes a long request's 22 MB of audio far faster than this client reads it (about
    2 MB a second: minutes of audio merge into a few spans meanwhile), yet no send waits for more
    than the client's reading of ``_SEND_BYTES``, far below ``--stall-timeout``: every sample
    arrives, and the request counts as served."""
    counted = idle(server)
    text = "a" * 2900
    got = _read_at(server, {"input": text, "response_format": "pcm", "sample_format": "f32", "stream": True},
                   rate=2e6)
    assert got == expected(server, text).astype("<f4").tobytes()
    after = idle(server)
    assert (after["served"] - counted["served"], after["cancelled"] - counted["cancelled"]) == (1, 0)


def test_a_client_with_the_kernels_socket_buffers_that_reads_steadily_keeps_its_stream(server):
    """An ordinary client (the kernel's own socket buffers, which grow to megabytes) reading 250 kB
    a second, far behind the engine, for 20 s: no send of the server waits ``--stall-timeout`` for
    it (``server.pace_sends``: a send waits about as long as the client takes to read a few hundred
    KiB). Without the pacing the kernel woke the server's send only once half of a 4 MiB send
    buffer was read (8 s here), and the stream was dropped though its client never stopped reading."""
    rate, seconds = 250e3, 20.0
    body = {"input": "b" * 1500, "speed": 0.25, "response_format": "pcm", "sample_format": "f32", "stream": True}
    counted = idle(server)

    async def read() -> int:
        async with httpx.AsyncClient(base_url=server["url"], timeout=60) as client:
            async with client.stream("POST", "/v1/audio/speech", json=body,
                                     headers={"X-Request-Id": "steady-reader"}) as r:
                assert r.status_code == 200
                got, t0 = 0, time.time()
                async for chunk in r.aiter_raw():
                    got += len(chunk)
                    if time.time() - t0 > seconds:
                        return got
                    await asyncio.sleep(max(0.0, t0 + got / rate - time.time()))
        raise AssertionError(f"the stream ended after {got} bytes")

    got = asyncio.run(read())
    assert got >= rate * seconds * 0.9
    after = idle(server)  # its client left before the end (all of it may be in the client's socket buffer)
    assert (after["cancelled"] - counted["cancelled"]) + (after["served"] - counted["served"]) == 1
    stalled = [line for line in server["log"].read_text().splitlines() if "took no bytes" in line]
    assert not [line for line in stalled if "speech-steady-reader-" in line], stalled


def test_vllms_metrics_count_the_speech_route(server):
    """``/metrics`` carries the route's outcomes, the audio it sent and its first-audio times:
    one more streamed request adds one served, its seconds of audio and one first audio."""
    before = counted_alike(server, idle(server))
    text = "Counted on the metrics page."
    body = {"input": text, "response_format": "pcm", "sample_format": "f32", "stream": True}
    r = httpx.post(f"{server['url']}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200
    after = counted_alike(server, idle(server))
    assert after["served"] - before["served"] == 1
    assert after["speech_time_to_first_audio_seconds_count"] - before["speech_time_to_first_audio_seconds_count"] == 1
    seconds = len(expected(server, text)) / tk.SAMPLE_RATE
    assert after["speech_audio_seconds_total"] - before["speech_audio_seconds_total"] == pytest.approx(seconds)


def hold_the_bound_and_ask_once_more(server) -> None:
    """BOUND streams held open, then one more request: 503 with Retry-After, nothing queued (it is
    neither served later nor seen by the engine); the server takes requests again once they are
    gone."""
    before = idle(server)

    async def scenario():
        async with httpx.AsyncClient(base_url=server["url"], timeout=60,
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            # 6000 frames of float32 each (46 MB, about 20 s of engine steps), each read at 640 kB a
            # second (over a minute for all of it) from the moment it opens: none can finish while
            # the extra request arrives, and none stalls (a client that takes no bytes for
            # --stall-timeout loses its stream and gives its slot back, which a loaded host reached
            # when the four streams were opened first and read afterwards)
            body = {"input": "b" * 1500, "speed": 0.25, "response_format": "pcm", "sample_format": "f32",
                    "stream": True}
            started = [asyncio.Event() for _ in range(BOUND)]

            async def hold(i: int) -> None:
                async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for chunk in r.aiter_raw():
                        started[i].set()
                        await asyncio.sleep(len(chunk) / 640e3)
                raise AssertionError(f"held stream {i} ended")

            held = [asyncio.create_task(hold(i)) for i in range(BOUND)]
            waiting = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in started)))
            done, _ = await asyncio.wait([waiting, *held], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert done == {waiting}, [t.exception() for t in done if t is not waiting] or "no stream began"
            # all BOUND slots taken, each stream running
            extra = await client.post("/v1/audio/speech", json={"input": "hello", "response_format": "pcm"})
            assert extra.status_code == 503, extra.text[:200]
            assert extra.headers["retry-after"] == "1"
            assert extra.json()["error"]["type"] == "ServiceUnavailableError"
            assert not any(t.done() for t in held), [t.exception() for t in held if t.done()]
            for t in held:  # the clients leave: each connection closes
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(scenario())
    s = idle(server)
    assert s["rejected"] == before["rejected"] + 1  # the held streams' clients left before their end
    assert (s["cancelled"] - before["cancelled"], s["served"] - before["served"]) == (BOUND, 0)
    r = httpx.post(f"{server['url']}/v1/audio/speech", json={"input": "again", "response_format": "pcm"}, timeout=60)
    assert r.status_code == 200


def test_over_the_bound_a_request_gets_503_and_nothing_is_queued(server):
    hold_the_bound_and_ask_once_more(server)


@pytest.fixture(scope="module")
def small_audio_memory(tmp_path_factory):
    """A server whose worker has 36 MiB of audio memory: nine whole files of 276 characters at once
    (each reserves a 4 MiB region for all its audio; long enough that, on a loaded host too, none
    finishes before the last of twelve sent together arrives), and twelve requests in flight. Its
    talker makes a malformed second chunk for every request in the voice "onyx" (the worker's
    ``bad_prompt_token``, a test option: a voice is a prompt's first token). A middleware of the
    function form (``tests/passthrough_middleware.py``) is on its routes, as deployments add one."""
    config = json.dumps({"omni": {"bad_prompt_token": VOICES["onyx"]}})
    yield from running_server(tmp_path_factory, "--audio-memory-mib", "36", "--max-inflight", "12",
                              "--max-num-seqs", "12", "--additional-config", config,
                              "--middleware", "tests.passthrough_middleware.passthrough")


def test_a_request_that_fails_after_its_first_audio_is_cut_and_counted_as_failed(small_audio_memory):
    """The worker fails a request whose second chunk is malformed. A stream has had its first
    audio: its chunked response ends without the last chunk, so the client cannot take the audio
    for complete (a middleware between the route and the HTTP server, which would end a body left
    open, included); a whole file is a 500. Both count as failed, and the next request is exact."""
    server = small_audio_memory
    url = f"{server['url']}/v1/audio/speech"
    text = "Cut short after the first frame."
    body = {"input": text, "voice": "onyx", "response_format": "pcm", "sample_format": "f32", "stream": True}
    before = idle(server)
    got = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            got.extend(r.iter_raw())
    want = expected(server, text, "onyx").astype("<f4").tobytes()
    assert b"".join(got) == want[:4 * tk.FRAME_SAMPLES]  # the first frame, then nothing
    whole = httpx.post(url, json={**body, "stream": False}, timeout=60)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "InternalServerError"
    after = idle(server)
    assert (after["failed"] - before["failed"], after["served"] - before["served"]) == (2, 0)
    counted_alike(server, after)
    again = httpx.post(url, json={**body, "voice": "alloy", "stream": False}, timeout=60)
    assert again.status_code == 200 and again.content == expected(server, text).astype("<f4").tobytes()


def test_a_whole_file_longer_than_the_audio_memory_ever_holds_is_400_before_the_engine_runs_it(small_audio_memory):
    """The worker holds a whole file's audio until it ends: one longer than one request's share of
    the output memory could ever be (``file_frames``) would fail however often it is sent (a 500,
    which OpenAI's clients retry). It is refused as bad input, and nothing runs."""
    server = small_audio_memory
    before = idle(server)
    most = before["file_frames"]
    assert 0 < most < 4 * 3000  # (this server's: 36 MiB)
    chars = most // 4 + 1  # at speed 0.25: four frames a character, one frame more than it holds
    body = {"input": "d" * chars, "speed": 0.25, "response_format": "pcm"}
    r = httpx.post(f"{server['url']}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "stream it" in r.json()["error"]["message"]
    after = stats(server)
    assert (after["rejected"], after["failed"], after["worker"]["steps"]) == \
        (before["rejected"], before["failed"], before["worker"]["steps"])
    # vLLM's own routes: a 400 naming max_tokens as the worker refuses it (its first step), not a 500
    completion = {"model": str(server["model"]), "prompt": "hi", "max_tokens": most + 1}
    r = httpx.post(f"{server['url']}/v1/completions", json=completion, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "more than one request can hold" in r.json()["error"]["message"]


def test_a_whole_file_of_as_many_frames_as_the_audio_memory_holds_is_served(small_audio_memory):
    """The bound is the last length served: a whole file of exactly ``file_frames`` frames is
    exact (a speed chosen so that its characters make that many frames)."""
    server = small_audio_memory
    most = idle(server)["file_frames"]
    chars = next(c for c in range(most // 4, 3001)  # (frames: the characters over the speed's decimal value, up)
                 if math.ceil(Fraction(c) / Fraction(str(round(c / most, 6)))) == most)
    speed = round(chars / most, 6)
    text = "e" * chars
    assert len(expected(server, text, speed=speed)) == most * tk.FRAME_SAMPLES
    body = {"input": text, "speed": speed, "response_format": "pcm", "sample_format": "f32"}
    r = httpx.post(f"{server['url']}/v1/audio/speech", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.content == expected(server, text, speed=speed).astype("<f4").tobytes()


def test_requests_the_audio_memory_cannot_hold_get_503_and_the_others_their_audio(small_audio_memory):
    """Twelve whole files at once: those the worker cannot hold (three, unless one has finished
    before the last arrives) are answered 503 with Retry-After (a retry succeeds once others
    finish), the others are exact, and the server serves on (the engine core survives it, and every
    other request with it)."""
    server = small_audio_memory
    text = "c" * 276
    body = {"input": text, "response_format": "pcm", "sample_format": "f32"}

    async def together():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/audio/speech", json=body) for _ in range(12)))

    before = idle(server)
    responses = asyncio.run(together())
    want = expected(server, text).astype("<f4").tobytes()
    ok = sum(r.status_code == 200 for r in responses)
    assert 9 <= ok < 12 and sorted(r.status_code for r in responses) == [200] * ok + [503] * (12 - ok)
    for r in responses:
        if r.status_code == 200:
            assert r.content == want
        else:
            error = r.json()["error"]
            assert r.headers["retry-after"] == "1" and error["type"] == "ServiceUnavailableError"
            assert "speech-" in error["message"] and "budget" in error["message"], error
    after = idle(server)  # turned away, not served
    assert (after["served"] - before["served"], after["rejected"] - before["rejected"]) == (ok, 12 - ok)
    again = httpx.post(f"{server['url']}/v1/audio/speech", json=body, timeout=120)
    assert again.status_code == 200 and again.content == want
    # vLLM's own routes answer the same with 503 (the error is vLLM's RetryableRequestError)
    completion = {"model": str(server["model"]), "prompt": "hello", "max_tokens": 276}

    async def completions():
        async with httpx.AsyncClient(base_url=server["url"], timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=completion) for _ in range(12)))

    responses = asyncio.run(completions())
    ok = sum(r.status_code == 200 for r in responses)
    assert 9 <= ok < 12 and sorted(r.status_code for r in responses) == [200] * ok + [503] * (12 - ok), \
        [r.text for r in responses]
    assert all(r.json()["error"]["type"] == "ServiceUnavailableError" for r in responses if r.status_code == 503)


def test_request_ids_load_and_request_logs_are_vllms(server):
    """With vLLM's ``--enable-request-id-headers`` a response carries one X-Request-Id, the client's
    (vLLM's middleware sets it; the engine request is named after it); ``--enable-server-load-tracking``
    counts a speech stream on ``/load`` while it is in flight, and a request whose client left
    while the handler waited for its file once only; ``--enable-log-requests`` logs a
    served request as added and never as aborted (vLLM's generator, left suspended after the last
    output, was closed later as if the client had gone)."""
    url, text = server["url"], "Counted while it streams. " * 12
    idle(server)
    before = httpx.get(f"{url}/load", timeout=30).json()["server_load"]
    assert before == 0  # (the module's earlier tests: disconnects, stalls, failures, all counted off)
    body = {"input": text, "voice": "alloy", "response_format": "pcm", "sample_format": "f32", "stream": True}
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, headers={"X-Request-Id": "mine-1"},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["mine-1"], r.headers
        chunks = r.iter_raw()
        data = next(chunks)
        during = httpx.get(f"{url}/load", timeout=30).json()["server_load"]
        data += b"".join(chunks)
    assert data == expected(server, text).astype("<f4").tobytes()
    whole = httpx.post(f"{url}/v1/audio/speech", json={**body, "stream": False}, timeout=60)
    assert whole.status_code == 200 and len(whole.headers.get_list("x-request-id")) == 1
    with _posted(server, {"input": "a" * 2900, "response_format": "pcm", "stream": False}):
        time.sleep(0.5)  # its client leaves while the handler waits for the whole file
    idle(server)
    time.sleep(1.0)
    assert during == before + 1 and httpx.get(f"{url}/load", timeout=30).json()["server_load"] == before
    lines = server["log"].read_text().splitlines()
    assert any("Received request speech-mine-1-" in line for line in lines)  # vLLM's request logger
    assert not [line for line in lines if "speech-mine-1-" in line and "abort" in line.lower()]


def test_two_api_server_processes_stream_exact_audio_and_share_the_bound(two_api_servers):
    """With ``--api-server-count 2`` every stream is still the talker's samples (requests through
    both processes, on fresh connections), the bound counts the requests in flight in both, and
    the pools are empty afterwards. Which process accepts a connection is the kernel's choice, so
    a full bound at a time is sent until both have streamed some (a few rounds at most)."""
    server = two_api_servers

    async def one(text: str) -> bytes:
        body = {"input": text, "voice": "alloy", "response_format": "pcm", "sample_format": "f32", "stream": True}
        async with httpx.AsyncClient(base_url=server["url"], timeout=60) as client:  # a connection each
            async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                assert r.status_code == 200, await r.aread()
                return b"".join([c async for c in r.aiter_raw()])

    async def at_once(batch: list[str]) -> list[bytes]:
        return await asyncio.gather(*(one(t) for t in batch))

    def seen_by_each() -> dict[int, tuple[int, int]]:
        """api server index -> (served, streamed requests it saw), from fresh connections."""
        answers = {}
        for _ in range(50):
            a = stats(server)
            answers[a["api_server"]["index"]] = (a["served"], a["first_audio"]["count"])
            if len(answers) == 2:
                break
        assert sorted(answers) == [0, 1], answers  # both processes answer
        return answers

    texts, answers = [], {}
    for round_ in range(8):  # a process releases a slot just after its last bytes: wait for idle between rounds
        idle(server)
        batch = [f"Request {round_ * BOUND + i} through one of two API servers." for i in range(BOUND)]
        for text, data in zip(batch, asyncio.run(at_once(batch))):
            assert data == expected(server, text).astype("<f4").tobytes(), text
        texts += batch
        answers = seen_by_each()
        if round_ and all(seen for _, seen in answers.values()):
            break
    s = idle(server)
    assert all(p["bytes_used"] == 0 for p in s["worker"]["accumulator"]["pools"].values())
    (served0, seen0), (served1, seen1) = answers[0], answers[1]
    assert served0 == served1 == len(texts)  # one count for both processes, their warm-ups in neither
    assert seen0 + seen1 == len(texts) and seen0 and seen1, answers  # the streams went through both
    hold_the_bound_and_ask_once_more(server)
    counted_alike(server, idle(server))  # either process's /metrics: the sum of both
    assert "vllm:generation_tokens_total" in httpx.get(f"{server['url']}/metrics").text


BAD = [
    ({"input": ""}, "input"),
    ({"input": "   "}, "input"),
    ({"input": "x", "voice": "nobody"}, "voice"),
    ({"input": "x", "response_format": "mp3"}, "response_format"),
    ({"input": 5}, "body.input"),
    ({"voice": "alloy"}, "body.input"),
    ({"input": "x", "speed": 10}, "body.speed"),
    ({"input": "x", "stream": "sometimes"}, "body.stream"),
    ({"input": "x", "stream": "true"}, "body.stream"),  # JSON types, never converted
    ({"input": "x", "stream": 1}, "body.stream"),
    ({"input": "x", "speed": "fast"}, "body.speed"),
    ({"input": "x", "speed": "2"}, "body.speed"),
    ({"input": "x", "voice": 3}, "body.voice"),
    ({"input": "x", "response_format": ["pcm"]}, "body.response_format"),
    ({"input": "x", "sample_format": "f64"}, "body.sample_format"),
    ({"input": "x", "stream_format": "chunks"}, "body.stream_format"),
    ({"input": "x", "stream_format": "sse", "stream": False}, "stream"),
    ({"input": "x", "instructions": "Speak softly."}, "instructions"),  # the talker cannot
    ({"input": "x", "instructions": 3}, "body.instructions"),
    ({"input": "y" * 3001}, "input"),  # over --max-input-chars
    ({"input": "y" * 2500, "speed": 0.25}, "input"),  # 10000 frames: past max_model_len
    ({"input": "hi \ud800 there"}, "input"),  # a lone surrogate: valid JSON, no text the tokenizer takes
    ({"input": "\u200b\ufeff\x00\x7f"}, "input"),  # nothing to speak: zero-width, format and control characters
    ({"input": "caf\u00e9"}, "input"),  # characters the talker's tokenizer knows only as its unknown token
    ({"input": "\U0001f600 hi"}, "input"),
]


@pytest.mark.parametrize("text", [" " * 3001, "\ud800" * 3001])
def test_an_input_past_the_limit_is_refused_for_its_length_before_its_characters_are_read(server, text):
    """The length is checked first: the checks of what the characters are read every one of them
    (megabytes of spaces would hold the event loop for half a second, to be called empty)."""
    r = httpx.post(f"{server['url']}/v1/audio/speech", content=json.dumps({"input": text}), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "3001 characters; at most 3000" in r.json()["error"]["message"]


def test_a_body_longer_than_any_speech_request_needs_is_413_as_it_arrives(server):
    """A body past ``SpeechLimits.max_body_bytes`` (the longest input, every character escaped at
    its longest, and room for the other fields) is refused before it is parsed: by its declared
    length, or, sent in chunks without one, once that many bytes have come; the next request is
    exact. The longest input a request may have, escaped at its longest, is not: it gets the 400
    that its characters earn."""
    url = f"{server['url']}/v1/audio/speech"
    json_headers = {"content-type": "application/json"}
    limit = SpeechLimits(max_input_chars=3000).max_body_bytes  # the server's --max-input-chars
    body = json.dumps({"input": "a" * limit}).encode()
    before = idle(server)

    def chunked():  # (a generator: httpx sends it chunked, with no Content-Length)
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    for content in (body, chunked()):
        r = httpx.post(url, content=content, headers=json_headers, timeout=30)
        assert r.status_code == 413, r.text
        assert f"longer than the {limit} bytes" in r.json()["error"]["message"]
    longest = json.dumps({"input": "\U0001f600" * 3000, "voice": "alloy"})  # 12 bytes a character
    assert len(longest) > 36000
    r = httpx.post(url, content=longest, headers=json_headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    after = stats(server)
    assert (after["served"], after["rejected"], after["worker"]["steps"]) == \
        (before["served"], before["rejected"], before["worker"]["steps"])
    text = "Served after a body too large."
    r = httpx.post(url, json={"input": text, "response_format": "pcm", "sample_format": "f32"}, timeout=60)
    assert r.status_code == 200 and r.content == expected(server, text).astype("<f4").tobytes()


@pytest.mark.parametrize("body, param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_requests_get_400_and_leave_the_engine_alone(server, body, param):
    before = idle(server)
    r = httpx.post(f"{server['url']}/v1/audio/speech", content=json.dumps(body), timeout=30,  # ASCII: "\\ud800"
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # OpenAI's error shape, as vLLM writes it (its validation errors are "Bad Request")
    assert err["code"] == 400 and err["type"] in ("BadRequestError", "Bad Request") and err["param"] == param
    assert err["message"]
    after = stats(server)  # nothing admitted, nothing stepped
    assert (after["served"], after["rejected"], after["worker"]["steps"]) == \
        (before["served"], before["rejected"], before["worker"]["steps"])


@pytest.fixture(scope="module")
def short_inputs(tmp_path_factory):
    """A server whose inputs are at most 2 characters: its warm-up must fit that."""
    yield from running_server(tmp_path_factory, "--max-input-chars", "2")


def test_a_server_that_takes_short_inputs_only_starts_and_serves(short_inputs):
    r = httpx.post(f"{short_inputs['url']}/v1/audio/speech", json={"input": "hi", "response_format": "pcm",
                                                                   "sample_format": "f32"}, timeout=60)
    assert r.status_code == 200 and np.array_equal(np.frombuffer(r.content, "<f4"), expected(short_inputs, "hi"))


def test_a_large_piece_is_converted_while_the_event_loop_serves_others():
    """A piece of more than ``_LOOP_SAMPLES`` samples (a whole file's) is converted to bytes in a
    thread: another task runs before the conversion ends (on the event loop it would hold every
    stream of the process for tens of milliseconds); the bytes are the same either way."""
    from vllm_omni_kernels.vllm_integration import speech

    async def convert(audio, fmt):
        ran = []

        async def other():
            ran.append(True)
        task = asyncio.ensure_future(other())
        got = await speech._samples_bytes(audio, fmt)
        other_ran_first = bool(ran)
        await task
        return got, other_ran_first, speech.samples_bytes(audio, fmt)

    audio = torch.linspace(-1.5, 1.5, speech._LOOP_SAMPLES + 1)
    for fmt in ("s16", "f32"):
        got, other_ran_first, same = asyncio.run(convert(audio, fmt))
        assert got == same and other_ran_first


def test_the_route_tokenizes_off_the_event_loop_as_the_oracle_does(tmp_path):
    """The route's prompt and frames (``TextTokenizer``: vLLM's loading of the model's tokenizer) are
    the oracle ``plan_request``'s with the tokenizer as transformers loads it, a special token's
    string spoken as its characters; another task runs while a long input is tokenized (on the
    event loop it would hold every stream of the process for milliseconds)."""
    from transformers import AutoTokenizer
    from vllm.usage.usage_lib import UsageContext

    from vllm_omni_kernels.vllm_integration.llm import omni_vllm_config, talker_engine_args
    from vllm_omni_kernels.vllm_integration.speech import TextTokenizer, UnspokenInputError, plan_request

    model = make_model_dir(tmp_path)
    text_tokenizer = TextTokenizer(omni_vllm_config(talker_engine_args(model), UsageContext.OPENAI_API_SERVER)
                                   .model_config)
    tokenizer = AutoTokenizer.from_pretrained(str(model))

    async def plan(text, speed):
        ran = []

        async def other():
            ran.append(True)
        task = asyncio.ensure_future(other())
        got = await text_tokenizer.plan(VOICES["echo"], text, speed)
        other_ran_first = bool(ran)
        await task
        return got, other_ran_first

    for text, speed in [("Hello there.", 1.0), ("a\n\nb\tc", 0.5), ("long " * 800, 1.0),
                        ("<s>", 1.0), ("I say </s> and [PAD] [UNK] <s>.", 1.0)]:
        got, other_ran_first = asyncio.run(plan(text, speed))
        assert got == plan_request(tokenizer, VOICES["echo"], text, speed) and other_ran_first, text
        if speed == 1.0:
            assert len(got[0]) == 1 + len(text) and got[1] == len(text), (text, got)  # a character a token
    for plan_with in (lambda text: asyncio.run(plan(text, 2.0)), lambda text: plan_request(tokenizer, 1, text)):
        with pytest.raises(UnspokenInputError, match=r"character 'é' \(U\+00E9\) at 2 is not in this model's"):
            plan_with("a é ü 中文")  # (the talker's tokenizer has ASCII characters alone)


@pytest.mark.parametrize("instructions", ["", "  \n"])
def test_empty_or_blank_instructions_are_no_instruction(server, instructions):
    text = "Plain."
    r = httpx.post(f"{server['url']}/v1/audio/speech", timeout=60,
                   json={"input": text, "instructions": instructions, "response_format": "pcm", "sample_format": "f32"})
    assert r.status_code == 200 and r.content == expected(server, text).astype("<f4").tobytes()


def test_an_unknown_word_is_named_where_it_stands_in_the_input(tmp_path):
    """A tokenizer whose tokens are words: the unknown one is named by its place in the text (its
    offsets), not by its index among the tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from vllm_omni_kernels.vllm_integration.speech import UnspokenInputError, plan_request

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1, "there": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    assert plan_request(tokenizer, 7, "hi there") == ([7, 1, 2], 2)
    with pytest.raises(UnspokenInputError, match="input's text 'zz' at 3 is not in this model's vocabulary"):
        plan_request(tokenizer, 7, "hi zz there")


def test_special_token_strings_in_the_input_are_spoken_as_text(server):
    """``<s>``, ``</s>``, ``[PAD]``, ``[UNK]`` in the input are characters to speak, a frame each, not
    the tokenizer's control tokens (which would shorten the audio and put them in the prompt)."""
    text = "I say </s> and [PAD] [UNK] <s>."
    r = httpx.post(f"{server['url']}/v1/audio/speech", timeout=60,
                   json={"input": text, "voice": "echo", "response_format": "pcm", "sample_format": "f32"})
    assert r.status_code == 200
    got = np.frombuffer(r.content, "<f4")
    assert len(got) == len(text) * tk.FRAME_SAMPLES
    assert got.tobytes() == expected(server, text, "echo").astype("<f4").tobytes()


def test_every_character_is_a_token_and_pcm16_clips_at_one(tmp_path):
    """Runs of newlines too (a frame each: the regex "." left them one unknown token); 16-bit
    PCM is the sample clipped to [-1, 1] times 32767, rounded, NaN 0."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(make_model_dir(tmp_path)))
    newline = tok.convert_tokens_to_ids("\n")
    for text in ["a\nb", "a\n\nb", "para one.\n\n\npara two."]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and ids.count(newline) == text.count("\n"), (text, ids)
    x = np.array([-np.inf, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, np.inf, np.nan])
    assert np.frombuffer(pcm16(x), "<i2").tolist() == [-32767] * 3 + [-16384, 0, 16384] + [32767] * 3 + [0]
    halves = (np.arange(-40, 40) + 0.5) / 32767  # half a step between two values: rounded to the even one
    noise = np.random.default_rng(0).uniform(-1.2, 1.2, 10_000).astype(np.float32)
    assert pcm16(halves) == s16(halves) and pcm16(noise) == s16(noise)


def test_unknown_model_is_404_and_non_json_is_400(server):
    for model in ("nope", "\\ud800"):  # (an escaped lone surrogate is valid JSON, which UTF-8 cannot encode)
        r = httpx.post(f"{server['url']}/v1/audio/speech", content=f'{{"input": "x", "model": "{model}"}}',
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    r = httpx.post(f"{server['url']}/v1/audio/speech", json={"input": "x", "model": ""}, timeout=30)
    assert r.status_code == 200  # an empty name is the served model, as on vLLM's routes
    r = httpx.post(f"{server['url']}/v1/audio/speech", content=b"input=x", timeout=30,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400


def test_load_script_against_the_server(server, tmp_path):
    """``profiling/load_speech.py`` against this server, its clients in two processes: every stream
    exact, memory back to idle."""
    run = subprocess.run([sys.executable, str(ROOT / "profiling" / "load_speech.py"), "--url", server["url"],
                          "--model", str(server["model"]), "--clients", "3", "--requests", "2", "--chars", "30",
                          "--min-chars", "10", "--rounds", "1", "--no-probe", "--client-procs", "2",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    res = json.loads((tmp_path / "load_speech.json").read_text())["results"][0]
    assert res["ok"] == 6 and res["streams_exact"] == 6
    assert res["samples_lost"] == res["samples_altered"] == res["samples_extra"] == 0
    assert res["memory_after"]["pool_bytes_used"] == 0 and res["memory_after"]["pool_slots_used"] == 0
    assert (tmp_path / "load_speech.png").exists()


@pytest.mark.parametrize("argv, interval", [([], 4), (["--cadence", "0"], 1), (["--cadence", "3840"], 2),
                                            (["--stream-interval", "1"], 1)])
def test_stream_interval_follows_the_cadence_unless_given(tmp_path, argv, interval):
    """vLLM's ``stream_interval`` is the cadence in frames by default (outputs when audio is due),
    and what the user passes otherwise."""
    from vllm_omni_kernels.vllm_integration.server import engine_args_from, make_parser

    args = make_parser().parse_args([str(tmp_path), *argv])
    args.model = args.model_tag
    assert engine_args_from(args).stream_interval == interval



@pytest.mark.parametrize("option, value, least", [(o, v, 1) for o in ("--max-inflight", "--max-input-chars",
                                                                       "--audio-memory-mib", "--talker-threads")
                                                for v in ("0", "-1")]
                         + [("--retry-after", "-1", 0), ("--cadence", "-1", 0)])
def test_limits_below_their_least_are_refused(tmp_path, option, value, least, capsys):
    """0 in-flight requests would answer every request 503 (or silently mean --max-num-seqs); a
    negative Retry-After is no HTTP header (0 is one)."""
    from vllm_omni_kernels.vllm_integration.server import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args([str(tmp_path), option, value])
    assert f"not at least {least}" in capsys.readouterr().err
    assert make_parser().parse_args([str(tmp_path), "--retry-after", "0"]).retry_after == 0


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_a_server_drains_its_streams_on_sigterm(tmp_path_factory, api_servers):
    """``--shutdown-timeout 30``: SIGTERM while streams are in flight lets each finish with every
    sample (with two API server processes vLLM's would stop taking outputs at once, their streams
    hanging until the process manager kills them at the timeout), a speech request that comes
    meanwhile gets 503 with Retry-After and a completion 503 (vLLM's order shuts its tokenizer's
    pool first: a 500), the engine core's exit is no failure in the log, and the server exits well
    before the timeout."""
    texts = [f"Stream {i} outlives the signal. " * 40 for i in range(BOUND - 1)]
    with contextlib.contextmanager(running_server)(tmp_path_factory, "--api-server-count", api_servers,
                                                   "--shutdown-timeout", "30") as server:
        url, proc = server["url"], server["proc"]

        async def run() -> tuple[list[bytes], list[httpx.Response], float]:
            started = [asyncio.Event() for _ in texts]

            async def one(i: int) -> bytes:
                body = {"input": texts[i], "voice": "alloy", "response_format": "pcm", "sample_format": "f32",
                        "stream": True}
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                        assert r.status_code == 200, await r.aread()
                        data = b""
                        async for chunk in r.aiter_raw():
                            data += chunk
                            started[i].set()
                        return data

            streams = [asyncio.create_task(one(i)) for i in range(len(texts))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            proc.terminate()
            t0 = time.time()
            await asyncio.sleep(0.3)  # the signal reaches every API server process
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                late = [await client.post("/v1/audio/speech", json={"input": "Too late.", "voice": "alloy",
                                                                    "response_format": "pcm", "stream": True}),
                        await client.post("/v1/completions", json={"model": str(server["model"]),
                                                                   "prompt": [5, 6, 7], "max_tokens": 3})]
            return await asyncio.gather(*streams), late, t0

        got, late, t0 = asyncio.run(run())
        speech_late, completion_late = late
        assert speech_late.status_code == 503 and speech_late.headers.get("retry-after"), speech_late.text
        assert completion_late.status_code == 503, completion_late.text  # (vLLM's answer: no Retry-After)
        assert proc.wait(25) == 0  # a clean stop (an engine that dies is status 1)
        assert time.time() - t0 < 25
        for text, data in zip(texts, got):
            want = expected(server, text)
            assert data == want.astype("<f4").tobytes(), f"{len(data) // 4} of {want.size} samples"
    assert "output_handler failed" not in server["log"].read_text()


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_whole_files_in_flight_when_the_server_stops_are_answered_503(tmp_path_factory, api_servers):
    """SIGTERM without ``--shutdown-timeout`` while whole files are made: each is a request the
    engine let go of before its first audio, a 503 with Retry-After (another server can serve it).
    They were a 500, and with two API server processes no response at all: the process manager
    killed the processes at the timeout, 0 s, before they answered."""
    with contextlib.contextmanager(running_server)(tmp_path_factory, "--api-server-count", api_servers) as server:
        url, proc = server["url"], server["proc"]

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"input": "a" * 2900, "voice": "alloy", "response_format": "pcm", "stream": False}
                files = [asyncio.create_task(client.post("/v1/audio/speech", json=body)) for _ in range(3)]
                t0 = time.time()
                while (await client.get("/v1/audio/speech/stats")).json()["worker"]["requests_held"] < 3:
                    assert time.time() - t0 < 60
                    await asyncio.sleep(0.1)
                proc.terminate()
                return await asyncio.gather(*files)

        answers = asyncio.run(run())
        assert proc.wait(30) == 0
    for r in answers:
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text)


@pytest.mark.parametrize("argv", [["--headless"], ["--api-server-count", "0"], ["--grpc"], ["--skip-tokenizer-init"],
                                  ["--data-parallel-size", "2"], ["--tensor-parallel-size", "2"],
                                  ["--pipeline-parallel-size", "2"]])
def test_what_the_speech_server_cannot_be_is_refused_at_once(tmp_path, argv):
    """vLLM's ``serve`` runs the engine alone for the first two, and a gRPC server for ``--grpc``;
    this server runs its engine with its HTTP API servers, tokenizes the speech route's text, and
    serves one engine core: it says so rather than start anyway (``--grpc`` was ignored, and the
    others failed later: every speech request a 400, or a traceback)."""
    from vllm_omni_kernels.vllm_integration.server import main

    with pytest.raises(SystemExit, match="not supported"):
        main([str(tmp_path), *argv])


@pytest.mark.parametrize("servers", ["1", "2"])
def test_a_port_that_is_taken_stops_the_server_with_one_line_before_any_engine(tmp_path, servers):
    """``serve`` on a port another process listens on: one line naming the address and why, from one
    API server process or several, before an engine core starts (vLLM's ``bind`` traceback before)."""
    from vllm_omni_kernels.vllm_integration.server import main as serve

    model = make_model_dir(tmp_path / "talker")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"^cannot listen on 127\.0\.0\.1:{port}: ") as stop:
            serve([str(model), "--host", "127.0.0.1", "--port", str(port), "--api-server-count", servers])
    assert stop.value.__suppress_context__  # (no traceback of the bind under the line)


def test_parser_plugins_are_imported_as_vllms_server_imports_them(tmp_path, monkeypatch):
    """``--tool-parser-plugin`` (and ``--reasoning-parser-plugin``): the file is imported before the
    engine is built. The run stops at the engine's arguments (this module's names, replaced here)."""
    import signal

    from vllm_omni_kernels.vllm_integration import server

    marker, plugin = tmp_path / "imported", tmp_path / "my_tool_parser.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    args = server.make_parser().parse_args([str(tmp_path), "--tool-parser-plugin", str(plugin)])

    class Stop(Exception):
        pass

    def stop(_args):
        raise Stop

    sock = socket.socket()  # (never bound: the run stops before it serves)
    monkeypatch.setattr(server, "setup_server", lambda *a, **k: ("http://x", sock))
    monkeypatch.setattr(server, "engine_args_from", stop)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(Stop):
            asyncio.run(server.run(args))
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        sock.close()
    assert marker.exists()


def test_what_additional_config_says_of_the_talker_wins_over_talker_engine_args_keywords(tmp_path):
    """As in the server: the keywords' defaults (device, output path) do not overwrite what the
    caller wrote, and vLLM's stream_interval follows the cadence the worker will use."""
    from vllm_omni_kernels.vllm_integration.llm import talker_engine_args

    omni = {"device": "cpu", "output_path": "upstream", "cadence": tk.FRAME_SAMPLES}
    args = talker_engine_args(tmp_path, additional_config={"omni": omni})
    assert args.additional_config["omni"] == omni and args.stream_interval == 1


def test_what_additional_config_says_of_the_talker_wins_over_the_servers_options(tmp_path):
    from vllm_omni_kernels.vllm_integration.server import engine_args_from, make_parser

    args = make_parser().parse_args([str(tmp_path), "--audio-memory-mib", "64", "--cadence", "3840",
                                     "--additional-config", '{"omni": {"pool_budget_bytes": 9437184, "cadence": 0}}'])
    args.model = args.model_tag
    engine_args = engine_args_from(args)
    omni = engine_args.additional_config["omni"]
    assert omni["pool_budget_bytes"] == 9437184 and omni["cadence"] == 0 and args.cadence == 0
    assert engine_args.stream_interval == 1  # the cadence the talker gets: every step


def test_a_stream_that_ends_without_audio_adds_no_time_to_first_audio():
    """A streamed wav whose request ends with no audio still sends its header, but no time to first
    audio: none arrived (it would count from the epoch, and skew the p99)."""
    from vllm_omni_kernels.vllm_integration.speech import FirstAudio, SpeechRequest, _respond

    class Ended:  # what the route reads of a SpeechStream whose request ended with no audio
        request_id, received, first_at, first_metrics, output_tokens, delivered = "r", time.time(), 0.0, None, 0, False

        async def next_audio(self):
            return None, True

        async def close(self):
            pass

    async def body():
        first_audio = FirstAudio(observe=False)
        request = SpeechRequest(input="a", stream=True, response_format="wav")
        response = await _respond(Ended(), request, True, first_audio, SpeechLimits(), 2)
        return b"".join([piece async for piece in response.body_iterator]), first_audio.summary()

    sent, summary = asyncio.run(body())
    assert sent[:4] == b"RIFF" and len(sent) == 44 and summary == {"count": 0}


@pytest.mark.parametrize("chars,speed,frames", [(145, 0.29, 500), (3, 0.3, 10), (7, 1.0, 7), (10, 4.0, 3),
                                                (1, 0.25, 4), (1000, 0.7, 1429)])
def test_speed_gives_the_frames_its_decimal_value_asks_for(chars, speed, frames):
    """Frames at a speed are counted on the speed as written: 145 characters at 0.29 are 500 frames
    exactly (in floats 145 / 0.29 is a little over 500, and its ceiling one frame too many)."""
    from vllm_omni_kernels.vllm_integration.speech import speech_frames

    assert speech_frames(chars, speed) == frames


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory):
    """The server with vLLM's development routes (``VLLM_SERVER_DEV_MODE``), among them ``/pause``
    and ``/resume``, which a weight update drives, and an API key (its own warm-up sends it)."""
    yield from running_server(tmp_path_factory, env={"VLLM_SERVER_DEV_MODE": "1"}, api_key="sekret")


def test_the_engines_own_abort_never_looks_like_a_complete_response(dev_server):
    """vLLM's ``/pause`` in its default mode aborts every request in flight, as its shutdown does.
    A stream that had audio is cut (its chunked response ends without the last chunk) and counts
    as failed; a whole file waiting for its audio, and a request that arrives while the engine is
    paused, get 503 with Retry-After (a retry can be served) and count as turned away. After
    ``/resume`` a request is exact again."""
    server = dev_server
    url, key = f"{server['url']}/v1/audio/speech", server["headers"]
    long_text = "a" * 2500  # 200 s of audio: seconds of engine steps
    body = {"input": long_text, "response_format": "pcm", "sample_format": "f32", "stream": True}
    before = idle(server)
    got = b""
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            with httpx.stream("POST", url, json=body, headers=key, timeout=120) as r:
                assert r.status_code == 200
                chunks = r.iter_raw()
                got += next(chunks)
                assert httpx.post(f"{server['url']}/pause", timeout=60).status_code == 200
                for chunk in chunks:
                    got += chunk
        want = expected(server, long_text).astype("<f4").tobytes()
        assert 0 < len(got) < len(want) and want.startswith(got)

        refused = httpx.post(url, json={**body, "input": "Paused.", "stream": False}, headers=key, timeout=60)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        httpx.post(f"{server['url']}/resume", timeout=60).raise_for_status()

        whole = {}
        asking = threading.Thread(target=lambda: whole.setdefault(
            "r", httpx.post(url, json={**body, "stream": False}, headers=key, timeout=120)))
        asking.start()
        t0 = time.time()
        while not stats(server)["worker"]["requests_held"]:  # it is in the engine, making its audio
            assert time.time() - t0 < 30 and asking.is_alive()
            time.sleep(0.05)
        assert httpx.post(f"{server['url']}/pause", timeout=60).status_code == 200
        asking.join(120)
        assert whole["r"].status_code == 503 and "Retry-After" in whole["r"].headers
    finally:
        httpx.post(f"{server['url']}/resume", timeout=60)
    after = idle(server)
    assert {k: after[k] - before[k] for k in ("served", "failed", "rejected", "cancelled")} == \
        {"served": 0, "failed": 1, "rejected": 2, "cancelled": 0}
    again = httpx.post(url, json={**body, "input": "Resumed.", "stream": False}, headers=key, timeout=60)
    assert again.status_code == 200 and again.content == expected(server, "Resumed.").astype("<f4").tobytes()
    assert httpx.post(url, json={**body, "input": "No key."}, timeout=60).status_code == 401  # vLLM's own check


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_an_engine_core_that_dies_cuts_every_stream_and_the_server_exits(tmp_path_factory, api_servers):
    """The engine core process dies (killed, as the kernel's OOM killer or a device fault would kill
    it) while requests are in flight: every stream that had audio is cut (its chunked response ends
    without the last chunk, so no client takes its audio for complete), a whole file waiting for its
    audio is a 5xx, nothing hangs, and the server exits with status 1 (vLLM's API server stops once
    its engine is dead, with status 0) instead of taking requests it can no longer serve."""
    import psutil

    long_text = "a" * 2500  # 200 s of audio: seconds of engine steps
    with contextlib.contextmanager(running_server)(tmp_path_factory, "--api-server-count", api_servers) as server:
        url, proc = f"{server['url']}/v1/audio/speech", server["proc"]
        body = {"input": long_text, "response_format": "pcm", "sample_format": "f32", "stream": True}
        got: dict[int, bytes] = {}
        ends: dict[int, object] = {}
        started = [threading.Event() for _ in range(2)]
        voices = list(VOICES)[:2]

        def stream(i: int) -> None:
            data = b""
            try:
                with httpx.stream("POST", url, json={**body, "voice": voices[i]}, timeout=120) as r:
                    ends[i] = r.status_code
                    for chunk in r.iter_raw():
                        data += chunk
                        started[i].set()
                ends[i] = "complete"
            except httpx.HTTPError as exc:
                ends[i] = exc
            finally:
                got[i] = data
                started[i].set()

        def whole() -> None:
            try:
                ends["whole"] = httpx.post(url, json={**body, "stream": False}, timeout=120).status_code
            except httpx.HTTPError as exc:
                ends["whole"] = exc

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)] + [threading.Thread(target=whole)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        t0 = time.time()
        while stats(server)["worker"]["requests_held"] < 3:  # the whole file is in the engine too (any process)
            assert time.time() - t0 < 30
            time.sleep(0.05)
        cores = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
        assert len(cores) == 1, cores
        cores[0].kill()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        proc.wait(60)  # the server goes once its engine is dead
        for i in range(2):
            want = expected(server, long_text, voices[i]).astype("<f4").tobytes()
            assert isinstance(ends[i], httpx.RemoteProtocolError), ends[i]  # cut, not complete
            assert 0 < len(got[i]) < len(want) and want.startswith(got[i])
        assert isinstance(ends["whole"], httpx.HTTPError) or ends["whole"] >= 500, ends["whole"]
        assert proc.returncode == 1  # not 0 as vLLM's: a process manager restarts it on failure


def test_the_load_scripts_check_counts_what_is_lost_altered_or_extra_and_every_underrun(tmp_path):
    """``profiling/load_speech.py``'s verdict, which its published figures rest on: a stream with
    nothing after its 200 loses every sample, one cut mid-sample the samples after its last whole
    one (and counts as cut), one sample more is extra, one bit is altered, and only exact streams
    count as exact; a player started at the first byte runs dry at each chunk that
    comes later than the audio before it lasts, the first gap included."""
    ls = profiling_script("load_speech")
    from transformers import AutoTokenizer

    model = make_model_dir(tmp_path / "talker")
    text = "Check the checker."
    want = expected({"tokenizer": AutoTokenizer.from_pretrained(str(model))}, text)
    streams = {name: ls.Stream(text, "alloy") for name in ("exact", "empty", "extra", "altered", "refused", "cut")}
    for name, s in streams.items():
        s.status = 503 if name == "refused" else 200
        got = want.copy()
        if name == "altered":
            got[7] = np.nextafter(got[7], np.float32(2))
        s.data = bytearray(b"" if name == "empty" else got.astype("<f4").tobytes() + (b"\0" * 4 if name == "extra" else b""))
        if name == "cut":  # (its response ended early, in the middle of a sample)
            s.data, s.cut = s.data[:4 * 10 + 2], True
    ls.check(list(streams.values()), model)
    assert ls.checked(list(streams.values())) == {"samples_lost": 2 * want.size - 10, "samples_altered": 1,
                                                 "samples_extra": 1, "streams_cut": 1, "streams_exact": 1}
    chunk = 4 * tk.FRAME_SAMPLES  # 80 ms of float32 audio
    s = streams["exact"]
    s.t_first = 0.0
    s.arrivals = [(0.0, chunk), (0.1, chunk), (0.11, chunk), (0.12, chunk)]  # dry from 80 ms to the second
    assert ls.gaps(s) == (pytest.approx(0.1 / 0.08), 1)
    s.arrivals.append((0.4, chunk))  # and from 320 ms on
    assert ls.gaps(s) == (pytest.approx(0.28 / 0.08), 2)


@pytest.mark.parametrize("after_audio", [False, True])
@pytest.mark.parametrize("why", ["output memory", "shut down", "engine died", "too large"])
def test_a_request_the_engine_lets_go_is_turned_away_only_before_its_first_audio_and_if_it_may_be_retried(
        after_audio, why):
    """The output memory refusing a request (``OutputMemoryError``), or the engine stopped under it
    (``EngineShutDownError``: the server stops), before its first audio turns it away (a 503: a
    retry can be served, and ``Admission`` counts it rejected; a request stopped under it was a
    500); more than the output memory ever holds for one (``OutputTooLargeError``) is refused as a
    bad request (a 400, rejected). After audio went out the stream is cut, and it counts as failed:
    the client got part of its audio, not a refusal. An engine that died fails it either way (a 500)."""
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.exceptions import EngineDeadError

    from vllm_omni_kernels.errors import OutputMemoryError
    from vllm_omni_kernels.payload import MultimodalPayload
    from vllm_omni_kernels.vllm_integration.output_processor import OutputTooLargeFailedError
    from vllm_omni_kernels.vllm_integration.llm import EngineShutDownError
    from vllm_omni_kernels.vllm_integration.outputs import MultimodalCompletionOutput
    from vllm_omni_kernels.vllm_integration.speech import (Admission, SpeechFailedError, SpeechLimits, SpeechStream,
                                                           _failed)

    error = {"output memory": OutputMemoryError("the audio ring's budget is spent", request_id="r", key="audio"),
             "shut down": EngineShutDownError(), "engine died": EngineDeadError(),
             "too large": OutputTooLargeFailedError("more than one request can hold", request_id="r", key="audio")}[why]

    async def engine_outputs():
        if after_audio:
            audio = MultimodalPayload({"audio": torch.ones(tk.FRAME_SAMPLES)}, axes={"audio": -1})
            completion = MultimodalCompletionOutput(0, "", [7], None, None, multimodal_output=audio)
            yield RequestOutput("r", None, [1], None, [completion], finished=False)
        raise error

    class Engine:  # what close() calls on a stream the engine has already let go: nothing
        async def abort(self, request_id):
            raise AssertionError("the engine let the request go; nothing is left to abort")

    async def run():
        admission = Admission(4)
        assert admission.try_acquire()
        stream = SpeechStream(Engine(), admission, "r", engine_outputs(), "f32", time.time())
        got = []
        with pytest.raises(SpeechFailedError, match="request r .*(key 'audio'|engine)") as info:
            while True:
                piece, _ = await stream.next_audio()
                got.append(piece)
        await stream.close()
        return got, stream, admission.counts(), _failed(info.value, stream, SpeechLimits())

    got, stream, counts, answer = asyncio.run(run())
    assert stream.turned_away is (not after_audio and why not in ("engine died", "too large")) and stream.failed
    refused = not after_audio and why == "too large"
    assert stream.outcome == ("rejected" if stream.turned_away or refused else "failed")
    assert counts[stream.outcome] == 1 and len(got) == after_audio
    if not after_audio:  # (after it, the stream is cut: there is no answer to give)
        assert answer.status_code == (503 if stream.turned_away else 400 if refused else 500)


def test_a_warm_up_that_a_middleware_refuses_is_skipped_and_the_server_starts():
    """A server whose own middleware refuses the warm-up's requests (a gateway header it requires,
    as ``vllm serve --middleware`` allows) starts anyway: the warm-up is skipped with a warning."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from vllm_omni_kernels.vllm_integration.speech import Admission, warm_up_route

    app = FastAPI()

    @app.middleware("http")
    async def gate(request, call_next):
        if "x-gateway" not in request.headers:
            return JSONResponse({"error": "forbidden"}, status_code=403)
        return await call_next(request)

    app.state.engine_client = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(voices={"a": 1})))
    app.state.omni_speech_admission = Admission(1)
    asyncio.run(warm_up_route(app))
    assert app.state.omni_speech_admission.counting
