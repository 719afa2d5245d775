"""Replicas behind one endpoint: two replicas (groups kimi_hosts and kimi_replicas) and HAProxy on a
third host (group kimi_balancer), each in a network namespace of its own, converged once by site.yml
with the real CPU engine. Clients talk to the balancer only.

A client loop of streamed chat completions (no client-side retries) counts errors while a replica is
stopped and while a broken upgrade rolls back: the balancer must hide both, so the count is zero.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory
from tests.support.cpu_site import (
    API_KEY,
    REPO,
    SERVED,
    SMALL_ENGINE_ARGS,
    cpu_site_vars,
    gateway,
    own_core_each,
    runtime_layer,
)
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

BALANCER_PORT = 8080
_STATUS_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<state>.+?)\s+in flight (?P<in_flight>\d+)\s+last check (?P<check>\S*)")


@pytest.fixture(scope="module")
def hosts(make_hosts):
    # The replicas boot with the runtime stage done; the balancer needs no engine.
    return make_hosts(3, runtime_layer(), bare={0})


@pytest.fixture(scope="module")
def balancer(hosts):
    return hosts[0]


@pytest.fixture(scope="module")
def replicas(hosts):
    return hosts[1:]


@pytest.fixture(scope="module")
def hub(balancer):
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=gateway(balancer)) as server:
        yield server


@pytest.fixture(scope="module")
def replica_host_vars(replicas):
    # A replica restarted beside a busy one must not starve on the core they would share.
    return own_core_each(replicas)


@pytest.fixture(scope="module")
def inventory(balancer, replicas, replica_host_vars, hub, tmp_path_factory):
    site_vars = cpu_site_vars(hub.url, gateway(balancer))
    del site_vars["kimi_api_trusted_cidrs"]  # the default: the balancer alone reads /health and /metrics
    return write_inventory(
        tmp_path_factory.mktemp("replicas") / "hosts.yml", replicas,
        groups={"kimi_replicas": replicas, "kimi_balancer": [balancer]},
        extra_vars={
            **site_vars,
            "kimi_balancer_port": BALANCER_PORT,
            # Download once, copy host to host (the weights role's fan-out).
            "kimi_model_fanout": True,
            "kimi_balancer_check_interval_sec": 1,
        },
        host_vars=replica_host_vars,
    )


@pytest.fixture(scope="module")
def converge(inventory):
    started = time.monotonic()
    run = ansible_playbook("site.yml", inventory)
    print(f"\nfirst converge of two replicas and a balancer: {time.monotonic() - started:.0f} s")
    assert run.returncode == 0, str(run)
    return run


@pytest.fixture(scope="module")
def endpoint(balancer) -> str:
    return f"http://{balancer.address}:{BALANCER_PORT}/v1"


def _servers(balancer) -> dict[str, dict[str, str]]:
    """HAProxy's view of each replica, as `kimi-balancer status` prints it."""
    lines = balancer.ssh("kimi-balancer status").stdout.splitlines()
    return {m["name"]: m.groupdict() for m in map(_STATUS_LINE.match, lines) if m}


def _wait_state(balancer, name: str, state: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (current := _servers(balancer)[name]["state"]) != state:
        assert time.monotonic() < deadline, f"{name} is {current} after {timeout:.0f} s, not {state}"
        time.sleep(0.5)


def _main_pid(host) -> int:
    return int(host.ssh("systemctl show -p MainPID --value kimi-vllm").stdout.strip())


class ClientLoop:
    """Streamed chat completions through the balancer on a few threads, one after another with a short
    pause (so the engines on a 2-core machine still have time to start), until the block ends. A
    request counts as served only when its stream ended with a finish reason."""

    def __init__(self, endpoint: str, workers: int = 2, pause: float = 0.2):
        self.endpoint, self.workers, self.pause = endpoint, workers, pause
        self.served, self.errors = 0, []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> ClientLoop:
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _run(self) -> None:
        # No retries in the client: every failure the balancer lets through is counted.
        client = openai.OpenAI(base_url=self.endpoint, api_key=API_KEY, max_retries=0, timeout=120)
        while not self._stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model=SERVED, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, stream=True,
                )
                finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
                if not finish:
                    raise RuntimeError("the stream ended without a finish reason")
                with self._lock:
                    self.served += 1
            except Exception as exc:  # every kind of failure is what is being counted
                with self._lock:
                    self.errors.append(f"{time.strftime('%H:%M:%S')} {exc!r}")
            self._stop.wait(self.pause)

    def report(self, balancer) -> str:
        """The errors by kind, and what HAProxy logged for the requests that did not end well."""
        kinds = Counter(error.split(" ", 1)[1][:160] for error in self.errors)
        log = balancer.ssh("journalctl -t haproxy --no-pager -o cat | grep -F 'POST ' | grep -v ' 200 .* ---- '",
                           check=False).stdout
        return (f"{len(self.errors)} failed of {self.served + len(self.errors)}: {dict(kinds)}\n"
                f"HAProxy's log of unsuccessful requests (last 30):\n" + "\n".join(log.splitlines()[-30:]))

    def wait_served(self, more: int, timeout: float = 120) -> None:
        """Block until `more` further requests have been served."""
        target, deadline = self.served + more, time.monotonic() + timeout
        while self.served < target:
            assert time.monotonic() < deadline, f"only {self.served} served, errors: {self.errors[-5:]}"
            time.sleep(0.2)


