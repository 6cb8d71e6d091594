"""Chat-template rendering, tokenization and detokenization in worker processes, off the event loop.

The event loop only does I/O. A 16 MB prompt takes seconds to tokenize (5-45 s on two cores) and a
checkpoint's template can loop for as long as it likes, so both run in a small pool of processes:

- the event loop (parent) pickles a request, writes it to an idle worker's socket and reads the
  reply, all through non-blocking `loop.sock_*` calls, and keeps the timers;
- a worker process (`text_worker.py`, started with `python -c`, never forked: the parent has torch and OpenMP
  threads; it imports no torch) loads the tokenizer and compiles the template once, then
  normalizes messages, renders, tokenizes and decodes, one request at a time.

Processes, not threads: a thread stuck in a template cannot be stopped, and asyncio's default
executor joins its threads at exit, which is how a looping template made SIGTERM hang. A worker
that runs past its time limit, crashes, or whose request is cancelled is killed (SIGKILL) and
replaced at once; the replacement starts in the background and the loop never waits for it.
Workers never outlive the server: they die with it (PR_SET_PDEATHSIG on Linux, EOF on their
socket otherwise), ignore Ctrl-C (the server closes them) and are the OOM killer's first choice.

Given the model's `max_model_len`, a worker refuses (before tokenizing it; `context_guard.py`) any
text so long that no tokenization of it fits: a 16 MB body then costs milliseconds, not seconds and
gigabytes.

Errors: `ValueError`s are the client's (HTTP 400): `ChatRenderError` (with `RenderTimeout`) from
`render_chat`, `TokenizeError` from `encode` and `decode`. `TextWorkerError` is the server's (500):
a worker died or could not start, or the pool is closed; its message never holds a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tandem.server.chat_template import ChatRenderError, ChatTemplate
from tandem.server.text_worker import HEADER, LARGE, PICKLE

logger = logging.getLogger("tandem.server")

_START_TIMEOUT = 60.0  # seconds for a worker to import, load the tokenizer and compile the template


class TextWorkerError(RuntimeError):
    """A text worker failed (died, could not start) or the pool is closed: the server's fault, HTTP 500."""


class RenderTimeout(ChatRenderError):
    """The chat template ran past `render_timeout` on this request (HTTP 400); its worker was replaced."""


class TokenizeError(ValueError):
    """This text or these token ids cannot be tokenized or decoded (HTTP 400)."""


