"""AsyncEngine: the LLMEngine on a background thread, one async stream per request.

Only the background thread touches the LLMEngine: the event loop sends it commands (add, abort)
through a queue and receives outputs through `call_soon_threadsafe`. A request that fails inside a
step ends alone (finish_reason "error"); when the engine itself cannot go on (`step` raised
EngineFatalError, or anything raised outside a request's step) the engine dies loudly: every
stream gets EngineDeadError, `is_dead` turns True (/health 503) and `on_fatal(reason)` is called.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from tandem.config import EngineConfig
from tandem.core import ParamError, Request, RequestOutput, SamplingParams
from tandem.engine.engine import EngineFatalError, LLMEngine

logger = logging.getLogger("tandem")


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queued-requests."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step raised, or the server is shutting down)."""


@dataclass(frozen=True)
class _Add:
    request: Request  # validated by the caller's thread (LLMEngine.new_request)


@dataclass(frozen=True)
class _Abort:
    request_id: str


def log_fatal(reason: str) -> None:
    """The default `on_fatal`: only log (the process keeps running, answering 503)."""
    logger.critical("The engine is dead and will not recover: %s", reason)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_fatal: Callable[[str], None] = log_fatal) -> None:
        """`on_fatal(reason)` is called once, on the engine thread, after the engine died and every
        stream was sent EngineDeadError (those errors are still on their way through the event
        loop: a callback that stops the process should let the loop run a moment, not
        os._exit at once). It may be replaced as an attribute before `start`."""
        self.engine = engine
        self.on_fatal = on_fatal
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = engine.model_name
        self.metrics_registry = engine.metrics.registry
        self.max_queued = engine.config.scheduler.max_queued_requests
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._num_waiting = 0  # queued in the engine plus adds not yet delivered to it
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._accepting = True
        self._stop = False

    @classmethod
    def from_config(cls, config: EngineConfig, on_fatal: Callable[[str], None] = log_fatal) -> AsyncEngine:
        return cls(LLMEngine(config), on_fatal)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="tandem-engine", daemon=True)
            self._thread.start()

    @property
    def is_dead(self) -> bool:
        return self._error is not None or (self._thread is not None and not self._thread.is_alive())

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting; let running requests finish for up to `timeout` s; abort the rest."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and not self.is_dead:
            await asyncio.sleep(0.05)
        if self._streams:
            logger.info("Shutdown: aborting %d unfinished requests", len(self._streams))
        for rid in list(self._streams):
            self.abort(rid)
        # Give the streams a moment to receive their final "abort" outputs and close.
        deadline = time.monotonic() + 2.0
        while self._streams and time.monotonic() < deadline and not self.is_dead:
            await asyncio.sleep(0.02)
        self._stop = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    # -- requests -----------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError(f"the engine is not running: {self._error!r}")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down")
        # Validated here, once: new_request reads only immutable limits, so it is thread-safe.
        request = self.engine.new_request(request_id, prompt_token_ids, params)
        if request_id in self._streams:
            raise ParamError(f"request id {request_id} is already in use", "request_id")
        with self._lock:
            if self._num_waiting >= self.max_queued:
                raise QueueFullError(f"the waiting queue is full ({self.max_queued} requests); retry later")
            self._num_waiting += 1
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self._commands.put(_Add(request))
        finished = False
        try:
            if self.is_dead:  # died after the check above, maybe before it saw this stream
                raise EngineDeadError(f"the engine is not running: {self._error!r}")
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # consumer went away (disconnect, cancel): free the request's blocks
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def check_grammar(self, grammar: str) -> str | None:
        """None when a structured-output grammar compiles for this model, else the error. Any thread."""
        return self.engine.structured.check(grammar)

    # -- background thread ----------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
                try:
                    self.engine.add(cmd.request)
                except ValueError as e:  # ParamError included: refuse this request only
                    self._deliver(cmd.request.request_id, e)
            elif isinstance(cmd, _Abort):
                out = self.engine.abort(cmd.request_id)
                if out is not None:  # a consumer still listening (shutdown) sees its stream end
                    self._deliver(cmd.request_id, out)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self._refresh_waiting()

    def _refresh_waiting(self) -> None:
        pending = sum(isinstance(c, _Add) for c in list(self._commands.queue))
        with self._lock:
            self._num_waiting = len(self.engine.scheduler.waiting) + pending

    def _loop(self) -> None:
        interval = self.engine.config.log_stats_interval
        last_log = time.monotonic()
        try:
            while not self._stop:
                self._drain_commands(block=not self.engine.has_unfinished)
                if not self.engine.has_unfinished:
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                self._refresh_waiting()
                if time.monotonic() - last_log >= interval:
                    logger.info(self.engine.stats_line())
                    last_log = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """Mark the engine dead, fail every stream, tell `on_fatal`."""
        reason = str(error) if isinstance(error, EngineFatalError) else f"the engine loop raised {error!r}"
        logger.critical("Engine loop died (%s); failing all %d requests", reason, len(self._streams), exc_info=error)
        self._error = error  # is_dead from here on: generate refuses new requests
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"the engine died: {reason}"))
        try:
            self.on_fatal(reason)
        except Exception:  # noqa: BLE001 - the callback's failure must not hide the death
            logger.exception("on_fatal(%r) raised", reason)
