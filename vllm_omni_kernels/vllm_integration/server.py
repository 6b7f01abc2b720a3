"""``python -m vllm_omni_kernels serve MODEL_DIR``: vLLM 0.33's OpenAI-compatible API server with
``OmniAsyncLLM`` as its engine (vLLM's launcher hard-codes ``AsyncLLM``) and the speech routes
(``speech.py``) added; everything else is vLLM's: the argument parser (every ``vllm serve``
option), the FastAPI app (``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``), its
handlers and middleware, ``serve_http``. The defaults serve the talker (``TalkerExecutor``,
float32, eager, ``--stream-interval`` at the audio's cadence: ``llm.talker_stream_interval``); this
server's own options are in the "omni-speech" group.

``--api-server-count N`` runs N API server processes on one shared socket in front of one engine
core, as ``vllm serve`` does (``serve_multi``), so a burst of clients is spread over N event loops;
the speech requests in flight are counted across them (one shared counter).
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import socket
import time
from pathlib import Path

import uvloop
import vllm.envs as envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import init_parser_plugin, make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.common.startup import cli_env_setup
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.launcher import serve_http, setup_server
from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
from vllm.logger import configure_logging, configure_logging_from_args, init_logger
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor
from vllm.v1.metrics.prometheus import setup_multiprocess_prometheus
from vllm.v1.utils import APIServerProcessManager, wait_for_completion_or_failure

from ..serving.talker import STREAM_CADENCE
from . import speech
from .llm import (OmniAsyncLLM, omni_vllm_config, talker_processor_options, talker_stream_interval, warm_up,
                  with_talker_options)
from .speech import Admission
from .worker import TalkerExecutor, WorkerOptions

logger = init_logger("vllm.omni_kernels.server")

# A connection's bytes written but not yet sent, at most (TCP_NOTSENT_LOWAT): see ``pace_sends``.
UNSENT_BYTES = 1 << 17
_ANSWER_S = 5.0  # what a stopping multi-process server leaves its API server processes at least


def pace_sends(sock: socket.socket) -> None:
    """Let a connection take more of a response only once its unsent bytes are below
    ``UNSENT_BYTES`` (set on the listening socket, which its connections inherit). Otherwise the
    kernel takes a response's bytes until its send buffer is full (4 MiB by default) and wakes the
    writer only once half of it is acknowledged: a client that reads a stream as fast as it plays
    (96 kB a second of float32) made the server's send wait 20 s at a time, and lost its stream to
    ``--stall-timeout``. Paced, a send waits about as long as the client takes to read a few
    hundred KiB (3 s, at most 6 s, at 96 kB a second on the loopback interface), so the timeout
    measures the client, not the kernel's buffer."""
    option = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if option is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, option, UNSENT_BYTES)
    except OSError as exc:  # (a kernel without it)
        logger.warning("TCP_NOTSENT_LOWAT is not available (%s): --stall-timeout counts the time the "
                       "kernel's send buffer takes to drain, and should be long", exc)


