"""The text worker pool (tandem/server/text_workers.py, text_worker.py, context_guard.py) and
chat-template robustness: rendering and tokenizing off the event loop, time limits, crashes, shutdown,
and every template failure a 400."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest

from tandem.builtin import demo_model_dir
from tandem.server.chat_template import ChatRenderError, ChatTemplate, ChatTemplateError
from tandem.server.context_guard import MAX_SHRINK, ContextGuard
from tandem.server.text_worker import _Work
from tandem.server.text_workers import RenderTimeout, TextWorkerError, TextWorkers, TokenizeError
from tandem.tokenizer import Tokenizer

NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
USER_HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CONVERSATIONS = [
    USER_HI,
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": [{"type": "text", "text": "héllo 😀"}]}],
    [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ],
]  # fmt: skip


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(demo_model_dir())


def pool(tok: Tokenizer, template: str | None = None, **kw: Any) -> TextWorkers:
    source = tok.chat_template if template is None else template
    return TextWorkers(tok.model_dir, source, tok.bos_token, tok.eos_token, {"flag": "server"}, **kw)


def run(coro_fn, tok: Tokenizer, template: str | None = None, **kw: Any) -> Any:
    """Run `coro_fn(workers)` on a fresh event loop with a fresh pool, closed afterwards."""
    workers = pool(tok, template, **kw)

    async def main() -> Any:
        try:
            return await coro_fn(workers)
        finally:
            workers.close()

    return asyncio.run(main())


def is_running(pid: int) -> bool:
    """A live process (not a zombie waiting to be reaped) with this pid."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


