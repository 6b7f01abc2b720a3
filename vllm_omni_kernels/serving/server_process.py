"""The speech server as a child process on the loopback interface: what the tests and
``profiling/load_speech.py`` start (``python -m vllm_omni_kernels serve``) and wait for."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def speech_server(model: str | Path, log: Path, *options: str, cwd: str | Path | None = None,
                  timeout: float = 240.0, env: dict[str, str] | None = None):
    """``python -m vllm_omni_kernels serve MODEL`` on a free port of 127.0.0.1 with ``options``, its
    output in ``log``, in a session of its own; yields its URL and process once it is ready
    (``wait_ready``). vLLM's platform is its CPU one (the talker picks its own device); no
    Prometheus multiprocess directory is inherited; ``env``: variables set for it besides. On exit
    it gets SIGTERM, and its session SIGKILL if it has not exited 60 s later
    (``subprocess.TimeoutExpired`` is raised then)."""
    with socket.socket() as s:  # a port nobody listens on now (another process may take it first)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", **(env or {})}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [sys.executable, "-m", "vllm_omni_kernels", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           *options]
    with Path(log).open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log, timeout)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise


def wait_ready(url: str, proc: subprocess.Popen | None, log: Path | None = None, timeout: float = 240.0) -> None:
    """Poll ``url``/health until it answers 200. Raises ``RuntimeError`` if ``proc`` exits first and
    ``TimeoutError`` after ``timeout`` seconds, each with the end of ``log``."""
    import httpx

    def tail() -> str:
        return Path(log).read_text()[-4000:] if log is not None and Path(log).exists() else ""

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready: {tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"no healthy server at {url} after {timeout} s: {tail()}")
