"""The plain install (`pip install -e .`, no test extra) must be enough to run every `tandem` command:
each third-party package that tandem/ imports is a declared runtime dependency, and the serving
commands do not import the client-side bench code."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imported only on CUDA; torch's CUDA builds bring it (pyproject.toml says why it is not listed).
NOT_DECLARED = {"triton"}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module name -> the files of tandem/ that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tandem").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "tandem" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {_normalize(re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0]) for d in deps}


def test_every_runtime_import_is_a_declared_dependency():
    imports = _third_party_imports()
    assert {"torch", "fastapi", "httpx"} <= imports.keys()  # the scan sees the imports it must
    dists = importlib.metadata.packages_distributions()
    declared = _declared()
    missing = []
    for module, files in sorted(imports.items()):
        if module in NOT_DECLARED:
            continue
        names = {_normalize(d) for d in dists.get(module, [module])}
        if not names & declared:
            missing.append(f"{module} (from {', '.join(sorted(names))}; imported by {', '.join(sorted(files))})")
    assert not missing, "imported by tandem/ but not in pyproject.toml's dependencies: " + "; ".join(missing)


def test_serving_commands_do_not_import_the_bench_client():
    code = (
        "import sys\n"
        "from tandem.cli import build_parser\n"
        "parser = build_parser()\n"
        "parser.parse_args(['serve', 'tandem-demo'])\n"
        "bad = sorted(m for m in sys.modules if m == 'httpx' or m.startswith('tandem.bench'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_tandem_help_lists_bench_and_bench_help_lists_its_tools():
    top = subprocess.run([sys.executable, "-m", "tandem.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    assert "bench" in top.stdout and "serve" in top.stdout
    bench = subprocess.run([sys.executable, "-m", "tandem.cli", "bench", "--help"], capture_output=True, text=True,
                           timeout=120)
    assert bench.returncode == 0, bench.stderr
    assert bench.stdout.startswith("usage: tandem bench") and "streamgap" in bench.stdout
