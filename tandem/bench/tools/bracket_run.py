"""`tandem bench bracket`: run one benchmark base -> candidate -> base, against two URLs or two
server launch commands, keep every sample in a JSONL ledger plus a markdown summary, and declare a
winner only when the candidate beats both base runs by more than their spread.

  tandem bench bracket --base-url http://host:8000 --cand-url http://host:8001 --tool decode -- --runs 5
  tandem bench bracket --base-cmd 'tandem serve M' --cand-cmd 'tandem serve M --flag' --tool decode
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tandem.bench.bracket import verdict
from tandem.bench.client import BenchError
from tandem.bench.report import fmt, markdown_table
from tandem.bench.stats import summarize
from tandem.bench.tools.common import ToolResult

PHASES = ("base", "candidate", "base")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="URL of the base server (already running)")
    p.add_argument("--cand-url", help="URL of the candidate server (already running)")
    p.add_argument("--base-cmd", help="shell command that starts the base server, listening at --url")
    p.add_argument("--cand-cmd", help="shell command that starts the candidate server, listening at --url")
    p.add_argument("--tool", default="decode", choices=["decode", "ctx", "conc", "pp-tg", "streamgap", "quality"],
                   help="benchmark to bracket (default decode); its flags go after `--`")
    p.add_argument("--ledger", default=None, help="JSONL ledger (default bracket-<tool>-<time>.jsonl); summary next to it as .md")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a launched server may take to answer /health")
    p.add_argument("tool_args", nargs=argparse.REMAINDER, help="flags for the bracketed tool, after `--`")


def needs_server(args: argparse.Namespace) -> bool:
    return False  # bracket makes its own connections


def _tool_args(args: argparse.Namespace, url: str) -> argparse.Namespace:
    from tandem.bench.cli import _Parser, add_common_arguments
    from tandem.bench.tools.registry import TOOLS

    p = _Parser(prog=f"tandem bench bracket --tool {args.tool} --")
    add_common_arguments(p)
    TOOLS[args.tool].add_arguments(p)
    rest = [a for a in args.tool_args if a != "--"]
    targs = p.parse_args(rest)
    targs.url, targs.quiet = url, args.quiet
    targs.model = targs.model or args.model
    targs.api_key = targs.api_key or args.api_key
    targs.timeout = args.timeout
    return targs


class _Launched:
    """A server started by a shell command in its own process group; stopped by signalling that group."""

    def __init__(self, cmd: str, url: str, log: Path) -> None:
        self.cmd, self.url, self.log_path = cmd, url.rstrip("/"), log
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, shell=True, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT)

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5.0) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchError(f"`{self.cmd}` exited with status {self.proc.returncode} before answering; see {self.log_path}")
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise BenchError(f"`{self.cmd}` did not answer {self.url}/health within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM the launched group and wait until every process in it is gone (the shell may
        exit before the server it started); SIGKILL whatever is left after 60 s."""
        pgid = self.proc.pid  # start_new_session: the group id is the shell's pid
        if self._group_alive(pgid):
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while self._group_alive(pgid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the shell so it stops counting
                time.sleep(0.2)
            if self._group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True


async def _url_busy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=2.0) as http:
        try:
            await http.get(f"{url.rstrip('/')}/health")
            return True
        except httpx.HTTPError:
            return False


async def run(client: None, args: argparse.Namespace) -> ToolResult:
    from tandem.bench.cli import execute

    by_urls = bool(args.base_url and args.cand_url)
    by_cmds = bool(args.base_cmd and args.cand_cmd)
    if by_urls == by_cmds:
        raise BenchError("give either --base-url and --cand-url, or --base-cmd and --cand-cmd")
    ledger = Path(args.ledger or f"bracket-{args.tool}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    res = ToolResult("bracket", ["run", "config", "samples", "median", "min", "max", "failed"], [])
    runs: list[list[float]] = []
    higher_is_better, metric = True, "?"
    with open(ledger, "a") as out:
        for i, phase in enumerate(PHASES):
            label = f"{i + 1}:{phase}"
            where = (args.base_url if phase == "base" else args.cand_url) if by_urls else args.url
            launched = None
            if by_cmds:
                if await _url_busy(args.url):
                    raise BenchError(f"something already answers at {args.url}; stop it before a bracket launches servers there")
                cmd = args.base_cmd if phase == "base" else args.cand_cmd
                launched = _Launched(cmd, args.url, ledger.with_suffix(f".{i + 1}-{phase}.log"))
            try:
                if launched:
                    await launched.wait_ready(args.start_timeout)
                result = await execute(args.tool, _tool_args(args, where))
            finally:
                if launched:
                    launched.stop()
            head = result.headline
            assert head is not None
            metric, higher_is_better = head.name, head.higher_is_better
            runs.append(head.values)
            for j, sample in enumerate(result.samples):
                out.write(json.dumps({"time": time.time(), "run": label, "config": phase, "url": where, "tool": args.tool,
                                      "sample": j, "data": sample}, default=str) + "\n")
            out.write(json.dumps({"time": time.time(), "run": label, "config": phase, "url": where, "tool": args.tool,
                                  "metric": metric, "values": head.values, "failed": result.failed, "total": result.total}) + "\n")
            s = summarize(head.values)
            res.rows.append([label, (where if by_urls else (args.base_cmd if phase == "base" else args.cand_cmd))[:48],
                             s["n"], s["median"], s["min"], s["max"], f"{result.failed}/{result.total}"])
            res.failed += result.failed
            res.total += result.total
            res.samples.append({"run": label, "config": phase, "url": where, "metric": metric, "values": head.values,
                                "result": result.to_dict()})
    if all(runs):
        v = verdict(runs[0], runs[1], runs[2], higher_is_better)
        line = (f"{v.decision}: {metric} candidate {fmt(v.candidate, 3)} vs base {fmt(v.base1, 3)} / {fmt(v.base2, 3)} "
                f"(base spread {fmt(v.spread, 3)}, change {100 * v.change:+.1f}%)")
        res.summary = {"verdict": v.decision, "metric": metric, "higher_is_better": higher_is_better, **vars(v)}
    else:
        line = "no decision: a run of the bracket produced no samples"
        res.summary = {"verdict": "no decision", "metric": metric}
    res.summary["lines"] = [line, f"ledger: {ledger}  summary: {ledger.with_suffix('.md')}"]
    ledger.with_suffix(".md").write_text(
        f"# Bracket: {args.tool} ({metric}, {'higher' if higher_is_better else 'lower'} is better)\n\n"
        + markdown_table(res.headers, res.rows) + f"\n\n**{line}**\n\nRule: the candidate wins only when it beats both base "
        "runs by more than the spread between them.\n")
    return res
