"""The `tandem` command. `tandem serve [MODEL_DIR]` runs the OpenAI-compatible server.

Flag names follow vLLM's. The port is bound before the model loads, so /health answers 503 during
the load and 200 once the engine runs. SIGINT/SIGTERM stop accepting connections, let running
requests finish for up to --shutdown-timeout seconds, abort the rest and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from tandem.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
    ServerConfig,
    SpecConfig,
    parse_size,
    resolve_device,
    resolve_dtype,
)
from tandem.core import SEED_END, SEED_MIN

logger = logging.getLogger("tandem")

BUILTIN_REASONING_PARSER = "qwen3"


class _Parser(argparse.ArgumentParser):
    """Bad flags print one line (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _bool_flag(parser: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    from tandem.server.reasoning import reasoning_parser_names

    parser = _Parser(prog="tandem", description="Serve Mixture-of-Experts LLMs behind an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None,
                   help="HF-format model directory, or a shipped model by name: tandem-demo (the default: the trained "
                        "demo model) or tandem-builtin (tiny, random weights)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="model name clients send (default: from the model)")
    s.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    s.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    s.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    s.add_argument("--max-queued-requests", type=int, default=SchedulerConfig.max_queued_requests,
                   help="waiting requests beyond this get HTTP 503 with Retry-After")
    s.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    s.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (overrides --gpu-memory-utilization)")
    _bool_flag(s, "--enable-prefix-caching", CacheConfig.enable_prefix_caching, "reuse the KV cache of shared prompt prefixes")
    s.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    s.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (every step runs eagerly; for debugging)")
    s.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True,
                   help="fused Triton kernels for RMSNorm, rotary, SiLU*up, routing and small-batch MoE on CUDA "
                        "(default on: 2.5x batch-1 decode on an H200); --no-fused-ops runs the torch reference")
    s.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="auto: Triton paged attention on CUDA, the torch reference elsewhere")
    s.add_argument("--moe-backend", default="auto", choices=("auto", "torch", "grouped"),
                   help="auto: grouped-GEMM experts on CUDA in bf16/fp16, the torch reference elsewhere")
    s.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $TANDEM_API_KEY)")
    s.add_argument("--reasoning-parser", default=None, choices=[*reasoning_parser_names(), "none"],
                   help="split reasoning from content (default: qwen3 for the built-in model, else none)")
    s.add_argument("--chat-template", default=None, help="path to a jinja chat template, or the template itself")
    s.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help='defaults for chat_template_kwargs, e.g. \'{"enable_thinking": false}\'')
    s.add_argument("--shutdown-timeout", type=float, default=ServerConfig.shutdown_timeout,
                   help="seconds running requests may finish after SIGINT/SIGTERM")
    s.add_argument("--max-n", type=int, default=ServerConfig.max_n,
                   help=f"most choices (`n`) one request may ask for (default {ServerConfig.max_n})")
    s.add_argument("--max-prompts-per-request", type=int, default=ServerConfig.max_prompts,
                   help=f"most prompts in one /v1/completions request (default {ServerConfig.max_prompts})")
    s.add_argument("--chat-template-timeout", type=float, default=ServerConfig.render_timeout, metavar="SECONDS",
                   help="a chat template render that runs longer is stopped and the request gets HTTP 400 "
                        f"(default {ServerConfig.render_timeout:g})")
    s.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="torch threads for CPU work (default: the cores this process may use, less one for the "
                        "server thread)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 3}\'; plus "adaptive": "phase" with "phase_k": {"reasoning": 1, '
                        '"content": 2} for a draft depth per request phase (default: off)')
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p = sub.add_parser("plan", help="print where weights and KV cache go, and whether it fits, without loading")
    p.add_argument("model", nargs="?", default=None,
                   help="HF-format model directory, tandem-demo (default) or tandem-builtin")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--gpu-memory", default=None, help="plan for a GPU of this size, e.g. 24GiB (default: this GPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=CacheConfig.gpu_memory_utilization)
    p.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    # Listed for --help only: `run` hands `tandem bench ...` to tandem.bench.cli before this parser
    # sees it, so serving never imports the client-side bench code (httpx and the tools).
    sub.add_parser("bench", add_help=False, help="benchmark and quality tools for any OpenAI-compatible server "
                                                 "(`tandem bench --help` lists them)")
    return parser


