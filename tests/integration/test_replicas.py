"""Replicas behind one endpoint, and the observability pack watching them: two replicas (groups kimi_hosts
and kimi_replicas), HAProxy on a third host (group kimi_balancer) and Prometheus on a fourth (group
kimi_monitoring), each in a network namespace of its own. site.yml converges the replicas and the balancer
once, with the real CPU engine; playbooks/monitoring.yml installs Prometheus from Debian's package (the host
reaches Debian's mirror through the bridge's NAT) and it scrapes both replicas. Clients talk to the balancer
only.

The second replica runs vLLM's default compiled path (torch.compile, the C++ compiler the runtime stage
installs), as a real host does; no test restarts it. The first runs --enforce-eager: the tests restart it.

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

from kimi_service.exporter import GPU_SERIES
from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory
from tests.support import prometheus
from tests.support.cpu_site import (
    API_KEY,
    COMPILED_ENGINE_ARGS,
    REPO,
    SERVED,
    SMALL_ENGINE_ARGS,
    cpu_site_vars,
    engine_placement,
    gateway,
    runtime_layer,
)
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

BALANCER_PORT = 8080
# Short intervals, so a test waits seconds for scrapes and rule evaluations rather than minutes.
PROMETHEUS_INTERVALS = {"kimi_prometheus_scrape_interval": "5s", "kimi_prometheus_scrape_timeout": "4s",
                        "kimi_prometheus_evaluation_interval": "5s"}
RULE_GROUPS = {"kimi-engine", "kimi-gpu-xid", "kimi-gpu-hardware", "kimi-exporter", "kimi-slo"}
_STATUS_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<state>.+?)\s+in flight (?P<in_flight>\d+)\s+last check (?P<check>\S*)")


@pytest.fixture(scope="module")
def hosts(make_hosts):
    # The replicas boot with the runtime stage done; the balancer and Prometheus's host need no engine.
    return make_hosts(4, runtime_layer(), bare={0, 3})


@pytest.fixture(scope="module")
def balancer(hosts):
    return hosts[0]


@pytest.fixture(scope="module")
def replicas(hosts):
    return hosts[1:3]


@pytest.fixture(scope="module")
def monitor(hosts):
    return hosts[3]


@pytest.fixture(scope="module")
def hub(balancer):
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=gateway(balancer)) as server:
        yield server


@pytest.fixture(scope="module")
def replica_host_vars(replicas):
    # A replica restarted beside a busy one must not starve on the core they would share.
    host_vars = engine_placement(replicas)
    # The product's default engine path, not --enforce-eager, on the replica no test restarts.
    host_vars[replicas[1].name]["kimi_vllm_extra_args"] = COMPILED_ENGINE_ARGS
    return host_vars


@pytest.fixture(scope="module")
def inventory(balancer, replicas, monitor, replica_host_vars, hub, tmp_path_factory):
    site_vars = cpu_site_vars(hub.url, gateway(balancer))
    # The default trust: the balancer and the monitoring hosts alone read /health and /metrics.
    del site_vars["kimi_api_trusted_cidrs"]
    return write_inventory(
        tmp_path_factory.mktemp("replicas") / "hosts.yml", replicas,
        groups={"kimi_replicas": replicas, "kimi_balancer": [balancer], "kimi_monitoring": [monitor]},
        extra_vars={
            **site_vars,
            "kimi_balancer_port": BALANCER_PORT,
            # Download once, copy host to host (the weights role's fan-out).
            "kimi_model_fanout": True,
            "kimi_balancer_check_interval_sec": 1,
            "kimi_firewall_allowed_cidrs": [*site_vars["kimi_firewall_allowed_cidrs"], f"{monitor.address}/32"],
            # The test reads Prometheus's API from the controller; its default address is loopback.
            "kimi_prometheus_listen_address": "0.0.0.0:9090",
            **PROMETHEUS_INTERVALS,
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


@pytest.fixture(scope="module")
def render_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rendered")


@pytest.fixture(scope="module")
def monitoring(converge, inventory, render_dir):
    started = time.monotonic()
    run = ansible_playbook("playbooks/monitoring.yml", inventory,
                           extra_vars={"kimi_monitoring_render_dir": str(render_dir)})
    print(f"\nplaybooks/monitoring.yml, first run: {time.monotonic() - started:.0f} s")
    assert run.returncode == 0, str(run)
    return run


@pytest.fixture(scope="module")
def prom(monitor, monitoring) -> str:
    return f"http://{monitor.address}:9090"


def _api(prom: str, path: str, **params) -> dict | list:
    reply = httpx.get(f"{prom}/api/v1/{path}", params=params, timeout=30)
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", f"{path} {params}: {reply.text}"
    return body["data"]


def _eventually(check, timeout: float = 120, every: float = 2):
    """Call `check` until it returns without an AssertionError; the last error is raised."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(every)


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


# ---------------------------------------------------------------------------------------------
# Prometheus on its own host (playbooks/monitoring.yml) watching the replicas


def test_monitoring_playbook_converges_and_a_rerun_changes_nothing(monitoring, inventory, render_dir, monitor):
    assert monitor.ssh("systemctl is-active prometheus").stdout.strip() == "active"
    again = ansible_playbook("playbooks/monitoring.yml", inventory,
                             extra_vars={"kimi_monitoring_render_dir": str(render_dir)})
    assert again.returncode == 0, str(again)
    assert again.changed == 0, f"not idempotent: {again.changed_tasks()}\n{again}"
    # The controller's copy, for operators with their own Prometheus, is what the server runs.
    assert (render_dir / "prometheus.yml").read_text() == monitor.ssh("cat /etc/prometheus/prometheus.yml").stdout


