"""The speech server as a child process on the loopback interface: what the tests and
``profiling/load_speech.py`` start (``python -m vllm_omni_kernels serve``) and wait for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A port nobody listens on now (another process may take it before the server binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | Path, port: int, log: Path, *options: str, cwd: str | Path | None = None) \
        -> subprocess.Popen:
    """``python -m vllm_omni_kernels serve MODEL`` on 127.0.0.1:``port`` with ``options``, its output
    in ``log``, in a session of its own. vLLM's platform is its CPU one (the talker picks its own
    device); no Prometheus multiprocess directory is inherited."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [sys.executable, "-m", "vllm_omni_kernels", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           *options]
    return subprocess.Popen(cmd, stdout=Path(log).open("w"), stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)


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
