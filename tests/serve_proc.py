"""`tandem serve` in a subprocess, for the end-to-end tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> tuple[subprocess.Popen, str]:
    """Start `tandem serve ARGS --port P` in its own process group and wait until /health is 200.
    Its output goes to a temporary file (a pipe nobody reads could fill and stall the server);
    when it exits or does not become healthy in `timeout` s, the error carries the output's tail."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", *args, "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace")[-2000:]
    raise RuntimeError(f"tandem serve {' '.join(args)} did not become healthy (exit {proc.returncode}): {tail}")
