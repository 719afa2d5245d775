"""The route gate in vLLM's API server: the OpenAI API for everyone, /health and /metrics for the trusted
addresses too, every route for the host itself, 404 for the rest. The converged-host walk of vLLM's real
route table is tests/integration/test_replicas.py."""

from __future__ import annotations

import asyncio

import pytest

from kimi_service import launcher
from kimi_service.config import ConfigError, parse_config
from kimi_service.route_gate import TRUSTED_CLIENTS_ENV, RouteGate, parse_networks, route_allowed

TRUSTED = parse_networks(["10.0.0.5", "192.168.7.0/24", "fd00::/64"])


@pytest.mark.parametrize(("path", "client", "allowed"), [
    ("/v1/chat/completions", "203.0.113.9", True),
    ("/v1/models", "2001:db8::1", True),
    ("/invocations", "203.0.113.9", False),
    ("/tokenize", "10.0.0.5", False),
    ("/pause", "192.168.7.20", False),
    ("/health", "203.0.113.9", False),
    ("/health", "10.0.0.5", True),
    ("/metrics", "192.168.7.20", True),
    ("/metrics/", "fd00::7", True),
    ("/metrics", "10.0.0.6", False),
    ("/healthz", "10.0.0.5", False),
    ("/v1", "203.0.113.9", False),
    ("/docs", "203.0.113.9", False),
    ("/invocations", "127.0.0.1", True),
    ("/invocations", "::1", True),
    ("/invocations", "::ffff:127.0.0.1", True),
    ("/health", "::ffff:10.0.0.5", True),
    ("/invocations", None, True),
    ("/health", "testclient", False),
])
def test_route_allowed(path, client, allowed):
    assert route_allowed(path, client, TRUSTED) is allowed


def _call(gate: RouteGate, scope: dict) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    return sent


async def _app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def _http(path: str, client: str, root_path: str = "") -> dict:
    return {"type": "http", "path": path, "root_path": root_path, "client": (client, 40000), "method": "POST"}


def test_a_refused_route_gets_the_404_an_unknown_route_gets_and_never_reaches_the_app():
    sent = _call(RouteGate(_app, TRUSTED), _http("/invocations", "203.0.113.9"))
    assert sent[0]["status"] == 404
    assert sent[1]["body"] == b'{"detail":"Not Found"}'


def test_an_allowed_route_reaches_the_app():
    assert _call(RouteGate(_app, TRUSTED), _http("/v1/completions", "203.0.113.9"))[1]["body"] == b"served"


def test_the_root_path_is_stripped_before_the_check():
    gate = RouteGate(_app, TRUSTED)
    assert _call(gate, _http("/api/v1/models", "203.0.113.9", root_path="/api"))[0]["status"] == 200
    assert _call(gate, _http("/api/tokenize", "203.0.113.9", root_path="/api"))[0]["status"] == 404


def test_a_refused_websocket_is_closed_before_it_is_accepted():
    scope = {"type": "websocket", "path": "/tokenize", "client": ("203.0.113.9", 1)}
    assert _call(RouteGate(_app, TRUSTED), scope) == [{"type": "websocket.close", "code": 1008}]


def test_lifespan_passes_through():
    assert _call(RouteGate(_app, TRUSTED), {"type": "lifespan"})[1]["body"] == b"served"


def test_the_gate_reads_its_trusted_addresses_from_the_environment(monkeypatch):
    monkeypatch.setenv(TRUSTED_CLIENTS_ENV, "10.1.2.3, 10.9.0.0/16")
    gate = RouteGate(_app)
    assert _call(gate, _http("/metrics", "10.9.4.4"))[0]["status"] == 200
    assert _call(gate, _http("/metrics", "10.1.2.4"))[0]["status"] == 404


def test_config_takes_trusted_clients_and_names_a_bad_one():
    api = parse_config({"model": {"path": "/m"}, "api": {"trusted_clients": ["10.0.0.5", "10.2.0.0/16"]}}).api
    assert api.trusted_clients == ("10.0.0.5/32", "10.2.0.0/16")
    with pytest.raises(ConfigError, match=r"api.trusted_clients: 'balancer.example' is not an IP address"):
        parse_config({"model": {"path": "/m"}, "api": {"trusted_clients": ["balancer.example"]}})


def test_serve_loads_the_gate_into_the_api_server_but_not_into_a_headless_follower():
    argv = launcher.engine_argv(["vllm", "serve", "/m", "--port", "8000"], "py", 30)
    assert argv[argv.index("--middleware") + 1] == "kimi_service.route_gate.RouteGate"
    follower = parse_config({"model": {"path": "/m"}, "cluster": {
        "node_rank": 1, "addresses": ["10.0.0.1", "10.0.0.2"]}}).cluster
    assert "--middleware" not in launcher.engine_argv(["vllm", "serve", "/m"], "py", 30, follower)


def test_the_engine_environment_carries_the_trusted_addresses():
    config = parse_config({"model": {"path": "/m"}, "api": {"trusted_clients": ["10.0.0.5"]}})
    env = launcher.engine_env({}, {}, [], config)
    assert env[TRUSTED_CLIENTS_ENV] == "10.0.0.5/32"
    with pytest.raises(ConfigError, match=TRUSTED_CLIENTS_ENV):
        parse_config({"model": {"path": "/m"}, "plan": {"extra_env": {TRUSTED_CLIENTS_ENV: "0.0.0.0/0"}}})
