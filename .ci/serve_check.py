"""Check a running `tandem serve` the way the README's first example uses it (standard library only,
so it runs outside the fresh virtual environment whose install it checks).

    python3 .ci/serve_check.py README.md http://127.0.0.1:PORT SERVER_PID

Waits for /health (failing at once if the server process exits), sends the README's chat example
body to /v1/chat/completions and checks that the reply's `content` is the one the README shows.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

HEALTH_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0


def readme_example(readme: str) -> tuple[dict, str]:
    """The first chat example's request body and the `content` of the reply shown after it."""
    match = re.search(r"curl \S+/v1/chat/completions .*?-d '(\{.*?\})'\n```(.*?)```json\n(.*?)```", readme, re.S)
    if match is None:
        raise SystemExit("serve check: README.md has no chat example (curl ... -d '{...}') followed by its reply")
    body = json.loads(match.group(1))
    reply = json.loads(match.group(3))
    return body, reply["choices"][0]["message"]["content"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_healthy(url: str, pid: int) -> float:
    start = time.monotonic()
    while time.monotonic() - start < HEALTH_TIMEOUT_S:
        if not alive(pid):
            raise SystemExit(f"serve check: tandem serve (pid {pid}) exited before /health answered 200")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"serve check: /health was not 200 within {HEALTH_TIMEOUT_S:.0f} s")


def chat(url: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"serve check: the README's chat example got HTTP {e.code}: {e.read()[:500]!r}") from None


def main(readme_path: str, url: str, pid: str) -> None:
    with open(readme_path, encoding="utf-8") as f:
        body, expected = readme_example(f.read())
    waited = wait_healthy(url, int(pid))
    start = time.monotonic()
    reply = chat(url, body)
    content = reply["choices"][0]["message"]["content"]
    if content != expected:
        raise SystemExit(f"serve check: the README shows content {expected!r}, the server answered {content!r}")
    print(f"serve check: healthy after {waited:.1f} s; README chat example answered {content!r} "
          f"in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
