"""`tandem serve`'s flags (tandem/cli.py) and their vLLM compatibility (tandem/cli_flags.py): vLLM
launch lines parse into the right configs, vLLM flags that do not apply are refused in one line,
unknown flags get a did-you-mean, every --help entry shows its default, the README's flag table
matches the parser, --generation-config picks the engine's sampling defaults, and the served model
names and --max-logprobs reach the HTTP routes (/v1/models, /v1/models/{id}, requests naming any
served name, logprobs / top_logprobs over the limit)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
from pathlib import Path

import httpx
import pytest

# The server stack is a test dependency; a machine without it (the GPU box) skips these tests.
pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import tandem
from tandem import cli
from tandem.builtin import DEMO_DIR, DEMO_NAME, ensure_builtin_model
from tandem.cli import build_configs, build_parser, shipped_model
from tandem.cli_flags import VLLM_ACCEPTED, VLLM_REFUSED, option_strings
from tandem.config import CacheConfig
from tandem.engine.async_engine import AsyncEngine
from tandem.engine.engine import LLMEngine
from tandem.server.app import create_app
from tandem.tokenizer import Tokenizer
from test_server import LiveServer

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_builtin_model(tmp_path_factory.mktemp("builtin"))


def _configs(argv: list[str]):
    """argv after `tandem` -> (args, EngineConfig, ServerConfig), as `tandem serve` builds them."""
    args = build_parser().parse_args(argv)
    shipped, model_dir = shipped_model(args.model)
    return (args, *build_configs(args, model_dir or "<built-in>", shipped))


def _exits_2(argv: list[str], capsys) -> str:
    """Run `tandem ARGV`, which must exit 2 with one line on stderr; that line."""
    with pytest.raises(SystemExit) as exc:
        cli.run(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem") and "\n" not in err, err
    return err


# ---- parsing into configs ------------------------------------------------------------------------


def test_vllm_launch_line_parses_into_the_configs(model_dir) -> None:
    args, engine, server = _configs([
        "serve", "--model", str(model_dir), "--served-model-name", "a", "b", "--max-model-len", "4096",
        "--enable-chunked-prefill", "--block-size", "16", "--max-logprobs", "5", "--generation-config", "auto",
        "--disable-log-requests", "--uvicorn-log-level", "warning", "--trust-remote-code",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--device", "cpu",
    ])
    assert args.model == str(model_dir) and args.trust_remote_code and args.disable_log_requests
    assert engine.model.model == str(model_dir) and engine.model.max_model_len == 4096
    assert engine.model.served_model_name == "a" and server.served_model_names == ("a", "b")
    assert engine.scheduler.enable_chunked_prefill and engine.cache.block_size == 16
    assert server.max_logprobs == 5 and server.uvicorn_log_level == "warning"
    assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("hermes", True)
    assert server.reasoning_parser is None  # not a shipped model: no parser unless asked for
    assert engine.log_stats_interval == 10.0


def test_flag_values_and_defaults(model_dir) -> None:
    d = str(model_dir)
    _, engine, server = _configs(["serve", d, "--block-size", "32", "--disable-log-stats", "--log-level", "error"])
    assert engine.cache.block_size == 32 and math.isinf(engine.log_stats_interval)
    assert server.uvicorn_log_level == "error"  # uvicorn follows --log-level unless told otherwise
    assert server.served_model_names == (model_dir.name,) and engine.model.served_model_name == model_dir.name
    assert (server.tool_call_parser, server.enable_auto_tool_choice, server.max_logprobs) == (None, False, 20)
    _, engine, _ = _configs(["serve", d, "--no-enable-chunked-prefill", "--max-model-len", "256"])
    assert engine.scheduler.enable_chunked_prefill is False
    _, _, server = _configs(["serve", d, "--tool-call-parser", "hermes"])
    assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("hermes", False)
    _, _, server = _configs(["serve", d, "--served-model-name", "x", "y", "x"])
    assert server.served_model_names == ("x", "y")
    # MODEL_DIR and --model may both be given when they agree.
    assert build_parser().parse_args(["serve", d, "--model", d]).model == d


def test_shipped_models_default_their_parsers() -> None:
    _, engine, server = _configs(["serve"])
    assert engine.model.served_model_name == DEMO_NAME and server.served_model_names == (DEMO_NAME,)
    assert server.reasoning_parser == "qwen3"
    assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("hermes", True)
    _, _, server = _configs(["serve", "--tool-call-parser", "none", "--reasoning-parser", "none"])
    assert (server.reasoning_parser, server.tool_call_parser, server.enable_auto_tool_choice) == (None, None, False)
    _, _, server = _configs(["serve", "--no-enable-auto-tool-choice"])
    assert (server.tool_call_parser, server.enable_auto_tool_choice) == ("hermes", False)
    _, _, server = _configs(["serve", "tandem-builtin"])
    assert server.served_model_names == ("tandem-builtin",) and server.tool_call_parser == "hermes"


def test_serve_logs_trust_remote_code_and_passes_the_uvicorn_level(model_dir, monkeypatch, caplog) -> None:
    seen = {}

    async def fake_serve(engine_cfg, server_cfg, builtin, log_level):
        seen.update(server_cfg=server_cfg, builtin=builtin, log_level=log_level)
        return 0

    monkeypatch.setattr(cli, "serve_until_exit", fake_serve)
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert cli.run(["serve", str(model_dir), "--device", "cpu", "--trust-remote-code",
                        "--uvicorn-log-level", "warning"]) == 0
    assert seen["log_level"] == "warning" and seen["builtin"] is False
    assert sum("never runs code from a checkpoint" in r.getMessage() for r in caplog.records) == 1
    assert cli.run(["serve", "tandem-builtin", "--device", "cpu"]) == 0
    assert seen["builtin"] is True and seen["server_cfg"].enable_auto_tool_choice


# ---- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", sorted(VLLM_REFUSED))
def test_refused_vllm_flags_exit_2_with_one_line_naming_them(flag, capsys) -> None:
    err = _exits_2(["serve", flag, "2"], capsys)
    assert f"{flag} is not supported: " in err and VLLM_REFUSED[flag] in err


def test_refused_flag_spellings(capsys) -> None:
    assert "--tensor-parallel-size is not supported" in _exits_2(["serve", "--tensor-parallel-size=2"], capsys)
    assert "-O3 is not supported" in _exits_2(["serve", "-O3"], capsys)
    assert "--quantization is not supported" in _exits_2(["plan", "--quantization", "fp8"], capsys)
    # A refused flag is named even when a stray word comes first.
    assert "-tp is not supported" in _exits_2(["serve", "a", "b", "-tp", "2"], capsys)


def test_unknown_flags_get_a_suggestion(capsys) -> None:
    assert _exits_2(["serve", "--max-num-seq", "3"], capsys).endswith(
        "unrecognized argument --max-num-seq; did you mean --max-num-seqs?")  # no abbreviations either
    assert "did you mean --served-model-name?" in _exits_2(["serve", "--servd-model-name", "x"], capsys)
    assert "did you mean --enable-auto-tool-choice?" in _exits_2(["serve", "--enable-auto-tool-choise"], capsys)
    assert _exits_2(["serve", "--frobnicate"], capsys).endswith("unrecognized argument --frobnicate; --help lists "
                                                                "the flags")
    assert "unexpected argument 'b'" in _exits_2(["serve", "a", "b"], capsys)


def test_bad_flag_values_exit_2(model_dir, capsys) -> None:
    d = str(model_dir)
    cases = {
        ("serve", d, "--enable-auto-tool-choice"): "--enable-auto-tool-choice needs --tool-call-parser",
        ("serve", "--enable-auto-tool-choice", "--tool-call-parser", "none"): "needs --tool-call-parser",
        ("serve", d, "--model", "/elsewhere"): "--model '/elsewhere' differ",
        ("serve", d, "--block-size", "24"): "--block-size must be one of 1, 2, 4, 8, 16, 32, 64, 128",
        ("serve", d, "--block-size", "0"): "--block-size",
        ("serve", d, "--max-logprobs", "21"): "--max-logprobs must be in 0..20",
        ("serve", d, "--max-logprobs", "-1"): "--max-logprobs",
        ("serve", d, "--no-enable-chunked-prefill"): "--no-enable-chunked-prefill",
        ("serve", d, "--no-enable-chunked-prefill", "--max-model-len", "4096"): "--max-num-batched-tokens (2048)",
        ("serve", d, "--generation-config", str(model_dir.parent)):
            f"{model_dir.parent / 'generation_config.json'}: missing (--generation-config DIR",
        ("serve", d, "--generation-config", "/nonexistent"): "/nonexistent/generation_config.json: missing",
        ("serve", d, "--served-model-name", ""): "--served-model-name",
        ("serve", d, "--uvicorn-log-level", "loud"): "--uvicorn-log-level",
    }
    for argv, message in cases.items():
        assert message in _exits_2(list(argv), capsys), argv


def test_a_bad_generation_config_dir_is_a_flag_error(model_dir, tmp_path, capsys) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    err = _exits_2(["serve", str(model_dir), "--generation-config", str(tmp_path)], capsys)
    assert f'{tmp_path / "generation_config.json"}: "temperature" -1 is refused' in err


def test_block_size_is_checked_by_the_cache_config(model_dir) -> None:
    for size in (1, 16, 128):
        assert CacheConfig(block_size=size).block_size == size
    for size in (0, 3, 24, 256, True):
        with pytest.raises(ValueError, match=r"^--block-size must be one of 1, 2, 4, 8, 16, 32, 64, 128 "):
            CacheConfig(block_size=size)
    with pytest.raises(ValueError, match="--block-size must be one of"):  # before anything loads
        tandem.LLM(str(model_dir), device="cpu", block_size=24)


def test_vllm_tables_do_not_shadow_real_flags() -> None:
    serve = build_parser().commands["serve"]
    flags = set(option_strings(serve))
    assert not set(VLLM_REFUSED) & flags and set(VLLM_ACCEPTED) <= flags
    args = build_parser().parse_args(["serve", *VLLM_ACCEPTED])
    assert all(getattr(args, name[2:].replace("-", "_")) for name in VLLM_ACCEPTED)


def test_tool_call_parser_names_come_from_the_registry(model_dir, capsys) -> None:
    from tandem.server.tool_parsers import tool_parser_names

    assert "invalid choice: 'nope'" in _exits_2(["serve", str(model_dir), "--tool-call-parser", "nope"], capsys)
    for name in tool_parser_names():
        assert _configs(["serve", str(model_dir), "--tool-call-parser", name])[2].tool_call_parser == name


# ---- --generation-config -------------------------------------------------------------------------


BUILTIN_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # tandem.builtin's generation_config.json


@pytest.mark.parametrize(("value", "expected"), [
    ("auto", BUILTIN_DEFAULTS),
    ("vllm", {}),
    ("DEMO", {"temperature": 0.0}),  # the demo model's file: "do_sample": false
])
def test_generation_config_picks_the_engines_sampling_defaults(model_dir, value, expected, caplog) -> None:
    value = str(DEMO_DIR) if value == "DEMO" else value
    _, engine_cfg, _ = _configs(["serve", str(model_dir), "--device", "cpu", "--max-model-len", "64",
                                 "--kv-cache-memory", "4MiB", "--generation-config", value])
    assert engine_cfg.model.generation_config == value
    with caplog.at_level(logging.INFO, logger="tandem"):
        engine = LLMEngine(engine_cfg)
    assert engine.tokenizer.generation_defaults == expected
    # The eos ids (and everything else) still come from the model directory.
    assert engine.tokenizer.eos_token_ids == Tokenizer.from_dir(model_dir).eos_token_ids
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Sampling defaults")]
    shown = ", ".join(f"{k} {v}" for k, v in expected.items()) or "Tandem's own"
    assert logged == [f"Sampling defaults for fields a request leaves out: {shown} (--generation-config {value})"]


# ---- --help and the README table -----------------------------------------------------------------


def _serve_parser() -> argparse.ArgumentParser:
    return build_parser().commands["serve"]


def _entries(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def test_every_help_entry_has_a_text_and_shows_its_default_once() -> None:
    for parser in build_parser().commands.values():
        formatter = parser._get_formatter()
        for action in _entries(parser):
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert action.help and shown.count("(default") == 1, (action.option_strings or action.dest, shown)
    text = _serve_parser().format_help()
    assert "(default: on)" in text and "(default: True)" not in text


def _readme_rows() -> list[tuple[list[str], str]]:
    """The `tandem serve` flag table: (the flags in the first cell, the default cell) per row."""
    section = README.read_text(encoding="utf-8").split("## `tandem serve`", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first, default = line.split("|")[1:3]
            rows.append((re.findall(r"`([^`]+)`", first), default.strip()))
    return rows


def _names(action: argparse.Action) -> list[str]:
    return list(action.option_strings) or ["MODEL_DIR"]


def _default_agrees(cell: str, default: object) -> bool:
    """The comparison rule. A None default is computed at start-up (from the model, the
    environment, another flag), so the README describes it in words and nothing is compared. A
    bool default is the word on or off. Any other default is a plain literal: the cell must be
    exactly one code span holding it, numbers compared as numbers (`30` = 30.0)."""
    if default is None:
        return True
    if isinstance(default, bool):
        return cell == ("on" if default else "off")
    m = re.fullmatch(r"`([^`]+)`", cell)
    if not m:
        return False
    if isinstance(default, (int, float)):
        try:
            return float(m.group(1)) == default
        except ValueError:
            return False
    return m.group(1) == str(default)


def test_readme_flag_table_matches_the_parser(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)  # --api-key's default comes from it
    actions = _entries(_serve_parser())
    by_name = {name: a for a in actions for name in _names(a)}
    rows = _readme_rows()
    listed = [flag for flags, _ in rows for flag in flags if flag.startswith("-") or flag == "MODEL_DIR"]
    assert len(listed) == len(set(listed)), "a flag has two rows"
    assert not set(listed) - set(by_name), f"README rows for flags the parser lacks: {set(listed) - set(by_name)}"
    missing = [_names(a)[0] for a in actions if not set(_names(a)) <= set(listed)]
    assert not missing, f"serve flags without a (complete) README row: {missing}"
    for flags, cell in rows:
        for action in {id(by_name[f]): by_name[f] for f in flags if f in by_name}.values():
            assert _default_agrees(cell, action.default), (flags, cell, action.default)


# ---- over HTTP: served names, --max-logprobs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(model_dir):
    _, engine_cfg, server_cfg = _configs(["serve", str(model_dir), "--device", "cpu", "--max-model-len", "256",
                                          "--kv-cache-memory", "16MiB", "--served-model-name", "a", "org/b",
                                          "--max-logprobs", "2"])
    engine = AsyncEngine.from_config(engine_cfg)
    engine.start()
    app = create_app(engine, server_cfg)
    live = LiveServer(app, server_cfg)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield client
    finally:
        live.stop()
        app.state.tandem.close()
        asyncio.run(engine.shutdown(1.0))


def test_models_lists_every_served_name_and_each_has_a_card(http) -> None:
    listed = http.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["a", "org/b"]
    for name in ("a", "org/b"):
        card = http.get(f"/v1/models/{name}")
        assert card.status_code == 200, card.text
        body = card.json()
        assert (body["id"], body["object"], body["root"], body["max_model_len"]) == (name, "model", "a", 256)
    for unknown in ("c", "org", "a/b"):
        resp = http.get(f"/v1/models/{unknown}")
        assert resp.status_code == 404
        assert resp.json() == {"error": {"message": f"The model `{unknown}` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}
    # /metrics counts these under the route's template, not one label per model id.
    metrics = http.get("/metrics").text
    assert 'tandem:http_requests_total{handler="/v1/models/{model_id}",status="200"} 2.0' in metrics
    assert 'tandem:http_requests_total{handler="/v1/models/{model_id}",status="404"} 3.0' in metrics


def test_requests_may_name_any_served_name(http) -> None:
    for name in ("a", "org/b", None):
        body = {"prompt": "hi", "max_tokens": 2, **({"model": name} if name else {})}
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "a"  # responses carry the first name
    chat = http.post("/v1/chat/completions", json={"model": "org/b", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "a"
    tok = http.post("/tokenize", json={"model": "org/b", "prompt": "hi"})
    assert tok.status_code == 200
    err = http.post("/v1/completions", json={"prompt": "hi", "model": "c"})
    assert err.status_code == 400 and err.json()["error"]["message"] == "The model `c` does not exist."


def test_max_logprobs_limits_logprobs_and_top_logprobs(http) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 2})
    assert ok.status_code == 200, ok.text
    assert all(len(top) <= 2 for top in ok.json()["choices"][0]["logprobs"]["top_logprobs"])
    ok = http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2})
    assert ok.status_code == 200, ok.text
    for path, body, param in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 3}, "logprobs"),
                              ("/v1/chat/completions", {**chat, "top_logprobs": 3}, "top_logprobs")):
        resp = http.post(path, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"] == {"message": f"{param} must be an integer in [0, 2] (--max-logprobs), got 3",
                                        "type": "BadRequestError", "param": param, "code": 400}