def make_parser() -> FlexibleArgumentParser:
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m vllm_omni_kernels serve",
                                                    description=__doc__.split("\n\n")[0]))
    # max_model_len: an input of --max-input-chars characters (4096, OpenAI's limit), its voice
    # token, and its frames at speed 1 (one per character)
    parser.set_defaults(distributed_executor_backend=TalkerExecutor, dtype="float32", enforce_eager=True,
                        max_model_len=8208, max_num_batched_tokens=8208, stream_interval=None)
    g = parser.add_argument_group("omni-speech", description="The talker, its output memory and the speech "
                                  "route: `serve --help=omni-speech`.")
    g.add_argument("--talker-device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="where the talker and the worker's rings run (auto: GPU if present)")
    g.add_argument("--talker-threads", type=_whole(1), default=None,
                   help="torch threads of a talker on the CPU (unset: half the cores, or OMP_NUM_THREADS)")
    g.add_argument("--cadence", type=_whole(0), default=STREAM_CADENCE,
                   help="audio samples a streaming request receives at a time (its first chunk at once); "
                        "0: every engine step")
    g.add_argument("--output-path", default="worker", choices=("worker", "upstream"),
                   help="worker: this package's accumulation in the engine core; upstream: per-request host "
                        "copies and per-step concatenation (for comparison)")
    g.add_argument("--max-inflight", type=_whole(1), default=None,
                   help="speech requests in flight at most; more are answered 503 (unset: --max-num-seqs)")
    g.add_argument("--audio-memory-mib", type=_whole(1), default=1024,
                   help="the worker's audio ring arena on the talker's device (MiB, preallocated); a whole-file "
                        "request holds all its audio there until it finishes (about 8 MiB for 80 s), and one "
                        "that does not fit is answered 503")
    g.add_argument("--max-input-chars", type=_whole(1), default=4096, help="longest input text, in characters")
    g.add_argument("--retry-after", type=_whole(0), default=1, help="seconds a 503 answer asks the client to wait")
    g.add_argument("--stall-timeout", type=_whole(1), default=60,
                   help="seconds a response waits for its client to take more bytes before it aborts the request "
                        "and closes the connection (a client that stops reading holds a slot till then)")
    return parser


def _whole(least: int):
    """An option's type: a whole number of at least ``least`` (a limit of 0 would serve nothing; a
    negative Retry-After is no HTTP header)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is not at least {least}")
        return value
    return parse


def engine_args_from(args) -> AsyncEngineArgs:
    """vLLM's engine arguments from the parsed options, this server's merged into
    ``additional_config["omni"]`` (what ``TalkerWorker`` reads; a key given there wins)."""
    args.additional_config = with_talker_options(args.additional_config, {  # (vLLM's parser made it a dict)
        "device": args.talker_device, "cadence": args.cadence, "output_path": args.output_path,
        "cpu_threads": args.talker_threads, "pool_budget_bytes": args.audio_memory_mib << 20})
    omni = args.additional_config["omni"]
    args.talker_device, args.cadence, args.output_path = omni["device"], omni["cadence"], omni["output_path"]
    if args.stream_interval is None:  # not given: outputs at the audio's cadence
        args.stream_interval = talker_stream_interval(args.cadence)
    return AsyncEngineArgs.from_cli_args(args)


def listen(args, reuse_port: bool):
    """vLLM's ``setup_server``: the listening socket, before any engine starts. A port that is taken
    (or an address this host lacks) stops the command with one line saying so (vLLM's ``serve``
    prints the traceback of its ``bind``)."""
    try:
        return setup_server(args, reuse_port=reuse_port)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {args.host or '0.0.0.0'}:{args.port}: {exc.strerror or exc}") from None


async def run(args, listen_address: str | None = None, sock=None, client_config: dict | None = None) -> None:
    """Serve in this process: the whole server, or (``client_config``, from ``serve_multi``) one of
    its API server processes on the shared ``sock``."""
    if sock is None:  # (SIGTERM and SIGINT during start-up: cli.exit_on_signals)
        listen_address, sock = listen(args, reuse_port=False)
        pace_sends(sock)
    init_parser_plugin(args)  # as vLLM's server worker: --tool-parser-plugin, --reasoning-parser-plugin
    client = dict(client_config or {})
    count, index = client.pop("client_count", 1), client.pop("client_index", 0)
    loads = client.pop("api_server_loads", None)
    engine_args = engine_args_from(args)
    config = omni_vllm_config(engine_args, UsageContext.OPENAI_API_SERVER,
                              api_process=None if client_config is None else (count, index))
    engine = OmniAsyncLLM(config, Executor.get_class(config), log_stats=not engine_args.disable_log_stats,
                          usage_context=UsageContext.OPENAI_API_SERVER, log_requests=engine_args.enable_log_requests,
                          aggregate_engine_logging=engine_args.aggregate_engine_logging,
                          client_addresses=client or None, client_count=count, client_index=index,
                          processor_options=talker_processor_options(args.output_path))
    try:
        # every process warms its share of a full batch: together they run one
        await warm_up(engine, share=(index, count))
        if index == 0:
            await engine.collective_rpc("reset_output_path_stats")
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        limit = args.max_inflight if args.max_inflight is not None else config.scheduler_config.max_num_seqs
        limits = speech.SpeechLimits(max_inflight=limit, max_input_chars=args.max_input_chars,
                                     retry_after_s=args.retry_after, stall_s=args.stall_timeout,
                                     request_id_headers=args.enable_request_id_headers,
                                     file_frames=(await engine.collective_rpc("whole_file_frames"))[0])
        speech.install(app, engine.model_config, limits, shared_counts=getattr(args, "omni_speech_counts", None),
                       api_server=(index, count))
        await init_app_state(engine, app.state, args, tasks)
        # the key vLLM's authentication takes (its --api-key wins over VLLM_API_KEY), if it asks for one
        await speech.warm_up_route(app, next((key for key in (args.api_key or [envs.VLLM_API_KEY]) if key), None))
        kwargs = {"http": speech.DroppableHTTP}
        if (log_config := get_uvicorn_log_config(args)) is not None:
            kwargs["log_config"] = log_config
        logger.info("speech server on %s: talker on %s, %s output path, at most %d speech requests in flight "
                    "(API server %d of %d)", listen_address, WorkerOptions(args.talker_device).torch_device().type,
                    args.output_path, limit, index + 1, count)
        shutdown = await serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host, port=args.port,
            log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            peer_loads=None if loads is None else (loads, index), **kwargs)
        # vLLM's watchdog stops the server once the engine is dead (not shut down: a SIGTERM's drain
        # shuts it down before the server stops); vLLM then exits with status 0, which a process
        # manager takes for a clean stop (Restart=on-failure would not restart it)
        engine_died = engine.errored and not engine.shutdown_requested
    finally:
        engine.shutdown(timeout=config.shutdown_timeout)
    try:
        await shutdown
    finally:
        sock.close()
    if engine_died:
        raise SystemExit("the engine core died: the server stopped (exit status 1)")


def api_server_process(listen_address: str, sock, args, client_config: dict) -> None:
    """One API server process of ``serve_multi`` (the entry ``APIServerProcessManager`` starts)."""
    if logging_config := getattr(args, "logging_config", None):
        configure_logging(logging_config)
    uvloop.run(run(args, listen_address, sock, client_config))


def serve_multi(args, count: int) -> None:
    """vLLM's multi-API-server launch (``vllm serve --api-server-count``) with this server's API
    server processes: the engine core through vLLM's launcher, ``count`` processes of
    ``api_server_process`` on one shared socket, and one speech-request counter they share."""
    listen_address, sock = listen(args, reuse_port=True)
    pace_sends(sock)
    setup_multiprocess_prometheus()
    stopping = []

    def stop(*_):
        if not stopping:
            stopping.append(True)
            raise SystemExit

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    args.omni_speech_counts = multiprocessing.get_context("spawn").Array("q", 1 + len(Admission.OUTCOMES))
    engine_args = engine_args_from(args)
    config = omni_vllm_config(engine_args, UsageContext.OPENAI_API_SERVER, api_process=(count, -1))
    listeners = bind_engine_zmq_listeners(config, count)
    with launch_core_engines(config, Executor.get_class(config), not engine_args.disable_log_stats,
                             listeners.addresses) as launch:
        coordinator = launch.coordinator
        servers = APIServerProcessManager(
            listen_address=listen_address, sock=sock, args=args, num_servers=count,
            input_listeners=listeners.inputs, output_listeners=listeners.outputs,
            target_server_fn=api_server_process,
            stats_update_address=coordinator.get_stats_publish_address() if coordinator else None,
            tensor_queue=launch.tensor_queue)
        launch.watched_frontend_processes = servers.processes
    try:
        wait_for_completion_or_failure(api_server_manager=servers, engine_manager=launch.engine_manager,
                                       coordinator=coordinator)
    finally:
        deadline = time.monotonic() + config.shutdown_timeout if stopping else None
        left = (lambda: None) if deadline is None else (lambda: max(deadline - time.monotonic(), 0.0))
        # the API server processes answer what they still hold (a 503 before a request's first
        # audio) before they are killed: at least _ANSWER_S, as one API server process does
        servers.shutdown(timeout=None if deadline is None else max(left(), _ANSWER_S))
        if launch.engine_manager:
            launch.engine_manager.shutdown(timeout=left())
        if coordinator:
            coordinator.shutdown(timeout=left())


def main(argv: list[str]) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "headless", False) or (args.api_server_count is not None and args.api_server_count < 1):
        raise SystemExit("the speech server runs its engine with its API servers: --headless and an "
                         "--api-server-count below 1 (an engine alone) are not supported")
    if getattr(args, "grpc", False):
        raise SystemExit("the speech server serves HTTP (vLLM's OpenAI-compatible server); --grpc is not supported")
    if getattr(args, "skip_tokenizer_init", False):
        raise SystemExit("the speech route tokenizes its input text: --skip-tokenizer-init is not supported")
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        raise SystemExit("the speech server serves one engine core: --data-parallel-size above 1 is not supported")
    if max(args.tensor_parallel_size or 1, args.pipeline_parallel_size or 1) > 1:
        raise SystemExit("the talker runs on one device: --tensor-parallel-size and --pipeline-parallel-size above 1 "
                         "are not supported")
    if args.model_tag is not None:  # what `vllm serve MODEL` does
        args.model = args.model_tag
    elif args.model == parser.get_default("model"):  # (vLLM's default model is no talker; no hub is reached)
        raise SystemExit("give the talker's model directory: serve MODEL_DIR (make one with "
                         "`python -m vllm_omni_kernels make-model MODEL_DIR`)")
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model}: no config.json there; a talker's model directory is made with "
                         f"`python -m vllm_omni_kernels make-model {args.model}`")
    cli_env_setup()
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    count = args.api_server_count or 1
    if count > 1:
        serve_multi(args, count)
    else:
        uvloop.run(run(args))