def plan(args: argparse.Namespace) -> int:
    """`tandem plan`: exit 0 when the plan fits, 1 when it does not (the reasons are printed)."""
    from tandem.offload.planner import plan_memory

    # --gpu-memory plans for a GPU that need not be here, so it implies CUDA.
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and args.gpu_memory) else resolve_device(args.device)
    shipped, model_dir = shipped_model(args.model)
    if shipped == "builtin":
        from tandem.builtin import ensure_builtin_model

        model_dir = str(ensure_builtin_model())
    from tandem.models.loader import CheckpointError

    try:
        result = plan_memory(
            model_dir, resolve_dtype(args.dtype, device), device,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
            device_bytes=parse_size(args.gpu_memory) if args.gpu_memory else None,
        )
    except CheckpointError as e:
        sys.stderr.write(f"tandem: error: {e}\n")
        return 1
    print(result.render())
    return 0 if result.fits else 1


def _json_object(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def build_configs(args: argparse.Namespace, model_dir: str) -> tuple[EngineConfig, ServerConfig]:
    """Flags -> frozen configs; raises ValueError with a message that names the flag."""
    device = resolve_device(args.device)
    if args.max_model_len is not None and args.max_model_len <= 0:
        raise ValueError("--max-model-len must be positive")
    if not 0 < args.port < 65536 and args.port != 0:
        raise ValueError("--port must be in 0..65535")
    if args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be non-negative")
    if args.max_n < 1 or args.max_prompts_per_request < 1:
        raise ValueError("--max-n and --max-prompts-per-request must be at least 1")
    if not SEED_MIN <= args.seed < SEED_END:
        raise ValueError(f"--seed must be in [-2^63, 2^64), got {args.seed}")
    if not args.chat_template_timeout > 0:
        raise ValueError("--chat-template-timeout must be positive")
    model = ModelConfig(
        model=model_dir,
        dtype=resolve_dtype(args.dtype, device),
        device=device,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        chat_template=args.chat_template,
        seed=args.seed,
    )
    cache = CacheConfig(
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_queued_requests=args.max_queued_requests,
    )
    parser = None if args.reasoning_parser == "none" else args.reasoning_parser
    server = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        reasoning_parser=parser,
        default_chat_template_kwargs=_json_object(args.default_chat_template_kwargs, "--default-chat-template-kwargs"),
        shutdown_timeout=args.shutdown_timeout,
        max_n=args.max_n,
        max_prompts=args.max_prompts_per_request,
        render_timeout=args.chat_template_timeout,
    )
    runner = RunnerConfig(args.attention_backend, args.moe_backend, args.enforce_eager, args.fused_ops,
                          args.cpu_threads)
    spec = SpecConfig.parse(args.speculative_config)
    return EngineConfig(model=model, cache=cache, scheduler=scheduler, spec=spec, runner=runner), server


# ---- serving ------------------------------------------------------------------------------------


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a handled SIGINT/SIGTERM ends in a clean exit (status 0) instead of
        being re-raised once shutdown is done."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}; is another server running there?") from e
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, cfg: ServerConfig, log_level: str):
    import uvicorn

    from tandem.server.h11_protocol import TandemH11Protocol

    return uvicorn.Config(
        app,
        http=TandemH11Protocol,  # h11, answering what it cannot parse in OpenAI's error JSON (431, 400)
        h11_max_incomplete_event_size=cfg.max_header_bytes,
        # A backstop: the engine ends unfinished requests after shutdown_timeout itself.
        timeout_graceful_shutdown=cfg.shutdown_timeout + 5.0,
        log_level=log_level,
        lifespan="off",
    )


