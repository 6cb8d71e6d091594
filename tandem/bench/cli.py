"""`tandem bench <tool>`: benchmark and quality tools for any OpenAI-compatible server.

Mount under the main CLI with `add_bench_parser(subparsers)` and dispatch with `run_bench(args)`,
or run standalone: `python -m tandem.bench.cli decode --url http://127.0.0.1:8000`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import NoReturn

from tandem.bench.client import DEFAULT_URL, BenchClient, BenchError, api_key_from_env
from tandem.bench.report import write_json
from tandem.bench.tools.common import ToolResult
from tandem.bench.tools.registry import HELP, TOOLS


class _Parser(argparse.ArgumentParser):
    """Bad flags print one line (no usage dump) and exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server base URL (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name (default: the first id from /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $TANDEM_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--json", dest="json_out", metavar="OUT", default=None, help="write the results and every raw sample here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--warmup", type=int, default=1, help="untimed short requests before measuring (default 1)")


def add_tool_parsers(sub: argparse._SubParsersAction) -> None:
    for name, module in TOOLS.items():
        p = sub.add_parser(name, help=HELP[name], description=(module.__doc__ or "").strip())
        add_common_arguments(p)
        module.add_arguments(p)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `bench` with one sub-command per tool to an existing CLI's sub-parsers."""
    bench = subparsers.add_parser("bench", help="benchmark and quality tools for OpenAI-compatible servers",
                                  description=__doc__.strip().splitlines()[0])
    sub = bench.add_subparsers(dest="bench_tool", required=True, metavar="TOOL")
    add_tool_parsers(sub)
    return bench


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tandem bench", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="bench_tool", required=True, metavar="TOOL")
    add_tool_parsers(sub)
    return parser


async def execute(tool: str, args: argparse.Namespace) -> ToolResult:
    """Connect (unless the tool can do without a server) and run one tool."""
    module = TOOLS[tool]
    needs = getattr(module, "needs_server", lambda a: True)(args)  # True, False or None (optional)
    if needs is False:
        return await module.run(None, args)
    client = BenchClient(args.url, args.model, args.api_key or api_key_from_env(), timeout=args.timeout)
    try:
        try:
            await client.connect()
        except BenchError:
            if needs is None:
                return await module.run(None, args)
            raise
        for i in range(getattr(args, "warmup", 0) or 0):
            await client.stream(f"Warm-up {i}: say something.", max_tokens=8)
        return await module.run(client, args)
    finally:
        await client.aclose()


def run_bench(args: argparse.Namespace) -> int:
    """Run the tool named in `args.bench_tool`; print its table; 0 on success, 1 when the server
    cannot be used or no request succeeded."""
    if args.quiet is False and not sys.stderr.isatty():
        args.quiet = True
    try:
        result = asyncio.run(execute(args.bench_tool, args))
    except BenchError as e:
        sys.stderr.write(f"tandem bench {args.bench_tool}: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    print(result.render())
    if args.json_out:
        write_json(args.json_out, {"url": args.url, "model": args.model, **result.to_dict()})
        print(f"wrote {args.json_out}")
    if result.total and result.failed == result.total:
        sys.stderr.write(f"tandem bench {args.bench_tool}: error: all {result.total} requests failed; first error: "
                         f"{_first_error(result)}\n")
        return 1
    return 0


def _first_error(result: ToolResult) -> str:
    return next((str(s.get("error")) for s in result.samples if s.get("error")), "unknown")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