class TextWorkers:
    """A pool of worker processes that render chat templates, tokenize and decode.

    Concurrent calls use different workers and wait when all are busy; jobs over 1 MiB (pickled)
    may hold at most `num_workers - 1` workers, so one stays free for ordinary requests.
    The processes start at construction, so build the pool on the event loop's thread: on Linux a
    worker dies with the thread that started it. The pool is meant for one event loop.
    """

    def __init__(
        self,
        model_dir: str | Path,
        template_source: str | None,
        bos_token: str | None,
        eos_token: str | None,
        default_kwargs: dict[str, Any] | None = None,
        num_workers: int = 2,
        render_timeout: float = 10.0,
        tokenize_timeout: float = 60.0,
        max_model_len: int | None = None,
    ) -> None:
        """`template_source` None: the model has no chat template and `render_chat` says so.
        `render_timeout` limits rendering one chat (seconds); `tokenize_timeout` limits tokenizing
        or decoding one request, a backstop (16 MB of text takes 5-45 s). `max_model_len` (tokens):
        refuse, untokenized, a text too long for any tokenization of it to fit; None: no such check.
        Raises ChatTemplateError for a template that does not compile."""
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1 or None, got {max_model_len}")
        if template_source is not None:
            ChatTemplate(template_source, bos_token, eos_token, default_kwargs)  # fail here, not in a worker
        self.num_workers = num_workers
        self.render_timeout = render_timeout
        self.tokenize_timeout = tokenize_timeout
        self._config = pickle.dumps(
            {"model_dir": str(model_dir), "template_source": template_source, "bos_token": bos_token,
             "eos_token": eos_token, "default_kwargs": dict(default_kwargs or {}), "max_model_len": max_model_len},
            PICKLE,
        )  # fmt: skip
        self._procs: set[_Process] = set()
        self._idle: asyncio.Queue[_Process | None] = asyncio.Queue()  # None: closed
        self._large_jobs = asyncio.Semaphore(max(1, num_workers - 1))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        for _ in range(num_workers):
            self._spawn()

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """The pids of the current workers (started, starting or busy)."""
        return tuple(p.proc.pid for p in self._procs)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The prompt text and its token ids, exactly `ChatTemplate.render` + `Tokenizer.encode`.

        Raises ChatRenderError for anything the messages make fail (the template's errors, a
        prompt that cannot be tokenized or is too long to fit max_model_len) and RenderTimeout when
        rendering runs past render_timeout.
        """
        args = (messages, tools, add_generation_prompt, continue_final_message, kwargs, add_special_tokens)
        try:
            payload = pickle.dumps(("render", args), PICKLE)
        except RecursionError:
            raise ChatRenderError("the messages or tools are nested too deeply to render") from None
        return await self._call(payload, "render")

    async def encode(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Token ids of each text (as `Tokenizer.encode`); TokenizeError for text that cannot be
        tokenized or is too long to fit max_model_len (then no text is tokenized)."""
        return await self._call(pickle.dumps(("encode", (texts, add_special_tokens)), PICKLE), "tokenize")

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of these token ids (as `Tokenizer.decode`); TokenizeError for ids that are not."""
        return await self._call(pickle.dumps(("decode", (ids, skip_special_tokens)), PICKLE), "tokenize")

    def close(self) -> None:
        """Kill every worker (SIGKILL) and wait at most about a second for them; idempotent.
        Calls waiting for a worker, and later calls, raise TextWorkerError."""
        if self._closed:
            return
        self._closed = True
        procs, self._procs = list(self._procs), set()
        for p in procs:
            p.kill(close_socket=not p.busy)  # a busy one's call is reading it: it closes it when it fails
        deadline = time.monotonic() + 1.0
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(max(0.0, deadline - time.monotonic()))
        self._wake_waiters()

    # ---- the parent's side ----------------------------------------------------------------------

    async def _call(self, payload: bytes, phase: str) -> Any:
        """Run one request on an idle worker; `phase` is what it does first ("render" or "tokenize")."""
        op = "render" if phase == "render" else "tokenize"
        gate = self._large_jobs if len(payload) > LARGE else contextlib.nullcontext()
        async with gate:
            proc = await self._acquire()
            status, result, retire = await self._exchange(proc, op, payload, phase)
        if retire:  # after a Rust panic or MemoryError the worker's heap is not to be trusted
            self._replace(proc, "failed on a request")
        else:
            self._release(proc)
        if status == "ok":
            return result
        if status == "render" or (status == "tokenize" and op == "render"):
            raise ChatRenderError(result)
        if status == "tokenize":
            raise TokenizeError(result)
        logger.error("text worker %d failed: %s", proc.proc.pid, result)
        raise TextWorkerError("a text worker failed on this request (the server log has the details)")

    async def _exchange(self, proc: _Process, op: str, payload: bytes, phase: str) -> tuple[str, Any, bool]:
        """The worker's reply; a worker that runs out of time, dies, or whose request is cancelled
        is replaced, and the request gets the error that says so."""
        limits = {"render": self.render_timeout, "tokenize": self.tokenize_timeout}
        try:
            return await proc.exchange(payload, phase, limits)
        except _PhaseTimeout as e:
            self._replace(proc, f"ran past its {e.limit:g} s limit ({e.phase})")
            raise _timeout_error(op, e) from None
        except (EOFError, OSError):
            how = "its exit status is unknown"
            try:
                how = await proc.exit_description_soon()
            finally:
                self._replace(proc, f"stopped during a request ({how})")
            if self._closed:
                raise TextWorkerError("the text workers are closed: the server is stopping") from None
            raise TextWorkerError(f"the text worker stopped while handling this request ({how}); "
                                  "a new one is starting") from None  # fmt: skip
        except BaseException as e:  # cancelled (client gone, shutdown), or the worker did not start
            self._replace(proc, "was stopped mid-request" if isinstance(e, asyncio.CancelledError) else f"failed: {e}")
            raise

    async def _acquire(self) -> _Process:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise TextWorkerError("the text workers are closed: the server is stopping")
            proc = await self._idle.get()
            if proc is None:  # closed: pass the wake-up on to the next waiter
                self._idle.put_nowait(None)
                continue
            if proc.alive():
                proc.busy = True
                return proc
            self._replace(proc, f"died while idle ({proc.exit_description()})")

    def _release(self, proc: _Process) -> None:
        proc.busy = False
        if self._closed:
            proc.kill(close_socket=True)
        else:
            self._idle.put_nowait(proc)

    def _replace(self, proc: _Process, why: str) -> None:
        """Kill a worker and start another in its place; the new one is idle at once and answers
        its first request when it has started."""
        self._procs.discard(proc)
        proc.kill(close_socket=True)
        if not self._closed:
            logger.warning("text worker %d %s; starting a new one", proc.proc.pid, why)
            self._spawn()

    def _spawn(self) -> None:
        try:
            proc = _Process(self._config)
        except OSError as e:  # fork or exec failed (out of memory or processes): try again soon
            logger.error("cannot start a text worker (%s); retrying in 1 s", e)
            with contextlib.suppress(RuntimeError):  # no running loop: the pool starts one short
                asyncio.get_running_loop().call_later(1.0, self._spawn)
            return
        if self._closed:
            proc.kill(close_socket=True)
            return
        self._procs.add(proc)
        self._idle.put_nowait(proc)

    def _wake_waiters(self) -> None:
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if loop is None or on_loop or not loop.is_running():
            self._idle.put_nowait(None)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._idle.put_nowait, None)


class _PhaseTimeout(Exception):
    def __init__(self, phase: str, limit: float) -> None:
        super().__init__(phase, limit)
        self.phase, self.limit = phase, limit


def _timeout_error(op: str, e: _PhaseTimeout) -> ValueError:
    if e.phase == "render":
        return RenderTimeout(f"the chat template ran longer than {e.limit:g} s on these messages and was "
                             "stopped (the server's --chat-template-timeout)")  # fmt: skip
    message = f"tokenizing took longer than {e.limit:g} s and was stopped; send a shorter text"
    return ChatRenderError(message) if op == "render" else TokenizeError(message)


# The worker gets the parent's sys.path (as multiprocessing's spawn does), so it imports the same Tandem.
_BOOTSTRAP = (
    "import sys; sys.path[:] = {path!r}; "
    "from tandem.server.text_worker import worker_main; worker_main({fd}, {ppid})"
)


class _Process:
    """One worker process and the parent's (non-blocking) end of its socket."""

    def __init__(self, config: bytes) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            code = _BOOTSTRAP.format(path=[str(p) for p in sys.path], fd=theirs.fileno(), ppid=os.getpid())
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # stderr: the server's log
            )  # fmt: skip
        self.sock = ours
        self.sock.setblocking(False)
        self.busy = False
        self.ready = False
        self.started_at = time.monotonic()
        # The configuration usually fits the socket's buffer, so the worker can load while idle.
        message = HEADER.pack(len(config)) + config
        try:
            sent = self.sock.send(message)
        except BlockingIOError:
            sent = 0
        self._unsent = message[sent:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def exit_description_soon(self) -> str:
        """How the process ended; its socket closes a moment before its exit status is known."""
        for _ in range(50):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.01)
        return self.exit_description()

    def exit_description(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "it closed its socket"
        if code >= 0:
            return f"exit status {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (", perhaps by the out-of-memory killer" if code == -signal.SIGKILL else "")

    async def exchange(self, payload: bytes, phase: str, limits: dict[str, float | None]) -> tuple[str, Any, bool]:
        """Send a request and return the worker's reply (status, result, retire). Each phase
        (the worker reports when it starts tokenizing) has its own time limit."""
        loop = asyncio.get_running_loop()
        if not self.ready:
            await self._wait_ready(loop)
        timer = asyncio.timeout(limits[phase])
        try:
            async with timer:
                await _send(loop, self.sock, payload)
                while (reply := await _recv(loop, self.sock))[0] == "phase":
                    phase = reply[1]
                    limit = limits[phase]
                    timer.reschedule(None if limit is None else loop.time() + limit)
        except TimeoutError:
            if timer.expired():
                raise _PhaseTimeout(phase, limits[phase]) from None
            raise
        return reply

    async def _wait_ready(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            async with asyncio.timeout(_START_TIMEOUT):
                if self._unsent:
                    await loop.sock_sendall(self.sock, self._unsent)
                    self._unsent = b""
                status, info = await _recv(loop, self.sock)
        except TimeoutError:
            raise TextWorkerError(f"a text worker did not start within {_START_TIMEOUT:g} s") from None
        except (EOFError, OSError):
            how = await self.exit_description_soon()
            raise TextWorkerError(f"a text worker stopped while starting ({how})") from None
        if status != "ready":
            raise TextWorkerError(f"a text worker could not start: {info}")
        self.ready = True
        logger.info("text worker %d ready in %.2f s (%d MiB); %s", self.proc.pid, time.monotonic() - self.started_at,
                    info["rss_mib"], info["guard"])  # fmt: skip

    def kill(self, close_socket: bool) -> None:
        """SIGKILL (a worker holds nothing that needs a clean exit), then reap it without waiting."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            if close_socket:
                self.sock.close()
            return
        if close_socket:
            # After the callbacks that unregister a cancelled read of this socket, so its file
            # descriptor cannot be reused while the loop still watches it.
            loop.call_soon(self.sock.close)
        loop.call_soon(_reap, loop, self.proc, 0.01)


def _reap(loop: asyncio.AbstractEventLoop, proc: subprocess.Popen, delay: float) -> None:
    if proc.poll() is None and delay < 30:
        loop.call_later(delay, _reap, loop, proc, delay * 2)


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, payload: bytes) -> None:
    if len(payload) < 65536:
        await loop.sock_sendall(sock, HEADER.pack(len(payload)) + payload)
    else:  # no copy of a large payload
        await loop.sock_sendall(sock, HEADER.pack(len(payload)))
        await loop.sock_sendall(sock, payload)


async def _recv(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> Any:
    (size,) = HEADER.unpack(await _recv_exactly(loop, sock, HEADER.size))
    return pickle.loads(await _recv_exactly(loop, sock, size))


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise EOFError("the text worker closed its socket")
        got += n
    return buf