class Ticker:
    """Measures the event loop's responsiveness: the longest gap between 10 ms sleeps."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self.task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.01)
            now = loop.time()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def stop(self) -> float:
        self.task.cancel()
        return self.max_gap


# ---- through the pool -----------------------------------------------------------------------------


def test_render_chat_matches_inline_render_and_encode(demo: Tokenizer) -> None:
    inline = ChatTemplate(demo.chat_template, demo.bos_token, demo.eos_token, {"flag": "server"})
    cases = [(msgs, None, True, False, None) for msgs in CONVERSATIONS] + [
        (USER_HI, TOOLS, True, False, {"enable_thinking": False}),
        ([*USER_HI, {"role": "assistant", "content": "Hel"}], None, False, True, None),
    ]

    async def check(workers: TextWorkers) -> None:
        # Concurrent calls: each gets its own worker or waits for one.
        got = await asyncio.gather(*(workers.render_chat(*case) for case in cases))
        for case, (text, ids) in zip(cases, got):
            expected = inline.render(case[0], tools=case[1], add_generation_prompt=case[2],
                                     continue_final_message=case[3], kwargs=case[4])  # fmt: skip
            assert text == expected
            assert ids == demo.encode(expected, add_special_tokens=False)
        assert got[3][0].endswith("<think>\n\n</think>\n\n") and got[4][0].endswith("Hel")

    run(check, demo)


def test_encode_decode_round_trip(demo: Tokenizer) -> None:
    texts = ["hello world", "héllo 😀 <|im_start|>user\nhi<|im_end|>", ""]

    async def check(workers: TextWorkers) -> None:
        ids = await workers.encode(texts, add_special_tokens=False)
        assert ids == [demo.encode(t) for t in texts]
        assert [await workers.decode(i, skip_special_tokens=False) for i in ids] == texts
        assert await workers.decode(ids[1]) == demo.decode(ids[1], skip_special_tokens=True)
        assert await workers.encode(texts[:1], add_special_tokens=True) == [demo.encode(texts[0], True)]
        # A light worker: this process has torch loaded, its workers do not.
        maps = Path(f"/proc/{workers.worker_pids[0]}/maps").read_text()
        assert "torch" in sys.modules and "libtorch" not in maps and "tokenizers" in maps


    run(check, demo, num_workers=1)


def test_loop_stays_responsive_while_a_15mb_message_is_rendered_and_tokenized(demo: Tokenizer) -> None:
    words = Path(__file__).parents[1].joinpath("tandem/assets/builtin_corpus.txt").read_text(encoding="utf-8")
    big = (words * (15_000_000 // len(words) + 1))[:15_000_000]
    inline = ChatTemplate(demo.chat_template, demo.bos_token, demo.eos_token)

    async def check(workers: TextWorkers) -> None:
        await workers.render_chat(USER_HI)  # both workers started
        await asyncio.gather(workers.render_chat(USER_HI), workers.render_chat(USER_HI))
        ticker = Ticker()
        large = asyncio.create_task(workers.render_chat([{"role": "user", "content": big}]))
        await asyncio.sleep(0.5)
        # A large job may not take the last worker: ordinary requests are served meanwhile.
        t0 = time.monotonic()
        assert (await workers.render_chat(USER_HI))[0].startswith("<|im_start|>user\nhi")
        small_latency = time.monotonic() - t0
        finished_first = large.done()
        text, ids = await large
        assert ticker.stop() < 0.5
        assert not finished_first and small_latency < 2.0
        assert len(text) > 15_000_000 and text == inline.render([{"role": "user", "content": big}])
        assert ids[:5] == demo.encode(text[:1000])[:5] and len(ids) > 1_000_000

    run(check, demo)


def test_a_template_that_runs_too_long_is_stopped_and_its_worker_replaced(demo: Tokenizer) -> None:
    source = "{% if messages[0].content == 'loop' %}" + NESTED_LOOP + "{% else %}ok{% endif %}"

    async def check(workers: TextWorkers) -> None:
        assert (await workers.render_chat(USER_HI))[0] == "ok"
        [stuck_pid] = workers.worker_pids
        ticker = Ticker()
        t0 = time.monotonic()
        with pytest.raises(RenderTimeout, match="longer than 1 s"):
            await workers.render_chat([{"role": "user", "content": "loop"}])
        assert 0.9 < time.monotonic() - t0 < 10
        assert ticker.stop() < 0.5
        assert (await workers.render_chat(USER_HI))[0] == "ok"  # on the replacement
        assert workers.worker_pids != (stuck_pid,)
        await asyncio.sleep(0.2)
        assert not is_running(stuck_pid)

    assert issubclass(RenderTimeout, ChatRenderError)  # a 400, like any template error
    run(check, demo, source, num_workers=1, render_timeout=1.0)


def test_a_crashed_worker_fails_its_request_clearly_and_is_replaced(demo: Tokenizer) -> None:
    async def check(workers: TextWorkers) -> None:
        await workers.render_chat(USER_HI)
        [pid] = workers.worker_pids
        call = asyncio.create_task(workers.render_chat([{"role": "user", "content": "loop"}]))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGSEGV)
        with pytest.raises(TextWorkerError, match="SIGSEGV") as err:
            await call
        assert "Traceback" not in str(err.value)
        assert (await workers.render_chat(USER_HI))[0] == "ok"
        [new_pid] = workers.worker_pids
        os.kill(new_pid, signal.SIGKILL)  # dies while idle: the next call quietly gets another
        await asyncio.sleep(0.3)
        assert (await workers.render_chat(USER_HI))[0] == "ok"

    source = "{% if messages[0].content == 'loop' %}" + NESTED_LOOP + "{% else %}ok{% endif %}"
    run(check, demo, source, num_workers=1, render_timeout=30.0)


def test_a_cancelled_request_frees_its_worker(demo: Tokenizer) -> None:
    async def check(workers: TextWorkers) -> None:
        call = asyncio.create_task(workers.render_chat([{"role": "user", "content": "loop"}]))
        await asyncio.sleep(0.5)
        call.cancel()  # the client went away: its worker is stopped, not left looping
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await workers.render_chat(USER_HI))[0] == "ok"

    source = "{% if messages[0].content == 'loop' %}" + NESTED_LOOP + "{% else %}ok{% endif %}"
    run(check, demo, source, num_workers=1, render_timeout=60.0)


def test_close_is_quick_with_a_stuck_worker_and_leaves_no_processes(demo: Tokenizer) -> None:
    workers = pool(demo, NESTED_LOOP, num_workers=2, render_timeout=60.0)
    pids = workers.worker_pids
    assert len(pids) == 2

    async def main() -> None:
        stuck = asyncio.create_task(workers.render_chat(USER_HI))
        waiting = [asyncio.create_task(workers.render_chat(USER_HI)) for _ in range(2)]  # one waits
        await asyncio.sleep(1.0)
        assert not stuck.done()
        t0 = time.monotonic()
        workers.close()
        workers.close()  # idempotent
        assert time.monotonic() - t0 < 1.5
        for task in (stuck, *waiting):
            with pytest.raises(TextWorkerError, match="closed|stopped"):
                await asyncio.wait_for(task, 5)
        with pytest.raises(TextWorkerError, match="closed"):
            await workers.encode(["x"])

    asyncio.run(main())
    assert not any(is_running(pid) for pid in pids)
    assert workers.worker_pids == ()


def test_workers_die_with_a_killed_server_and_ignore_ctrl_c(demo: Tokenizer, tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import asyncio, sys
        from tandem.server.text_workers import TextWorkers
        async def main():
            w = TextWorkers({str(demo.model_dir)!r}, None, None, None, num_workers=2)
            await w.encode(["warm"])
            await asyncio.gather(w.encode(["a"]), w.encode(["b"]))
            print(*w.worker_pids, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in server.stdout.readline().split()]
        assert len(pids) == 2 and all(is_running(p) for p in pids)
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.3)
        assert all(is_running(p) for p in pids)
        server.kill()  # SIGKILL: no chance to close the pool
        server.wait(10)
        deadline = time.monotonic() + 10
        while any(is_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(is_running(p) for p in pids)
    finally:
        server.kill()
        server.wait(10)


def test_errors_in_the_pool_are_400s_with_clear_messages(demo: Tokenizer) -> None:
    def deep_tools(depth: int) -> list[dict[str, Any]]:
        value: Any = {}
        for _ in range(depth):
            value = {"a": value}
        return [{"type": "function", "function": {"name": "f", "parameters": value}}]

    async def check(workers: TextWorkers) -> None:
        with pytest.raises(ChatRenderError, match="surrogate"):
            await workers.render_chat([{"role": "user", "content": "a\ud800b"}])
        with pytest.raises(ChatRenderError, match="nested too deeply"):
            await workers.render_chat(USER_HI, tools=deep_tools(100_000))  # too deep even to send
        try:  # sent; too deep for tojson under Python 3.11's recursion limit, not under 3.12's
            await workers.render_chat(USER_HI, tools=deep_tools(900))
        except ChatRenderError as e:
            assert "too deeply" in str(e)
        with pytest.raises(TokenizeError, match="surrogate"):
            await workers.encode(["ok", "a\udc00"])
        with pytest.raises(TokenizeError, match="must be a string"):
            await workers.encode([["not", "text"]])  # type: ignore[list-item]
        with pytest.raises(TokenizeError, match="token ids must be integers"):
            await workers.decode([1, -1])
        with pytest.raises(TokenizeError, match="token ids must be integers"):
            await workers.decode([2**70])
        assert (await workers.encode(["still fine"])) == [demo.encode("still fine")]

    run(check, demo, num_workers=1)


def test_no_chat_template_and_bad_startup(demo: Tokenizer, tmp_path: Path) -> None:
    async def main(model_dir: Path) -> None:
        workers = TextWorkers(model_dir, None, None, None, num_workers=1)
        try:
            if model_dir == demo.model_dir:
                with pytest.raises(ChatRenderError, match="no chat template"):
                    await workers.render_chat(USER_HI)
                assert await workers.encode(["x"]) == [demo.encode("x")]
                return
            for _ in range(2):  # each attempt starts a new worker, which fails the same way
                with pytest.raises(TextWorkerError, match="could not start.*tokenizer.json"):
                    await workers.encode(["x"])
        finally:
            workers.close()

    asyncio.run(main(demo.model_dir))
    asyncio.run(main(tmp_path))
    with pytest.raises(ChatTemplateError, match="syntax error"):
        TextWorkers(demo.model_dir, "{% for %}", None, None)
    with pytest.raises(ValueError, match="num_workers"):
        TextWorkers(demo.model_dir, None, None, None, num_workers=0)


def test_a_tokenizer_panic_is_a_400_and_retires_the_worker() -> None:
    class Panic(BaseException):  # what pyo3 raises for a Rust panic (16 MB of spaces does it)
        pass

    class PanickingTokenizer:
        vocab_size = 10

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            raise Panic("Onig: Regex search error: retry-limit-in-match over")

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            raise MemoryError

    work = _Work.__new__(_Work)
    work.tokenizer, work.template, work.guard = PanickingTokenizer(), None, None

    def handle(op: str, *args: Any) -> tuple[str, Any, bool]:
        return work.handle(pickle.dumps((op, args)), channel=None)  # type: ignore[arg-type]

    status, message, retire = handle("encode", ["   "], False)
    assert (status, retire) == ("tokenize", True) and "retry-limit" in message
    status, message, retire = handle("decode", [1], True)
    assert (status, retire) == ("tokenize", True) and "out of memory" in message
    assert handle("bogus")[0] == "internal"


# ---- the length guard: text too long for any tokenization to fit is refused untokenized ------------


DEMO_TOKEN_BYTES = 31  # the demo's longest token (tests below check this is what the guard finds)


class Recorder:
    """A worker's channel that keeps what is sent on it."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, obj: Any) -> int:
        self.sent.append(obj)
        return 0


