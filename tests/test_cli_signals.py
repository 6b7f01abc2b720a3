"""The command line under SIGTERM and SIGINT, as a process manager or an operator sends them: the
program exits with 128 + the signal, without a traceback, and leaves no process of its session
behind (the engine core's included)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_omni_kernels.vllm_integration.talker_model import make_model_dir


def _start(args, log, tmp_path):
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return subprocess.Popen([sys.executable, "-m", "vllm_omni_kernels", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=tmp_path, start_new_session=True)


def _engine_core_started(proc) -> bool:
    return subprocess.run(["pgrep", "-s", str(proc.pid), "-f", "EngineCore|spawn_main"],
                          capture_output=True).returncode == 0


def _wait(proc, log_path, until, deadline: float) -> None:
    """Until ``until()`` holds, the process running and the ``deadline`` (``time.time()``) not passed."""
    while not until():
        assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.1)


def _ends_alone(proc, sig, log_path, within=60.0) -> int:
    """Send ``sig``; the exit status, once the process and every other of its session are gone."""
    proc.send_signal(sig)
    try:
        rc = proc.wait(within)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running {within} s after {sig.name}: {log_path.read_text()[-3000:]}")
    deadline = time.time() + 20
    while time.time() < deadline:  # (the engine core is stopped on the way out; a tracker may take a moment)
        left = subprocess.run(["pgrep", "-s", str(proc.pid), "-a"], capture_output=True, text=True).stdout.strip()
        if not left:
            return rc
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"left behind after {sig.name}: {left}")


def test_sigterm_while_the_server_starts_its_engine_stops_it(tmp_path):
    """SIGTERM once the engine core's process exists, before the server serves: it stops within
    seconds, with status 143. (It raised KeyboardInterrupt, which vLLM swallows while it starts an
    engine core: the start then waited for an engine that never answered, 10 minutes, or the
    signal was lost and the server came up.)"""
    model = make_model_dir(tmp_path / "model")
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = _start(["serve", str(model), "--host", "127.0.0.1", "--port", "0"], log, tmp_path)
    _wait(proc, log_path, lambda: _engine_core_started(proc), time.time() + 120)
    time.sleep(1.0)
    assert _ends_alone(proc, signal.SIGTERM, log_path) == 128 + signal.SIGTERM
    assert "Traceback" not in log_path.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_to_the_main_job_stops_its_engine_core_too(tmp_path, sig):
    """``simulate`` told to stop while it serves: status 128 + the signal, no traceback, and its
    engine core stops with it (after SIGTERM it stayed, orphaned, holding about 1 GB)."""
    log_path = tmp_path / "simulate.log"
    with log_path.open("w") as log:
        proc = _start(["simulate", "--requests", "400", "--concurrency", "8", "--no-wavs", "--no-progress",
                       "--out", str(tmp_path / "out")], log, tmp_path)
    deadline = time.time() + 120
    _wait(proc, log_path, lambda: _engine_core_started(proc), deadline)
    _wait(proc, log_path, lambda: "init engine" in log_path.read_text(), deadline)  # (the requests go next)
    time.sleep(2.0)
    assert proc.poll() is None, log_path.read_text()[-3000:]
    assert _ends_alone(proc, sig, log_path) == 128 + sig
    assert "Traceback" not in log_path.read_text()


def test_tasks_a_signal_ends_are_not_reported_as_tasks_whose_exception_no_one_read(tmp_path):
    """A signal that lands in an event loop's task that no one awaits (vLLM's output task is one):
    the task ends with the SystemExit, and when it goes asyncio logs nothing about it (it printed
    "Task exception was never retrieved" and a traceback; ``simulate`` did so now and then after
    SIGINT or SIGTERM). Another task's unread exception is still reported."""
    script = tmp_path / "interrupted.py"
    script.write_text("""
import asyncio, gc, os, signal, sys, time
from vllm_omni_kernels.cli import exit_on_signals

exit_on_signals()
tasks = []

async def busy():  # Python work in a task no one awaits: the signal lands here
    os.kill(os.getpid(), signal.SIGINT)  # (its handler runs at the next bytecode: this task's loop)
    while True:
        t0 = time.time()
        while time.time() - t0 < 0.01:
            sum(range(1000))
        await asyncio.sleep(0)

async def fails():
    raise ValueError("an exception of its own")

async def main():
    tasks.append(asyncio.create_task(fails()))
    await asyncio.sleep(0.05)  # (it has failed)
    tasks.insert(0, asyncio.create_task(busy()))
    while True:
        await asyncio.sleep(0.05)

try:
    asyncio.run(main())
except SystemExit as exc:
    code = exc.code
print(tasks[0], flush=True)
tasks.clear()
gc.collect()  # (the tasks go, and report what no one read)
sys.exit(code)
""")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 128 + signal.SIGINT, run.stderr
    assert "exception=SystemExit(130)" in run.stdout, run.stdout + run.stderr
    assert "SystemExit" not in run.stderr and run.stderr.count("never retrieved") == 1, run.stderr
    assert "ValueError: an exception of its own" in run.stderr
