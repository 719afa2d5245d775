"""The config.yaml the vllm_service role writes is one the service's own schema accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from kimi_service.config import ConfigError, parse_config, read_env_file

ROLES = Path(__file__).resolve().parents[2] / "roles"


def _render(**overrides) -> dict:
    """Render the template the way the role does: Ansible's templar over the role's own files."""
    loader = DataLoader()
    values: dict = {}
    for path in ("kimi_common/defaults/main.yml", "kimi_common/vars/main.yml", "vllm_service/defaults/main.yml",
                 "vllm_service/vars/main.yml"):
        values.update(loader.load_from_file(str(ROLES / path), trusted_as_template=True))
    values.update(ansible_managed="Ansible managed", _vllm_service_model_bytes=600 * 10**9, inventory_hostname="gpu-1",
                  groups={"all": ["gpu-1"], "kimi_hosts": ["gpu-1"]}, hostvars={})
    values.update(overrides)
    template = trust_as_template((ROLES / "vllm_service/templates/config.yaml.j2").read_text())
    return yaml.safe_load(Templar(loader=loader, variables=values).template(template))


def test_defaults_render_a_valid_config():
    document = _render()
    config = parse_config(document)
    assert str(config.model.path) == "/var/lib/kimi-service/models/moonshotai/Kimi-K2.5@main"
    assert config.model.served_name == "moonshotai/Kimi-K2.5"
    assert config.api.port == 8000 and config.exporter.port == 9400
    assert config.plan.max_model_len is None and config.plan.extra_args == ()
    # 600 GB of weights: the same start window the unit gets.
    assert config.serve.startup_timeout == 300 + 55 * 60


def test_operator_values_reach_the_config():
    config = parse_config(_render(
        kimi_model="/srv/models/qwen", kimi_served_model_name="qwen", kimi_engine="cpu", kimi_workload="latency",
        kimi_max_model_len=8192, kimi_vllm_extra_args=["--max-num-seqs", "64"], kimi_api_port=8080,
    ))
    assert str(config.model.path) == "/srv/models/qwen" and config.model.served_name == "qwen"
    assert (config.plan.engine, config.plan.workload, config.plan.max_model_len) == ("cpu", "latency", 8192)
    assert config.plan.extra_args == ("--max-num-seqs", "64")
    assert config.api.port == 8080


def test_readiness_port_everywhere_and_a_withdraw_window_only_behind_a_balancer():
    alone = parse_config(_render())
    assert (alone.serve.ready_port, alone.serve.withdraw_delay) == (8001, 0)
    groups = {"kimi_hosts": ["gpu-1", "gpu-2"], "kimi_replicas": ["gpu-1", "gpu-2"], "kimi_balancer": ["lb"]}
    replica = parse_config(_render(groups=groups, kimi_balancer_check_interval_sec=3))
    # Two failed checks take it out (fall 2), one interval more for the check already under way.
    assert replica.serve.withdraw_delay == 3 * (2 + 1)
    assert parse_config(_render(groups=groups, kimi_vllm_withdraw_sec=20)).serve.withdraw_delay == 20


def test_the_balancers_and_prometheus_hosts_may_read_health_and_metrics():
    assert parse_config(_render()).api.trusted_clients == ()
    groups = {"kimi_hosts": ["gpu-1"], "kimi_balancer": ["lb"], "kimi_monitoring": ["prom", "named"]}
    hostvars = {"lb": {"ansible_host": "10.0.0.9"}, "prom": {"ansible_host": "fd00::5"}, "named": {}}
    trusted = parse_config(_render(groups=groups, hostvars=hostvars)).api.trusted_clients
    assert trusted == ("10.0.0.9/32", "fd00::5/128")
    assert parse_config(_render(kimi_api_trusted_cidrs=["10.8.0.0/16"])).api.trusted_clients == ("10.8.0.0/16",)


def test_an_operators_trusted_networks_add_to_the_balancers_and_prometheus_hosts():
    groups = {"kimi_hosts": ["gpu-1"], "kimi_balancer": ["lb"], "kimi_monitoring": ["prom"]}
    hostvars = {"lb": {"ansible_host": "10.0.0.9"}, "prom": {"ansible_host": "10.0.0.7"}}
    trusted = parse_config(_render(groups=groups, hostvars=hostvars,
                                   kimi_api_trusted_cidrs=["192.0.2.0/24", "10.0.0.7"])).api.trusted_clients
    assert trusted == ("10.0.0.9/32", "10.0.0.7/32", "192.0.2.0/24")


def test_a_reserved_flag_in_extra_args_is_refused_by_the_schema():
    with pytest.raises(ConfigError, match="--api-key"):
        parse_config(_render(kimi_vllm_extra_args=["--api-key", "sk-x"]))


@pytest.mark.parametrize("key", ['sk-plain-123', 'sk-"quoted"\\back$slash #not-a-comment'])
def test_secrets_file_reads_back_the_key_the_role_wrote(tmp_path, key):
    """`kimi-service health|bench --env-file` parse secrets.env exactly as systemd does for the units."""
    loader = DataLoader()
    template = trust_as_template((ROLES / "vllm_service/templates/secrets.env.j2").read_text())
    templar = Templar(loader=loader, variables={"ansible_managed": "Ansible managed", "kimi_api_key_effective": key})
    rendered = templar.template(template, escape_backslashes=False)  # as the template action renders files
    path = tmp_path / "secrets.env"
    path.write_text(rendered)
    assert read_env_file(path) == {"VLLM_API_KEY": key}


def test_secrets_file_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="written by the vllm_service role"):
        read_env_file(tmp_path / "absent.env")
    (bad := tmp_path / "bad.env").write_bytes(b"# key\nVLLM_API_KEY=sk-\xff\n")
    with pytest.raises(ConfigError, match=r"bad\.env, line 2: not UTF-8 text; systemd refuses"):
        read_env_file(bad)


def _cluster_render(host: str, **overrides) -> dict:
    """config.yaml for `host` of a two-host group: the inventory's group order and host variables."""
    hostvars = {"gpu-a": {"ansible_host": "10.0.0.1"},
                "gpu-b": {"ansible_host": "203.0.113.7", "kimi_cluster_address": "10.0.0.2"}}
    return _render(kimi_cluster_group="kimi_cluster", groups={"kimi_cluster": ["gpu-a", "gpu-b"]},
                   hostvars=hostvars, inventory_hostname=host, **overrides)