def demo_work(tok: Tokenizer, max_model_len: int | None) -> _Work:
    return _Work(str(tok.model_dir), tok.chat_template, tok.bos_token, tok.eos_token, {}, max_model_len)


def user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def test_a_prompt_just_over_the_bound_is_refused_before_the_tokenize_phase(demo: Tokenizer) -> None:
    work = demo_work(demo, max_model_len=1000)
    limit = 1000 * DEMO_TOKEN_BYTES
    overhead = len(ChatTemplate(demo.chat_template, demo.bos_token, demo.eos_token).render(user("")).encode())

    def render(content: str) -> tuple[tuple[str, Any, bool], list[Any]]:
        channel = Recorder()
        args = (user(content), None, True, False, None, False)
        return work.handle(pickle.dumps(("render", args)), channel), channel.sent  # type: ignore[arg-type]

    (status, message, retire), sent = render("a" * (limit - overhead + 1))
    assert (status, retire, sent) == ("tokenize", False, [])  # no "phase" message: tokenizing never began
    assert message == (f"the prompt is {limit + 1:,} bytes of UTF-8; no tokenization of it fits this model's "
                       "maximum context length of 1000 tokens (a token covers at most 31 bytes); shorten it")
    (status, (text, ids), _), sent = render("a" * (limit - overhead))  # at the bound: tokenized as before
    assert status == "ok" and sent == [("phase", "tokenize", False)]
    assert len(text.encode()) == limit and ids == demo.encode(text)


