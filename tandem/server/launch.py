"""`tandem serve`'s server process: the port bound before the model loads (so /health answers 503
during the load and 200 once the engine runs), uvicorn on Tandem's h11 protocol, the engine loaded
in a thread, and the shutdown: SIGINT/SIGTERM stop accepting connections, let running requests
finish for up to --shutdown-timeout seconds, abort the rest and exit 0. The flags and configs are
tandem/cli.py's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from tandem.config import EngineConfig, ServerConfig

logger = logging.getLogger("tandem")


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


async def serve_until_exit(engine_cfg: EngineConfig, server_cfg: ServerConfig, builtin: bool, log_level: str) -> int:
    """Bind the port, serve /health (503) while the engine loads in a thread, then the API until
    SIGINT/SIGTERM or a fatal engine error; returns the exit status (0, or 1 when the load or
    the engine failed)."""
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
                names = ", ".join(server_cfg.served_model_names) or engine.model_name
                logger.info("Ready: serving %s on http://%s:%d", names, server_cfg.host, sock.getsockname()[1])
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