def test_vllm_metrics_answer_prometheus_without_the_key_and_no_one_else(converge, replicas, monitor):
    """Why the scrape config sends no bearer token by default: /metrics answers the monitoring hosts (and the
    host itself) without it, and no other address at all."""
    for replica in replicas:
        metrics = monitor.ssh(f"curl -sS -m 10 http://{replica.address}:8000/metrics").stdout
        assert "vllm:num_requests_running" in metrics, replica.name
        assert httpx.get(f"http://{replica.address}:8000/metrics", timeout=10).status_code == 404
        assert httpx.get(f"http://{replica.address}:8000/v1/models", timeout=10).status_code == 401


def test_prometheus_scrapes_both_endpoints_of_each_replica(prom, replicas):
    def all_up():
        targets = _api(prom, "targets")["activeTargets"]
        seen = {(t["labels"]["job"], t["labels"]["host"], t["health"]) for t in targets}
        assert seen == {(job, replica.name, "up") for job in ("kimi-vllm", "kimi-exporter") for replica in replicas}, (
            targets)
    _eventually(all_up)


def test_rules_are_loaded_and_evaluate_without_errors(prom):
    def evaluated():
        groups = _api(prom, "rules")["groups"]
        assert {group["name"] for group in groups} == RULE_GROUPS
        rules = [rule for group in groups for rule in group["rules"]]
        assert all(rule["lastEvaluation"] > "0001-01-01T00:00:00Z" for rule in rules), "not evaluated yet"
        assert [rule for rule in rules if rule["health"] != "ok"] == []
    _eventually(evaluated)
    slo = _api(prom, "query", query="kimi:slo_ttft_p99_seconds")["result"]
    assert [float(sample["value"][1]) for sample in slo] == [2.5]


def test_every_series_the_rules_and_dashboard_read_exists(prom, endpoint):
    """No rule or panel names a series nobody exports. GPU series (DCGM_FI_DEV_* and the per-GPU kimi_*
    series) cannot exist on these hosts without a GPU: those are checked against the exporter's own list,
    kimi_service.exporter.GPU_SERIES, instead of against Prometheus."""
    client = openai.OpenAI(base_url=endpoint, api_key=API_KEY, max_retries=0)
    for _ in range(4):  # requests fill vLLM's latency histograms and token counters, on both replicas
        stream = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=8, stream=True)
        assert list(stream)
    used = prometheus.names_used()
    assert {name for name in used if name.startswith("DCGM_")} <= GPU_SERIES
    expected = used - GPU_SERIES

    def all_present():
        present = set(_api(prom, "label/__name__/values"))
        assert expected - present == set(), "read by a rule or panel, not in Prometheus"
    _eventually(all_present)


def test_every_dashboard_expression_runs_on_prometheus(prom):
    for expr in prometheus.dashboard_expressions():
        _api(prom, "query", query=expr)


def test_healthy_replicas_fire_no_alert(prom):
    """Before the tests that stop an engine; the last one asserts the alert a stopped engine raises."""
    firing = [alert for alert in _api(prom, "alerts")["alerts"] if alert["state"] == "firing"]
    assert firing == []


# ---------------------------------------------------------------------------------------------
# Changes and failures behind the balancer


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
    # The engine's own first error line leads the failure, not only a journal tail.
    assert re.search(r"root cause: vLLM failed to start: .*--no-such-vllm-flag", run.output), str(run)
    assert first.ssh("readlink /opt/kimi-service/venv").stdout.strip() == venv
    assert first.ssh("sha256sum /etc/kimi-service/config.yaml").stdout.split()[0] == config
    assert _main_pid(second) == untouched, "the upgrade stopped before the next replica"
    # Drained, taken out, then back once it served its previous version again; the other one never.
    log = balancer.ssh("journalctl -t haproxy --no-pager -o cat | grep -v -F 'POST '").stdout
    assert {name: s["state"] for name, s in _servers(balancer).items()} == {r.name: "UP" for r in replicas}, log
    events = [m.group(1) for m in re.finditer(rf"^Server kimi_replicas/{first.name} (.+?)\.", log, re.MULTILINE)]
    assert events[-3:] == [
        "enters drain state", "is going DOWN for maintenance", "is UP/READY (leaving forced maintenance)",
    ], log
    assert not re.search(rf"kimi_replicas/{second.name} (enters drain|.*maintenance)", log), log
    assert loop.errors == [], loop.report(balancer)


def test_stopping_a_replica_keeps_requests_succeeding_and_raises_its_alert(converge, balancer, replicas, endpoint,
                                                                          prom):
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

    def engine_down_alert():
        alerts = [alert for alert in _api(prom, "alerts")["alerts"] if alert["labels"]["alertname"] == "KimiEngineDown"]
        assert [alert["labels"]["host"] for alert in alerts] == [stopped.name]
        assert alerts[0]["state"] in {"pending", "firing"}
        assert "systemctl status kimi-vllm" in alerts[0]["annotations"]["description"]
    _eventually(engine_down_alert, timeout=90)