def test_site_converges_behind_one_endpoint(converge, balancer, replicas, replica_host_vars, hub, endpoint):
    assert f"endpoint: http://{balancer.address}:{BALANCER_PORT}/v1" in converge.output
    assert balancer.ssh("systemctl is-active haproxy").stdout.strip() == "active"
    assert balancer.ssh("systemctl cat kimi-vllm.service", check=False).returncode != 0, "no engine on the balancer"
    assert {name: s["state"] for name, s in _servers(balancer).items()} == {r.name: "UP" for r in replicas}
    # The weights came from the hub once; the second replica copied them from the first.
    size = (ensure_tiny_model() / "model.safetensors").stat().st_size
    assert hub.sent_bytes("model.safetensors") == size
    # kimi_vllm_extra_env reached each engine: each is bound to the core its host variables name.
    for replica in replicas:
        core = replica_host_vars[replica.name]["kimi_vllm_extra_env"]["VLLM_CPU_OMP_THREADS_BIND"]
        journal = replica.ssh("journalctl -u kimi-vllm --no-pager -o cat").stdout
        assert f"VLLM_CPU_OMP_THREADS_BIND='{core}'" in journal, journal[-3000:]


def test_the_key_is_checked_by_the_replicas_and_requests_reach_both(converge, balancer, replicas, endpoint):
    assert httpx.get(f"{endpoint}/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint, api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=endpoint, api_key=API_KEY, max_retries=0)
    for _ in range(6):
        stream = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        )
        assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
    stat = balancer.ssh("echo 'show stat kimi_replicas 4 -1' | socat stdio /run/haproxy/admin.sock").stdout
    sessions = {row.split(",")[1]: int(row.split(",")[7]) for row in stat.splitlines() if not row.startswith("#")
                and row.count(",") > 7}
    assert all(sessions[r.name] > 0 for r in replicas), f"least connections spreads the requests: {sessions}"


def test_only_the_balancer_reaches_a_replicas_api(converge, replicas):
    first, second = replicas
    for port in (8000, 8001):
        probe = second.ssh(f"curl -sS -m 3 -o /dev/null http://{first.address}:{port}/", check=False)
        assert probe.returncode != 0, f"a replica's port {port} must be closed to hosts that are not the balancer"


def _engine_routes(replica) -> dict[str, list[str]]:
    """vLLM's route table as the installed engine publishes it (its OpenAI schema, read on the host), plus
    the mounts and documentation routes the schema leaves out."""
    schema = json.loads(replica.ssh("curl -sS -m 10 http://127.0.0.1:8000/openapi.json").stdout)
    routes = {path: sorted(method.upper() for method in methods) for path, methods in schema["paths"].items()}
    for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):
        routes.setdefault(path, ["GET"])
    return routes


