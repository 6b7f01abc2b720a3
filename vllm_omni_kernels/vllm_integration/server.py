"""``python -m vllm_omni_kernels serve MODEL_DIR``: vLLM 0.33's OpenAI-compatible API server with
``OmniAsyncLLM`` as its engine and the speech routes (``speech.py``) added.

It is vLLM's ``build_and_serve`` with two differences: it builds ``OmniAsyncLLM`` (vLLM's launcher
hard-codes ``AsyncLLM``) and includes the speech router. Everything else is vLLM's: its argument
parser (every engine and frontend option of ``vllm serve``), its FastAPI app with
``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics``, its exception handlers and
middleware, ``serve_http`` with its signal handling and engine watchdog. The defaults serve the
talker (``TalkerExecutor``, float32, eager, ``--stream-interval`` at the audio's cadence in frames:
``llm.talker_stream_interval``); this server's own options are in the "Omni speech" group.
"""

from __future__ import annotations

import json
import signal

import uvloop
import vllm.envs as envs
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.common.startup import cli_env_setup
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.launcher import serve_http, setup_server
from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
from vllm.logger import configure_logging_from_args, init_logger
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.executor import Executor

from . import speech
from .llm import OmniAsyncLLM, omni_vllm_config, talker_processor_options, talker_stream_interval, warm_up
from .worker import TalkerExecutor

logger = init_logger("vllm.omni_kernels.server")


def make_parser() -> FlexibleArgumentParser:
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m vllm_omni_kernels serve",
                                                    description=__doc__.split("\n\n")[0]))
    parser.set_defaults(distributed_executor_backend=TalkerExecutor, dtype="float32", enforce_eager=True,
                        max_model_len=8192, max_num_batched_tokens=8192, stream_interval=None)
    g = parser.add_argument_group("Omni speech")
    g.add_argument("--talker-device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="where the talker and the worker's rings run (auto: GPU if present)")
    g.add_argument("--cadence", type=int, default=4 * 1920,
                   help="audio samples a streaming request receives at a time (its first chunk at once); "
                        "0: every engine step")
    g.add_argument("--output-path", default="worker", choices=("worker", "upstream"),
                   help="worker: this package's accumulation in the engine core; upstream: per-request host "
                        "copies and per-step concatenation (for comparison)")
    g.add_argument("--max-inflight", type=int, default=None,
                   help="speech requests in flight at most; more are answered 503 (default: --max-num-seqs)")
    g.add_argument("--max-input-chars", type=int, default=4096)
    g.add_argument("--retry-after", type=int, default=1, help="seconds a 503 answer asks the client to wait")
    return parser


def engine_args_from(args) -> AsyncEngineArgs:
    """vLLM's engine arguments from the parsed options, this server's merged into
    ``additional_config["omni"]`` (what ``TalkerWorker`` reads)."""
    extra = args.additional_config or {}
    if isinstance(extra, str):
        extra = json.loads(extra)
    extra = dict(extra)
    extra["omni"] = {**extra.get("omni", {}), "device": args.talker_device, "cadence": args.cadence,
                     "output_path": args.output_path}
    args.additional_config = extra
    if args.stream_interval is None:  # not given: outputs at the audio's cadence
        args.stream_interval = talker_stream_interval(args.cadence)
    return AsyncEngineArgs.from_cli_args(args)


async def run(args) -> None:
    def interrupt(*_):  # as vLLM's run_server: SIGTERM during start-up stops it
        raise KeyboardInterrupt("terminated")

    signal.signal(signal.SIGTERM, interrupt)
    listen_address, sock = setup_server(args, reuse_port=False)
    engine_args = engine_args_from(args)
    config = omni_vllm_config(engine_args, UsageContext.OPENAI_API_SERVER)
    engine = OmniAsyncLLM(config, Executor.get_class(config), log_stats=not engine_args.disable_log_stats,
                          usage_context=UsageContext.OPENAI_API_SERVER, log_requests=engine_args.enable_log_requests,
                          aggregate_engine_logging=engine_args.aggregate_engine_logging,
                          processor_options=talker_processor_options(args.output_path))
    try:
        await warm_up(engine)
        await engine.collective_rpc("reset_output_path_stats")
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        limit = args.max_inflight or config.scheduler_config.max_num_seqs
        speech.install(app, speech.SpeechLimits(max_inflight=limit, max_input_chars=args.max_input_chars,
                                                retry_after_s=args.retry_after))
        await init_app_state(engine, app.state, args, tasks)
        kwargs = {}
        if (log_config := get_uvicorn_log_config(args)) is not None:
            kwargs["log_config"] = log_config
        logger.info("speech server on %s: talker on %s, %s output path, at most %d speech requests in flight",
                    listen_address, args.talker_device, args.output_path, limit)
        shutdown = await serve_http(
            app, sock=sock, enable_ssl_refresh=args.enable_ssl_refresh, host=args.host, port=args.port,
            log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count, **kwargs)
    finally:
        engine.shutdown(timeout=config.shutdown_timeout)
    try:
        await shutdown
    finally:
        sock.close()


def main(argv: list[str]) -> None:
    cli_env_setup()
    args = make_parser().parse_args(argv)
    if args.model_tag is not None:  # what `vllm serve MODEL` does
        args.model = args.model_tag
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run(args))
