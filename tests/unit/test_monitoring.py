"""The observability pack (monitoring/): alert rules, their promtool unit tests, the Grafana dashboard
and the scrape configuration playbooks/monitoring.yml renders, all checked by the real promtool.

The Prometheus server scraping a real engine and exporter is tests/integration/test_replicas.py.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.core import CollectorRegistry

from kimi_service import exporter
from kimi_service import nvml as nvml_reader
from tests.hosts.ansible import ansible_playbook
from tests.support import prometheus
from tests.support.fake_pynvml import FakeNvml, NVMLError

# Codes the issue names as critical, each of which must reach an alert of its own meaning.
CRITICAL_XIDS = {"48", "62", "64", "74", "79", "94", "95", "119", "120"}


def _promtool_ok(result) -> None:
    assert result.returncode == 0, f"promtool failed:\n{result.stdout}\n{result.stderr}"


def test_promtool_is_installed():
    assert prometheus.PROMTOOL.exists(), "scripts/bootstrap.sh installs Debian's prometheus package"


def test_rules_pass_promtool_check():
    _promtool_ok(prometheus.promtool("check", "rules", *prometheus.rule_files()))


@pytest.mark.parametrize("alert", prometheus.alerts(), ids=lambda rule: rule["alert"])
def test_every_alert_says_what_it_is_how_bad_and_what_to_do(alert):
    assert alert["labels"]["severity"] in {"critical", "warning"}
    assert alert["annotations"]["summary"]
    # The description is the operator's runbook: what happened and what to do about it.
    assert len(alert["annotations"]["description"]) > 150


def test_alert_names_are_unique():
    names = [rule["alert"] for rule in prometheus.alerts()]
    assert len(names) == len(set(names))


def test_every_critical_xid_has_an_alert():
    covered = set()
    for rule in prometheus.alerts():
        for selector in rule["expr"].split("kimi_gpu_xid_errors_total")[1:]:
            if selector.startswith('{xid="'):
                covered.add(selector[6:].split('"')[0])
            elif selector.startswith('{xid=~"'):
                covered.update(selector[7:].split('"')[0].split("|"))
    assert covered == CRITICAL_XIDS


def _rule_tests() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in sorted(prometheus.RULE_TESTS_DIR.glob("*.yml"))]


def test_every_alert_is_tested_firing_and_quiet():
    firing, quiet = set(), set()
    for document in _rule_tests():
        for case in document["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check["exp_alerts"] else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in prometheus.alerts()}
    assert names - firing == set(), "alerts no test sees firing"
    assert names - quiet == set(), "alerts no test sees staying quiet"


def test_rule_unit_tests_pass(tmp_path):
    for test_file in prometheus.rule_tests_without_annotations(tmp_path):
        _promtool_ok(prometheus.promtool("test", "rules", test_file))


@pytest.mark.parametrize(("rule_file", "good", "broken"), [
    ("kimi-engine.yml", "> 0.95", "> 0.85"),  # the 90% host would alert
    ("kimi-gpu.yml", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS / 8)", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS / 4)"),  # power cap
    ("kimi-gpu.yml", 'kimi_gpu_xid_errors_total{xid="79"} offset 10m', 'kimi_gpu_xid_errors_total{xid="79"}'),
])
def test_rule_unit_tests_catch_a_broken_rule(tmp_path, rule_file, good, broken):
    tests = prometheus.rule_tests_without_annotations(tmp_path)
    path = tmp_path / "rules" / rule_file
    text = path.read_text()
    assert good in text
    path.write_text(text.replace(good, broken))
    results = [prometheus.promtool("test", "rules", test_file) for test_file in tests]
    assert any(result.returncode != 0 for result in results), "the broken rule passed every test"


def test_dashboard_is_grafana_json_with_unique_panel_ids():
    board = prometheus.dashboard()
    assert board["uid"] == "kimi-service" and board["panels"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {variable["name"] for variable in board["templating"]["list"]} == {"datasource", "host", "gpu"}


def test_every_dashboard_expression_parses(tmp_path):
    exprs = prometheus.dashboard_expressions()
    assert len(exprs) > 30
    _promtool_ok(prometheus.check_expressions(exprs, tmp_path))


def test_the_expression_check_rejects_bad_promql(tmp_path):
    assert prometheus.check_expressions(["rate(vllm:num_preemptions_total[5m]"], tmp_path).returncode != 0


def test_dashboard_shows_what_the_operator_asked_for():
    names = {name for expr in prometheus.dashboard_expressions() for name in prometheus.series_names(expr)}
    assert {
        "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_SM_CLOCK", "kimi_gpu_xid_errors_total", "kimi_plan_info",
    } <= names


def test_the_plan_panel_shows_the_layout_a_data_parallel_plan_runs():
    """Per-rank TP and PP sizes show a DP 8 x EP 8 plan as TP 1, PP 1: the panel shows the plan's layout."""
    panel = next(p for p in prometheus.dashboard()["panels"]
                 if any("kimi_plan_info" in t.get("expr", "") for t in p.get("targets", [])))
    organize = next(t["options"] for t in panel["transformations"] if t["id"] == "organize")
    hidden = {name for name, excluded in organize["excludeByName"].items() if excluded}
    shown = set(exporter.PLAN_LABELS) - hidden
    assert "parallelism" in shown and set(organize["indexByName"]) == shown | {"host"}
    assert not shown & {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}


