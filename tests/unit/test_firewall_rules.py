"""The firewall's rule set (roles/firewall/templates/firewall.nft.j2) rendered with Ansible's templar over the
roles' own defaults and vars: who reaches which port. tests/integration/test_firewall.py loads it into nft."""

from __future__ import annotations

import re
from pathlib import Path

from ansible.parsing.dataloader import DataLoader
from ansible.plugins.loader import add_all_plugin_dirs
from ansible.template import Templar, trust_as_template

ROLES = Path(__file__).resolve().parents[2] / "roles"
GROUPS = {"kimi_hosts": ["gpu-1", "gpu-2"], "kimi_replicas": ["gpu-1", "gpu-2"], "kimi_balancer": ["lb"],
          "kimi_monitoring": ["prom", "prom6"]}
HOSTVARS = {"gpu-1": {"ansible_host": "203.0.113.10"}, "gpu-2": {"ansible_host": "203.0.113.11"},
            "lb": {"ansible_host": "10.0.0.9"}, "prom": {"ansible_host": "10.0.0.7"},
            "prom6": {"ansible_host": "fd00::7"}}


def _rules(**overrides) -> str:
    add_all_plugin_dirs(str(ROLES / "kimi_common"))  # its filters (kimi_ip_family), as the role's play loads them
    loader = DataLoader()
    values: dict = {}
    for path in ("kimi_common/defaults/main.yml", "kimi_common/vars/main.yml", "firewall/defaults/main.yml",
                 "firewall/vars/main.yml"):
        values.update(loader.load_from_file(str(ROLES / path), trusted_as_template=True))
    values.update(ansible_managed="Ansible managed", inventory_hostname="gpu-1", groups=GROUPS, hostvars=HOSTVARS)
    values.update(overrides)
    template = trust_as_template((ROLES / "firewall/templates/firewall.nft.j2").read_text())
    return Templar(loader=loader, variables=values).template(template)


def _reach(rules: str) -> dict[str, set[int]]:
    """Source address -> the TCP ports an `accept` rule opens to it."""
    reach: dict[str, set[int]] = {}
    for sources, ports in re.findall(r"ip6? saddr \{ ([^}]*) \} tcp dport \{ ([^}]*) \} accept", rules):
        for source in sources.split(", "):
            reach.setdefault(source, set()).update(int(port) for port in ports.split(", ") if port.isdigit())
    return reach


def test_prometheus_hosts_reach_vllms_metrics_and_the_exporter_on_every_host():
    for host in ("gpu-1", "gpu-2"):
        reach = _reach(_rules(inventory_hostname=host))
        assert reach["10.0.0.7"] == reach["fd00::7"] == {8000, 9400}, reach


def test_prometheus_follows_the_ports_and_an_address_of_its_own():
    reach = _reach(_rules(kimi_api_port=8100, kimi_exporter_port=9500, kimi_firewall_monitoring_cidrs=["10.1.0.0/24"]))
    assert reach["10.1.0.0/24"] == {8100, 9500} and "10.0.0.7" not in reach, reach


def test_the_balancers_reach_the_replicas_api_and_readiness_as_before():
    assert _reach(_rules())["10.0.0.9"] == {8000, 8001}


def test_without_a_monitoring_group_no_one_else_gets_in():
    reach = _reach(_rules(groups={**GROUPS, "kimi_monitoring": []}))
    assert set(reach) == {"0.0.0.0/0", "::/0", "10.0.0.9"}, reach