def test_every_engine_route_but_the_openai_api_is_closed_to_other_hosts(converge, balancer, replicas, endpoint):
    replica = replicas[0]
    routes = _engine_routes(replica)
    assert "/invocations" in routes and "/v1/chat/completions" in routes, sorted(routes)
    answers: dict[tuple[str, str], int] = {}
    with httpx.Client(base_url=f"http://{replica.address}:8000", timeout=30) as client:
        for path, methods in routes.items():
            url = re.sub(r"\{[^}]+\}", "x", path)
            for method in methods:
                answers[method, path] = client.request(method, url, json={}).status_code
                if not path.startswith("/v1/"):
                    keyed = client.request(method, url, json={}, headers={"Authorization": f"Bearer {API_KEY}"})
                    answers[method, f"{path} (with the key)"] = keyed.status_code
    wrong = {f"{method} {path}": status for (method, path), status in answers.items()
             if status != (401 if path.startswith("/v1/") else 404)}
    assert wrong == {}, f"from the controller, /v1/ must want the key and the rest be absent: {wrong}"
    # The balancer (a trusted address) reads /health and /metrics, and nothing else outside /v1/.
    def from_balancer(path: str) -> str:
        return balancer.ssh(f"curl -s -o /dev/null -w '%{{http_code}}' -m 10 -X POST "
                            f"http://{replica.address}:8000{path}", check=False).stdout
    assert balancer.ssh(f"curl -s -o /dev/null -w '%{{http_code}}' -m 10 http://{replica.address}:8000/health"
                        ).stdout == "200"
    assert "vllm:" in balancer.ssh(f"curl -sS -m 10 http://{replica.address}:8000/metrics").stdout
    assert {path: from_balancer(path) for path in ("/invocations", "/tokenize")} == {
        "/invocations": "404", "/tokenize": "404"}
    # Through the balancer, clients get the OpenAI API only (the replicas would trust its address).
    for path in ("/health", "/metrics", "/invocations"):
        assert httpx.get(f"{endpoint.removesuffix('/v1')}{path}", timeout=10).status_code == 404, path
    models = httpx.get(f"{endpoint}/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert models.status_code == 200, models.text


def test_the_balancer_checks_readiness_not_vllms_health(converge, balancer, replicas):
    ready = balancer.ssh(f"curl -sS -m 5 http://{replicas[0].address}:8001/ready").stdout
    assert ready.strip() == '{"ready": true, "state": "ready"}'
    assert "http-check send meth GET uri /ready" in balancer.ssh("cat /etc/haproxy/haproxy.cfg").stdout


def test_second_run_changes_nothing(converge, inventory):
    second = ansible_playbook("site.yml", inventory)
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent: {second.changed_tasks()}\n{second}"


def test_broken_upgrade_rolls_back_and_the_endpoint_never_stops_answering(converge, balancer, replicas, inventory,
                                                                           endpoint):
    first, second = replicas
    venv = first.ssh("readlink /opt/kimi-service/venv").stdout.strip()
    config = first.ssh("sha256sum /etc/kimi-service/config.yaml").stdout.split()[0]
    untouched = _main_pid(second)
    # The new version's engine refuses to start: a vLLM flag it does not know.
    broken = {"kimi_vllm_extra_args": [*SMALL_ENGINE_ARGS, "--no-such-vllm-flag"]}
    with ClientLoop(endpoint) as loop:
        loop.wait_served(4)
        run = ansible_playbook("playbooks/upgrade.yml", inventory, extra_vars=broken)
        loop.wait_served(4)
    assert run.returncode != 0, str(run)
    assert f"The upgrade of {first.name} failed" in run.output, str(run)
    assert f"it is back on {venv} and serving. No further host was touched." in run.said, str(run)
    assert first.ssh("readlink /opt/kimi-service/venv").stdout.strip() == venv
    assert first.ssh("sha256sum /etc/kimi-service/config.yaml").stdout.split()[0] == config
    assert _main_pid(second) == untouched, "the upgrade stopped before the next replica"
    assert {name: s["state"] for name, s in _servers(balancer).items()} == {r.name: "UP" for r in replicas}
    # Drained, taken out, then back once it served its previous version again; the other one never.
    log = balancer.ssh("journalctl -t haproxy --no-pager -o cat | grep -v -F 'POST '").stdout
    events = [m.group(1) for m in re.finditer(rf"^Server kimi_replicas/{first.name} (.+?)\.", log, re.MULTILINE)]
    assert events[-3:] == [
        "enters drain state", "is going DOWN for maintenance", "is UP/READY (leaving forced maintenance)",
    ], log
    assert not re.search(rf"kimi_replicas/{second.name} (enters drain|.*maintenance)", log), log
    assert loop.errors == [], loop.report(balancer)


def test_stopping_a_replica_keeps_requests_succeeding(converge, balancer, replicas, endpoint):
    """Last in this module: the stopped replica stays down (its coming back is the roll-back test's)."""
    stopped = replicas[0]
    with ClientLoop(endpoint) as loop:
        loop.wait_served(4)
        stopped.ssh("systemctl stop kimi-vllm", timeout=180)
        # Out of the rotation by its /ready alone, before vLLM was told to stop.
        _wait_state(balancer, stopped.name, "DOWN")
        journal = stopped.ssh("journalctl -u kimi-vllm --no-pager -o cat").stdout
        assert "withdrawing from load balancers" in journal, journal[-5000:]
        # HAProxy resets each check's connection once it has the status: no error for that.
        assert "ConnectionResetError" not in journal, journal[-5000:]
        loop.wait_served(10)
    assert loop.errors == [], loop.report(balancer)
