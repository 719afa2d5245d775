"""The firewall role on a host in its own network namespace: default deny, allowed networks, no lock-out."""

from __future__ import annotations

import socket

import pytest

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory

API_PORT = 8000


def _can_connect(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def _probe_from(host, address: str, port: int) -> bool:
    code = f"import socket; socket.create_connection(('{address}', {port}), 2)"
    return host.ssh(f'python3 -c "{code}"', check=False).returncode == 0


@pytest.fixture(scope="module")
def hosts(make_hosts):
    return make_hosts(2)


@pytest.fixture(scope="module")
def converged(hosts, tmp_path_factory):
    guarded, _ = hosts
    gateway = guarded.address.rsplit(".", 1)[0] + ".1"
    inventory = write_inventory(
        tmp_path_factory.mktemp("fw") / "hosts.yml", [guarded],
        extra_vars={"kimi_firewall_allowed_cidrs": [f"{gateway}/32"]},
    )
    # A listener on the API port stands in for the engine.
    guarded.ssh(f"systemd-run --unit=fake-api python3 -m http.server {API_PORT}")
    first = ansible_playbook("playbooks/service.yml", inventory, "--tags", "firewall")
    return inventory, first


def test_firewall_converges_and_is_idempotent(converged):
    inventory, first = converged
    assert first.returncode == 0, str(first)
    second = ansible_playbook("playbooks/service.yml", inventory, "--tags", "firewall")
    assert second.returncode == 0 and second.changed == 0, f"{second.changed_tasks()}\n{second}"


def test_allowed_network_reaches_the_api_others_do_not(hosts, converged):
    guarded, outsider = hosts
    assert _can_connect(guarded.address, API_PORT), "the controller is in the allowed networks"
    assert not _probe_from(outsider, guarded.address, API_PORT), "the other host is not allowed"
    assert _probe_from(outsider, guarded.address, 22), "SSH must stay open to everyone"
    rules = guarded.ssh("nft list table inet kimi_service").stdout
    assert "policy drop" in rules


def test_rules_come_back_after_a_reboot(hosts, converged):
    guarded, outsider = hosts
    guarded.reboot()
    guarded.ssh(f"systemd-run --unit=fake-api python3 -m http.server {API_PORT}")
    assert guarded.ssh("systemctl is-active kimi-firewall.service").stdout.strip() == "active"
    assert not _probe_from(outsider, guarded.address, API_PORT)
    assert _can_connect(guarded.address, API_PORT)


def test_disabling_removes_the_rules(hosts, converged):
    inventory, _ = converged
    guarded, outsider = hosts
    run = ansible_playbook(
        "playbooks/service.yml", inventory, "--tags", "firewall", extra_vars={"kimi_firewall_enabled": False}
    )
    assert run.returncode == 0, str(run)
    assert guarded.ssh("nft list table inet kimi_service", check=False).returncode != 0
    assert _probe_from(outsider, guarded.address, API_PORT)
