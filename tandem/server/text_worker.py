"""The text worker process that `text_workers.TextWorkers` starts: it loads the tokenizer and compiles
the chat template once, then answers render / encode / decode requests on its socket, one at a
time, until the socket closes. It imports no torch.

Wire format, both ways: an 8-byte big-endian size, then a pickle of that size.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path
from typing import Any

from tandem.server.chat_template import (
    ChatRenderError,
    ChatTemplate,
    lone_surrogate_error,
    short_message,
)
from tandem.server.context_guard import ContextGuard
from tandem.tokenizer import Tokenizer

HEADER = struct.Struct("!Q")  # every message: its pickled size, then the pickle
PICKLE = pickle.HIGHEST_PROTOCOL
LARGE = 1 << 20  # bytes of pickled request or reply: a large job (gated, and the heap trimmed after it)

def worker_main(fd: int, parent_pid: int) -> None:
    """A worker process's main loop (TextWorkers starts it; not for use by hand): read requests
    from the socket `fd`, answer each, exit when the socket closes."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which closes the pool
    with contextlib.suppress(OSError):  # under memory pressure, lose a worker rather than the server
        Path("/proc/self/oom_score_adj").write_text("1000")
    channel = _Channel(socket.socket(fileno=fd))
    try:
        config = pickle.loads(channel.recv_bytes())
        work = _Work(**config)
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        channel.send(("failed", _short(e)))
        return
    channel.send(("ready", {"rss_mib": _rss_mib(), "guard": work.guard_note}))
    while True:
        try:
            request = channel.recv_bytes()
        except (EOFError, OSError):
            return
        reply = work.handle(request, channel)
        try:
            sent = channel.send(reply)
        except OSError:
            return
        if len(request) + sent > LARGE:
            _trim_heap()  # a 16 MB prompt leaves a GB of freed heap behind


class _Failure(Exception):
    """A request's failure, as its reply says it: status "render", "tokenize" or "internal"."""

    def __init__(self, status: str, message: str, retire: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retire = status, message, retire


class _Work:
    """What a worker holds: the tokenizer, the compiled template and the length guard."""

    def __init__(self, model_dir: str, template_source: str | None, bos_token: str | None,
                 eos_token: str | None, default_kwargs: dict[str, Any], max_model_len: int | None) -> None:  # fmt: skip
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.template = (
            ChatTemplate(template_source, bos_token, eos_token, default_kwargs) if template_source is not None else None
        )
        self.guard, self.guard_note = ContextGuard.build(self.tokenizer, max_model_len)

    def handle(self, request: bytes, channel: _Channel) -> tuple[str, Any, bool]:
        try:
            op, args = pickle.loads(request)
            if op == "render":
                return ("ok", self.render(channel, *args), False)
            if op == "encode":
                return ("ok", self.encode(*args), False)
            if op == "decode":
                return ("ok", self.decode(*args), False)
            raise _Failure("internal", f"unknown request {op!r}")
        except ChatRenderError as e:
            return ("render", str(e), False)
        except _Failure as e:
            return (e.status, e.message, e.retire)
        except Exception as e:  # noqa: BLE001 - a bug here: the traceback goes to the server's log
            traceback.print_exc()
            return ("internal", _short(e), True)

    def render(self, channel: _Channel, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool, continue_final_message: bool, kwargs: dict[str, Any] | None,
               add_special_tokens: bool) -> tuple[str, list[int]]:  # fmt: skip
        if self.template is None:
            raise ChatRenderError("this model has no chat template; start the server with --chat-template")
        text = self.template.render(messages, tools, add_generation_prompt, continue_final_message, kwargs)
        self._check(text, "the prompt")
        channel.send(("phase", "tokenize", False))  # the render's time limit ends here
        return text, self._tokenize(text, add_special_tokens)

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        for i, text in enumerate(texts):  # all checked first: one text too long costs no tokenizing
            self._check(text, "the text" if len(texts) == 1 else f"text {i + 1} of {len(texts)}")
        return [self._tokenize(text, add_special_tokens) for text in texts]

    def _check(self, text: str, what: str) -> None:
        """Refuse a text that cannot be tokenized, or that cannot fit the model's context."""
        if not isinstance(text, str):
            raise _Failure("tokenize", f"a prompt must be a string, not {type(text).__name__}")
        if (bad := lone_surrogate_error(text)) is not None:
            raise _Failure("tokenize", bad)
        if self.guard is not None and (too_long := self.guard.refusal(text, what)) is not None:
            raise _Failure("tokenize", too_long)

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        with _tokenizer_errors("the tokenizer failed on this text"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        vocab = self.tokenizer.vocab_size
        with _tokenizer_errors(f"token ids must be integers from 0 to {vocab - 1}"):
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@contextlib.contextmanager
def _tokenizer_errors(what: str):
    try:
        yield
    except MemoryError:
        raise _Failure("tokenize", "the tokenizer ran out of memory on this text; send a shorter one", True) from None
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise _Failure("tokenize", f"{what} ({_short(e)})") from None
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        # A Rust panic (pyo3's PanicException is a BaseException), e.g. the pre-tokenizer's regex
        # giving up on 16 MB of spaces. The panic may have left the tokenizer broken: retire.
        raise _Failure("tokenize", f"{what} ({_short(e)})", True) from None


class _Channel:
    """The worker's blocking end of the socket: length-prefixed pickles."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv_bytes(self) -> bytearray:
        (size,) = HEADER.unpack(self._recv_exactly(HEADER.size))
        return self._recv_exactly(size)

    def _recv_exactly(self, size: int) -> bytearray:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise EOFError
            got += n
        return buf

    def send(self, obj: Any) -> int:
        data = pickle.dumps(obj, PICKLE)
        self.sock.sendall(HEADER.pack(len(data)))
        self.sock.sendall(data)
        return len(data)


def _die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent dies, even by SIGKILL (Linux); elsewhere EOF ends the worker."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took hold
        os._exit(0)


def _trim_heap() -> None:
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL(None).malloc_trim(0)


def _rss_mib() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
    except (OSError, ValueError, IndexError):
        return 0


def _short(e: BaseException) -> str:
    """`Type: message`, the message cut short (see chat_template.short_message)."""
    return f"{type(e).__name__}: {short_message(e)}" if str(e) else type(e).__name__
