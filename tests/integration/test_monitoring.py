"""The observability pack against the real thing: a Prometheus installed by roles/prometheus_server (from
Debian's package, through playbooks/monitoring.yml) on one test host scrapes another test host that
site.yml converged with the real CPU engine and exporter. Both hosts sit in network namespaces of their
own on one bridge; the engine host's firewall admits the Prometheus host.

The test host reaches Debian's mirror through the bridge's NAT, as the firewall role's apt install does,
so the role installs the real package there rather than the controller running /usr/bin/prometheus.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kimi_service.exporter import GPU_SERIES
from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import TestHost, write_inventory
from tests.support import prometheus
from tests.support.cpu_site import (
    API_KEY,
    COMPILED_ENGINE_ARGS,
    REPO,
    SERVED,
    cpu_site_vars,
    gateway,
    runtime_layer,
)
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

# Short intervals, so a test waits seconds for scrapes and rule evaluations rather than minutes.
INTERVALS = {"kimi_prometheus_scrape_interval": "5s", "kimi_prometheus_scrape_timeout": "4s",
             "kimi_prometheus_evaluation_interval": "5s"}
RULE_GROUPS = {"kimi-engine", "kimi-gpu-xid", "kimi-gpu-hardware", "kimi-exporter", "kimi-slo"}


@dataclass(frozen=True)
class Deployment:
    engine: TestHost  # converged by site.yml
    monitor: TestHost  # group kimi_monitoring: Prometheus
    inventory: Path


@pytest.fixture(scope="module")
def deployment(make_hosts, tmp_path_factory) -> Iterator[Deployment]:
    # The engine host boots with the runtime stage done; Prometheus's host needs no engine.
    engine, monitor = make_hosts(2, runtime_layer(), bare={1})
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=gateway(engine)) as hub:
        site_vars = cpu_site_vars(hub.url, gateway(engine))
        del site_vars["kimi_api_trusted_cidrs"]  # the default: Prometheus's host reads /health and /metrics
        inventory = write_inventory(
            tmp_path_factory.mktemp("monitoring") / "hosts.yml", [engine], groups={"kimi_monitoring": [monitor]},
            extra_vars={
                **site_vars,
                # The product's default engine path: compiled, not --enforce-eager.
                "kimi_vllm_extra_args": COMPILED_ENGINE_ARGS,
                "kimi_firewall_allowed_cidrs": [*site_vars["kimi_firewall_allowed_cidrs"], f"{monitor.address}/32"],
                # The test reads Prometheus's API from the controller; its default address is loopback.
                "kimi_prometheus_listen_address": "0.0.0.0:9090",
                **INTERVALS,
            },
        )
        yield Deployment(engine, monitor, inventory)


@pytest.fixture(scope="module")
def engine(deployment) -> TestHost:
    return deployment.engine


@pytest.fixture(scope="module")
def monitor(deployment) -> TestHost:
    return deployment.monitor


@pytest.fixture(scope="module")
def inventory(deployment) -> Path:
    return deployment.inventory


@pytest.fixture(scope="module")
def render_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rendered")


@pytest.fixture(scope="module")
def converge(inventory, render_dir):
    site = ansible_playbook("site.yml", inventory)
    assert site.returncode == 0, str(site)
    started = time.monotonic()
    monitoring = ansible_playbook("playbooks/monitoring.yml", inventory,
                                  extra_vars={"kimi_monitoring_render_dir": str(render_dir)})
    print(f"\nplaybooks/monitoring.yml, first run: {time.monotonic() - started:.0f} s")
    assert monitoring.returncode == 0, str(monitoring)
    return monitoring


@pytest.fixture(scope="module")
def prom(monitor, converge) -> str:
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


def test_monitoring_playbook_converges_and_a_rerun_changes_nothing(converge, inventory, render_dir, monitor):
    assert monitor.ssh("systemctl is-active prometheus").stdout.strip() == "active"
    again = ansible_playbook("playbooks/monitoring.yml", inventory,
                             extra_vars={"kimi_monitoring_render_dir": str(render_dir)})
    assert again.returncode == 0, str(again)
    assert again.changed == 0, f"not idempotent: {again.changed_tasks()}\n{again}"
    # The controller's copy, for operators with their own Prometheus, is what the server runs.
    assert (render_dir / "prometheus.yml").read_text() == monitor.ssh("cat /etc/prometheus/prometheus.yml").stdout


def test_vllm_metrics_answer_prometheus_without_the_key_and_no_one_else(converge, engine, monitor):
    """Why the scrape config sends no bearer token by default: /metrics answers the monitoring hosts (and the
    host itself) without it, and no other address at all."""
    metrics = monitor.ssh(f"curl -sS -m 10 http://{engine.address}:8000/metrics").stdout
    assert "vllm:num_requests_running" in metrics
    assert httpx.get(f"http://{engine.address}:8000/metrics", timeout=10).status_code == 404
    assert httpx.get(f"http://{engine.address}:8000/v1/models", timeout=10).status_code == 401


def test_prometheus_scrapes_both_endpoints_of_the_host(prom, engine):
    def both_up():
        targets = _api(prom, "targets")["activeTargets"]
        seen = {(t["labels"]["job"], t["labels"]["host"], t["health"]) for t in targets}
        assert seen == {("kimi-vllm", engine.name, "up"), ("kimi-exporter", engine.name, "up")}, targets
    _eventually(both_up)


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


def test_every_series_the_rules_and_dashboard_read_exists(prom, engine):
    """No rule or panel names a series nobody exports. GPU series (DCGM_FI_DEV_* and the per-GPU kimi_*
    series) cannot exist on this host without a GPU: those are checked against the exporter's own list,
    kimi_service.exporter.GPU_SERIES, instead of against Prometheus."""
    client = openai.OpenAI(base_url=f"http://{engine.address}:8000/v1", api_key=API_KEY)
    for _ in range(3):  # requests fill vLLM's latency histograms and token counters
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


def test_a_healthy_host_fires_nothing_and_a_stopped_engine_alerts(prom, engine):
    """Last in this module: it stops the engine."""
    firing = [alert for alert in _api(prom, "alerts")["alerts"] if alert["state"] == "firing"]
    assert firing == []
    engine.ssh("systemctl stop kimi-vllm")

    def engine_down_alert():
        alerts = [alert for alert in _api(prom, "alerts")["alerts"] if alert["labels"]["alertname"] == "KimiEngineDown"]
        assert [alert["labels"]["host"] for alert in alerts] == [engine.name]
        assert alerts[0]["state"] in {"pending", "firing"}
        assert "systemctl status kimi-vllm" in alerts[0]["annotations"]["description"]
    _eventually(engine_down_alert, timeout=90)