def test_series_names_skip_functions_labels_and_durations():
    expr = 'sum by (le) (rate(a_bucket{job="x{y}"}[5m] offset 10m)) > bool 1e3 or on (host) b unless c:rec'
    assert prometheus.series_names(expr) == {"a_bucket", "b", "c:rec"}


def _served(nvml, wait_for: str | None = None) -> tuple[set[str], set[str]]:
    """(series names with samples, names of every family) one collector serves; with `wait_for`,
    scrape until that series shows up (XIDs arrive on the exporter's event thread)."""
    collector = exporter.KimiCollector(nvml_module=nvml, plan_file=Path("/nonexistent"), poller=None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    deadline = time.monotonic() + 10
    try:
        while True:
            families = list(registry.collect())
            samples = {sample.name for family in families for sample in family.samples}
            if wait_for is None or wait_for in samples or time.monotonic() > deadline:
                return samples, {family.name for family in families}
            time.sleep(0.05)
    finally:
        collector.close()


def test_gpu_series_is_what_the_exporter_serves_only_with_a_gpu():
    nvml = FakeNvml(gpus=2)
    nvml.xid(0, 79)
    with_gpu, _ = _served(nvml, wait_for="kimi_gpu_xid_errors_total")
    no_driver = FakeNvml(init_error=NVMLError(nvml_reader.ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"))
    samples, families = _served(no_driver)
    # A family without samples (health before its first probe) is served without a GPU too.
    assert with_gpu - samples - families == exporter.GPU_SERIES


def test_every_gpu_series_the_pack_reads_is_one_the_exporter_serves():
    used = {name for name in prometheus.names_used() if name.startswith("DCGM_")}
    assert used and used <= exporter.GPU_SERIES


@pytest.mark.slow
def test_playbook_renders_a_config_promtool_accepts(tmp_path):
    """playbooks/monitoring.yml on the controller: both jobs list every inventory host, promtool accepts
    the result with its rules, the SLO thresholds are the variables' values, and a rerun changes nothing."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"all": {"children": {"kimi_hosts": {"hosts": {
        "gpu-node-1": {"ansible_host": "192.0.2.11"},
        "gpu-node-2": {"ansible_host": "2001:db8::12", "kimi_api_port": 8001, "kimi_exporter_port": 9401},
    }}}}}))
    config_dir, out = tmp_path / "etc", tmp_path / "out"
    config_dir.mkdir()
    # promtool checks that the bearer's credentials file exists where the Prometheus host will have it.
    (config_dir / "kimi-vllm-api-key").write_text("sk-test")
    extra_vars = {"kimi_monitoring_render_dir": str(out), "kimi_prometheus_config_dir": str(config_dir),
                  "kimi_prometheus_vllm_bearer": True, "kimi_prometheus_slo_ttft_p99_seconds": 4,
                  "kimi_prometheus_slo_itl_p99_seconds": 0.25}
    run = ansible_playbook("playbooks/monitoring.yml", inventory, extra_vars=extra_vars)
    assert run.returncode == 0, str(run)

    _promtool_ok(prometheus.promtool("check", "config", out / "prometheus.yml"))
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert {name: [(c["targets"], c["labels"]) for c in job["static_configs"]] for name, job in jobs.items()} == {
        "kimi-vllm": [(["192.0.2.11:8000"], {"host": "gpu-node-1"}), (["[2001:db8::12]:8001"], {"host": "gpu-node-2"})],
        "kimi-exporter": [(["192.0.2.11:9400"], {"host": "gpu-node-1"}),
                          (["[2001:db8::12]:9401"], {"host": "gpu-node-2"})],
    }
    assert jobs["kimi-vllm"]["authorization"]["credentials_file"] == str(config_dir / "kimi-vllm-api-key")
    rendered_rules = sorted(path.name for path in (out / "kimi-rules").iterdir())
    assert rendered_rules == sorted([*(path.name for path in prometheus.rule_files()), "kimi-slo.yml"])

    slo_test = tmp_path / "slo.test.yml"
    slo_test.write_text(yaml.safe_dump({
        "rule_files": [str(out / "kimi-rules" / "kimi-slo.yml")], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [], "promql_expr_test": [
            {"expr": name, "eval_time": "1m", "exp_samples": [{"labels": name, "value": value}]}
            for name, value in (("kimi:slo_ttft_p99_seconds", 4), ("kimi:slo_itl_p99_seconds", 0.25))
        ]}],
    }))
    _promtool_ok(prometheus.promtool("test", "rules", slo_test))

    again = ansible_playbook("playbooks/monitoring.yml", inventory, extra_vars=extra_vars)
    assert again.returncode == 0 and again.changed == 0, f"{again.changed_tasks()}\n{again}"

    # A rule file the project no longer ships is removed.
    shutil.copy(out / "kimi-rules" / "kimi-slo.yml", out / "kimi-rules" / "kimi-retired.yml")
    tidy = ansible_playbook("playbooks/monitoring.yml", inventory, extra_vars=extra_vars)
    assert tidy.returncode == 0, str(tidy)
    assert not (out / "kimi-rules" / "kimi-retired.yml").exists()