def test_the_pool_refuses_text_over_the_bound_fast_and_tokenizes_the_rest_as_before(demo: Tokenizer) -> None:
    limit = 1000 * DEMO_TOKEN_BYTES
    composed, decomposed = "\u00e9", "e\u0301"  # é in NFC, and in NFD (3 bytes, which NFC makes 2)

    async def check(workers: TextWorkers) -> None:
        assert await workers.encode(["warm"]) == [demo.encode("warm")]
        at_bound = "a" * limit
        assert await workers.encode([at_bound]) == [demo.encode(at_bound)]
        assert await workers.encode([composed * (limit // 2)], True) == [demo.encode(composed * (limit // 2), True)]
        with pytest.raises(TokenizeError, match=r"the text is 31,001 bytes .* context length of 1000 tokens"):
            await workers.encode([at_bound + "a"])
        with pytest.raises(TokenizeError, match=r"text 2 of 2 is 31,002 bytes .* at most 31 bytes\)"):
            await workers.encode(["fine", composed * (limit // 2 + 1)])
        # Text that NFC may shrink gets 4 times the room: this one (3 bytes to 2) shrinks 1.5 times.
        shrinking = decomposed * (limit // 3 + 1)
        assert await workers.encode([shrinking]) == [demo.encode(shrinking)]
        with pytest.raises(TokenizeError, match=r"is 124,001 bytes .* at most 124 bytes\)"):  # 4 * limit + 1
            await workers.encode([decomposed * (4 * limit // 3) + "ab"])
        # 16 MB, which takes seconds and gigabytes to tokenize, is refused in milliseconds.
        huge = "word " * 3_200_000
        calls = [(TokenizeError, "the text", lambda: workers.encode([huge])),
                 (ChatRenderError, "the prompt", lambda: workers.render_chat(user(huge)))]  # fmt: skip
        for error, what, call in calls:
            t0 = time.monotonic()
            with pytest.raises(error, match=rf"^{what} is 16,0\d\d,\d\d\d bytes .* context length of 1000 tokens"):
                await call()
            assert time.monotonic() - t0 < 1.0
        assert await workers.render_chat(USER_HI, add_special_tokens=True)  # the worker carries on

    run(check, demo, num_workers=1, max_model_len=1000)


def test_without_max_model_len_nothing_is_refused_for_length(demo: Tokenizer) -> None:
    text = "a" * (4 * 1000 * DEMO_TOKEN_BYTES + 1)

    async def check(workers: TextWorkers) -> None:
        assert await workers.encode([text]) == [demo.encode(text)]
        _, ids = await workers.render_chat(user(text))
        assert len(ids) > 1000

    run(check, demo, num_workers=1)
    assert ContextGuard.build(demo, None) == (None, "no length guard (no max_model_len given)")
    with pytest.raises(ValueError, match="max_model_len"):
        TextWorkers(demo.model_dir, None, None, None, max_model_len=0)


def test_the_guard_never_refuses_a_text_that_fits(demo: Tokenizer) -> None:
    guard, note = ContextGuard.build(demo, 1)
    assert guard is not None and guard.token_bytes == DEMO_TOKEN_BYTES, note
    vocab = demo.fast.get_vocab()
    longest = max(vocab, key=len)
    corpus = Path(__file__).parents[1].joinpath("tandem/assets/builtin_corpus.txt").read_text(encoding="utf-8")
    texts = [
        demo.decode([vocab[longest]], skip_special_tokens=False) * 500,  # the densest text there is
        corpus[:50_000], "😀" * 3000, "e\u0301" * 5000, "\u212a" * 5000, "<|im_start|><|im_end|>" * 2000,
        " " * 20_000, "\n" * 20_000, "-" * 20_000, "".join(chr(c) for c in range(0x20, 0x3000)),
    ]  # fmt: skip
    for text in texts:
        n = len(demo.encode(text))
        assert ContextGuard(n, guard.token_bytes, guard.forms).refusal(text, "it") is None, text[:20]


def test_normalization_forms_shrink_text_at_most_max_shrink_times() -> None:
    # An input character is assigned to the output character that gets the first character of its
    # decomposition; an output character o gets at most one input per character of o's decomposition,
    # each at most `most[that character]` bytes. So bytes in / bytes out <= max over o of this ratio.
    # A character that decomposes to itself is only its own first character: `changing` are the others.
    every = (chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    changing = [c for c in every if unicodedata.normalize("NFKD", c) != c]
    for form, decomposed in (("NFC", "NFD"), ("NFD", "NFD"), ("NFKC", "NFKD"), ("NFKD", "NFKD")):
        most: dict[str, int] = {}
        for c in changing:
            first = unicodedata.normalize(decomposed, c)[0]
            most[first] = max(most.get(first, len(first.encode())), len(c.encode()))
        bound = max(
            sum(most.get(x, len(x.encode())) for x in unicodedata.normalize(decomposed, o)) / len(o.encode())
            for o in {*changing, *most}
            if unicodedata.is_normalized(form, o)
        )
        assert bound <= MAX_SHRINK, form
    assert unicodedata.normalize("NFKC", "\U0001d400") == "A"  # 4 bytes to 1: MAX_SHRINK is needed


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"normalizer": {"type": "Strip", "strip_left": True, "strip_right": True}}, "Strip normalizer"),
        ({"normalizer": {"type": "Replace", "pattern": {"Regex": "a+"}, "content": "a"}}, "Replace normalizer"),
        ({"normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}}, "Lowercase"),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "Whitespace pre-tokenizer can drop"),
        ({"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}},
         "Split pre-tokenizer can drop"),
        ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}},
         "drops, or fuses"),  # not byte-level any more: characters the vocabulary lacks are dropped
        ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}},
         "truncates"),
        ({"added_tokens": [{"id": 4656, "content": "<|endoftext|>", "single_word": False, "lstrip": True,
                            "rstrip": False, "normalized": False, "special": True}]}, "swallows the whitespace"),
        ({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            {"type": "NFKC"}]}}, None),
    ],
)  # fmt: skip
def test_a_tokenizer_that_can_shrink_text_gets_no_guard(
    demo: Tokenizer, tmp_path: Path, change: dict[str, Any], why: str | None
) -> None:
    spec = json.loads((demo.model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    (tmp_path / "tokenizer.json").write_text(json.dumps({**spec, **change}), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    guard, note = ContextGuard.build(tok, 100)
    if why is None:  # only adds text, then NFKC: NFKC may shrink what the others made, 4 times
        assert guard is not None and guard.forms == (None, None, "NFKC")
        assert guard.refusal("a" * 12_401, "it") and guard.refusal("a" * 12_400, "it") is None
        guard = ContextGuard(100, guard.token_bytes, ("NFKC",))  # first: 4 times only if not in NFKC
        assert guard.refusal("a" * 3101, "it") and guard.refusal("ﬁ" * 1034, "it") is None
        return
    assert guard is None and why in note
    text = "  a " * 10_000  # far over the bound (3100 bytes), but tokenized as before
    work = _Work(str(tmp_path), None, None, None, {}, 100)
    reply = work.handle(pickle.dumps(("encode", ([text], False))), Recorder())  # type: ignore[arg-type]
    assert reply == ("ok", [tok.encode(text)], False)


# ---- chat template robustness (inline) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "messages", "match"),
    [
        ("{% for i in range(100001) %}{% endfor %}", USER_HI, "Range too big"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", USER_HI, "recursed too deeply"),
        ("{{ 'x' * 2**60 }}", USER_HI, "out of memory"),  # more than any address space, overcommit or not
        ("{{ 1 / 0 }}", USER_HI, "ZeroDivisionError"),
        ("{{ messages[0].content ~ '\ud800' }}", USER_HI, "surrogate"),
        ("{{ messages[0].content }}", [{"role": "user", "content": "a\udfffb"}], "surrogate"),
        ("{{ messages[5].content.x }}", USER_HI, "chat template error"),
        ("{{ messages | sort(attribute='content') }}",
         [{"role": "user", "content": "a"}, {"role": "user", "content": ["b"]}], "only text"),
        ("{{ messages[0].content | int + 'x' }}", USER_HI, "TypeError"),
        ("{{ messages }}", ["not a message"], "must be an object"),
        ("{{ messages }}", [{"role": "user", "content": 5}], "string or a list"),
        ("{{ messages }}", [{"role": "assistant", "tool_calls": "x"}], "must be a list"),
        ("{{ messages }}", [{"role": "assistant", "tool_calls": ["x"]}], "tool call must be an object"),
        ("{{ messages }}", [{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}], "nested too deeply"),
    ],
)  # fmt: skip
def test_every_template_failure_is_a_chat_render_error(source: str, messages: list[Any], match: str) -> None:
    with pytest.raises(ChatRenderError, match=match):
        ChatTemplate(source).render(messages)


def test_template_failures_are_short_and_odd_inputs_are_handled() -> None:
    with pytest.raises(ChatRenderError) as err:  # the message quotes the failure, not the request
        ChatTemplate("{{ raise_exception(messages[0].content) }}").render([{"role": "user", "content": "k" * 10**5}])
    assert len(str(err.value)) < 400
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ChatRenderError, match="too deeply"):
        ChatTemplate("{{ tools | tojson }}").render(USER_HI, tools=deep)
    with pytest.raises(ChatRenderError, match="chat_template_kwargs must be an object"):
        ChatTemplate("x").render(USER_HI, kwargs=["x"])  # type: ignore[arg-type]
    huge_int = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "1" * 5000}}]}]
    out = ChatTemplate("{{ messages[0].tool_calls[0].function.arguments }}").render(huge_int)
    assert out == "1" * 5000  # more digits than Python converts: kept as the string it was
    args = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": [1]}'}}]}]
    assert ChatTemplate("{{ messages[0].tool_calls[0].function.arguments | tojson }}").render(args) == '{"a": [1]}'
    with pytest.raises(ChatTemplateError, match="cannot be compiled"):
        ChatTemplate("{{ 10 ** 100000 }}")  # jinja folds the constant while compiling
    assert json.loads(ChatTemplate("{{ messages | tojson }}").render([{"role": "user", "content": "😀"}])) == [
        {"role": "user", "content": "😀"}
    ]