@pytest.mark.parametrize(("host", "rank"), [("gpu-a", 0), ("gpu-b", 1)])
def test_a_cluster_host_gets_its_rank_and_the_groups_addresses_in_order(host, rank):
    config = parse_config(_cluster_render(host))
    assert config.cluster is not None
    assert config.cluster.node_rank == rank
    # kimi_cluster_address (a private network) beats ansible_host.
    assert config.cluster.addresses == ("10.0.0.1", "10.0.0.2")
    assert config.cluster.master_port == 29500 and config.plan.nodes == 2
    assert dict(config.cluster.env) == {}


def test_nccl_variables_reach_the_engine_environment():
    config = parse_config(_cluster_render(
        "gpu-a", kimi_nccl_socket_ifname="ens5", kimi_nccl_ib_disable=True,
        kimi_nccl_extra_env={"NCCL_DEBUG": "WARN"}, kimi_cluster_master_port=29600,
    ))
    assert dict(config.cluster.env) == {"NCCL_SOCKET_IFNAME": "ens5", "GLOO_SOCKET_IFNAME": "ens5",
                                        "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}
    assert config.cluster.master_port == 29600


def test_extra_env_reaches_config_and_a_reserved_name_is_refused():
    config = parse_config(_render(kimi_vllm_extra_env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    assert dict(config.plan.extra_env) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with pytest.raises(ConfigError, match=r"plan\.extra_env\.HF_HOME: set by kimi-service itself"):
        parse_config(_render(kimi_vllm_extra_env={"HF_HOME": "/x"}))


def test_a_host_outside_the_group_serves_alone():
    assert parse_config(_cluster_render("gpu-c")).cluster is None
    assert "cluster" not in _render()