def _load_engine_in_thread(engine_cfg: EngineConfig, builtin: bool) -> asyncio.Future:
    """Load in a daemon thread (a signal during the load must not wait for it to finish)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def load() -> None:
        try:
            from tandem.engine.async_engine import AsyncEngine

            cfg = engine_cfg
            if builtin:
                from tandem.builtin import ensure_builtin_model

                cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model=str(ensure_builtin_model())))
            engine = AsyncEngine.from_config(cfg)
        except BaseException as e:  # noqa: BLE001 - reported by the serving coroutine
            # Bind now: Python unbinds `e` when the except block ends, before the callback runs.
            loop.call_soon_threadsafe(lambda err=e: fut.done() or fut.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(engine))

    threading.Thread(target=load, name="tandem-load", daemon=True).start()
    return fut


async def _serve(engine_cfg: EngineConfig, server_cfg: ServerConfig, builtin: bool, log_level: str) -> int:
    from tandem.server.app import attach_engine, create_app, mark_load_failed

    app = create_app(None, server_cfg)
    sock = bind_socket(server_cfg.host, server_cfg.port)
    server = _uvicorn_server_class()(uvicorn_config(app, server_cfg, log_level))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    loading = _load_engine_in_thread(engine_cfg, builtin)
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    engine, status = None, 0
    fatal: list[str] = []
    loop = asyncio.get_running_loop()

    def on_fatal(reason: str) -> None:  # the engine thread: it cannot go on, so the process ends
        fatal.append(reason)
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    try:
        if loading.done() and not serving.done():
            try:
                engine = loading.result()
                engine.on_fatal = on_fatal
                engine.start()
                attach_engine(app, engine, engine_cfg.model.chat_template)
                logger.info("Ready: serving %s on http://%s:%d", engine.model_name, server_cfg.host,
                            sock.getsockname()[1])
            except Exception as e:  # noqa: BLE001 - any load failure (incl. ChatTemplateError) ends the server
                logger.error("Could not start the engine: %s", e)
                mark_load_failed(app, str(e))
                server.should_exit = True
                status = 1
            if engine is not None:
                await _until_exit_requested(server, serving)
                # uvicorn has stopped accepting; running requests get --shutdown-timeout to finish, then
                # the engine aborts them (their streams end) while uvicorn waits for the connections.
                await engine.shutdown(server_cfg.shutdown_timeout)
            await serving
        elif not loading.done():
            loading.cancel()
    finally:
        app.state.tandem.close()
    if fatal:
        logger.error("The engine cannot go on (%s); exiting with status 1 so that a supervisor restarts Tandem",
                     fatal[0])
        status = 1
    return status


async def _until_exit_requested(server: Any, serving: asyncio.Task) -> None:
    while not server.should_exit and not serving.done():
        await asyncio.sleep(0.1)


def shipped_model(model: str | None) -> tuple[str | None, str | None]:
    """Resolve the MODEL argument: ("demo", its directory), ("builtin", None: generated when the
    engine loads) or (None, the directory given). A directory of the same name wins over a name."""
    from tandem.builtin import BUILTIN_NAME, DEMO_NAME, demo_model_dir

    name = model or DEMO_NAME
    if name in (BUILTIN_NAME, DEMO_NAME) and not Path(name).is_dir():
        if name == BUILTIN_NAME:
            return "builtin", None
        try:
            return "demo", str(demo_model_dir())
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    if not Path(name).is_dir():
        raise ValueError(f"model directory {name!r} does not exist (shipped models: {DEMO_NAME}, {BUILTIN_NAME})")
    return None, name


def serve(args: argparse.Namespace) -> int:
    from tandem.builtin import BUILTIN_NAME, DEMO_NAME

    shipped, model_dir = shipped_model(args.model)
    builtin = shipped == "builtin"
    if shipped is not None:  # the shipped models are Qwen3-style reasoning models
        args.served_model_name = args.served_model_name or (BUILTIN_NAME if builtin else DEMO_NAME)
        args.reasoning_parser = args.reasoning_parser or BUILTIN_REASONING_PARSER
    args.model = model_dir
    if args.chat_template:  # a missing file or a syntax error is a flag error: report it before loading
        from tandem.server.chat_template import ChatTemplate, resolve_template_source

        ChatTemplate(resolve_template_source(args.chat_template, None))
    engine_cfg, server_cfg = build_configs(args, args.model or "<built-in>")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    return asyncio.run(_serve(engine_cfg, server_cfg, builtin, args.log_level))


def run(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from tandem.bench.cli import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return serve(args)
        if args.command == "plan":
            return plan(args)
    except ValueError as e:
        parser.error(str(e))
    except OSError as e:
        sys.stderr.write(f"tandem: error: {e}\n")
        return 1
    return 2


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
