"""Property-based fuzzing of the OpenAI routes with schemathesis, from the server's own
/openapi.json: bodies valid by the schema and bodies that break it, through the real HTTP stack.
No answer may be a 5xx, and the server must be healthy afterwards. Bounded in examples per route.
"""

from __future__ import annotations

import asyncio

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402 - after the importorskip

from test_server import LiveServer, _engine  # noqa: E402
from tandem.builtin import ensure_builtin_model  # noqa: E402
from tandem.config import ServerConfig  # noqa: E402
from tandem.server.app import create_app  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLES_PER_ROUTE = 40
STATUSES: list[int] = []  # every answer the fuzzer got, for the check that it reached both sides


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = _engine(ensure_builtin_model(tmp_path_factory.mktemp("builtin")), max_num_seqs=8)
    cfg = ServerConfig(max_n=4, max_prompts=4)
    app = create_app(engine, cfg)
    server = LiveServer(app, cfg)
    yield server
    server.stop()
    app.state.tandem.close()
    asyncio.run(engine.shutdown(1.0))


@pytest.fixture(scope="module")
def openapi_schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("openapi_schema")


@schema.include(method="POST").parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_post_routes_never_answer_5xx(case, live) -> None:
    # Keep generations short: the fuzzer is after the server's handling of odd values, not output.
    # A chat body without a limit would fill the context (~1 s a case on the CPU: most of this
    # test's time); that default is tested in test_engine.py (max_tokens=None fills the context).
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(key), int) and case.body[key] > 8:
                case.body[key] = 8
        if case.body.get("max_tokens") is None and case.body.get("max_completion_tokens") is None:
            case.body["max_tokens"] = 8
    response = case.call(timeout=60)
    STATUSES.append(response.status_code)
    case.validate_response(response, checks=[schemathesis.checks.not_a_server_error])
    assert response.status_code < 500, response.text


def test_the_fuzzing_reached_both_sides_and_the_server_is_healthy_after(live) -> None:
    import httpx

    assert any(200 <= s < 300 for s in STATUSES), STATUSES  # valid bodies were generated and served
    assert any(400 <= s < 500 for s in STATUSES), STATUSES  # and invalid ones refused
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
