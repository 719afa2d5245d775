"""An inventory without the group kimi_hosts (`-i 203.0.113.5,`, or hosts straight under `all:`) is served,
not silently skipped: before, every play said "no hosts matched" and the run exited 0 having done nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.hosts.ansible import PROJECT_ROOT, ansible_playbook

PLAYBOOKS = PROJECT_ROOT / "playbooks"
# Entry playbooks that provision kimi_hosts (wheelhouse.yml runs on the controller, balancer.yml on
# kimi_balancer).
ENTRY = sorted(p.name for p in PLAYBOOKS.glob("*.yml")
               if any(play.get("hosts") == "kimi_hosts" or str(play.get("hosts", "")).startswith("kimi_hosts:")
                      for play in yaml.safe_load(p.read_text())))


@pytest.mark.parametrize("playbook", ENTRY)
def test_every_entry_playbook_first_serves_an_inventory_without_the_group(playbook):
    first = yaml.safe_load((PLAYBOOKS / playbook).read_text())[0]
    assert first.get("ansible.builtin.import_playbook") == "inventory.yml", playbook


def _local(tmp_path: Path, inventory: str) -> dict:
    """Variables that make the play run here (no SSH): the verify stage fails fast on a host with nothing."""
    return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "kimi_verify_wait_sec": 0, "kimi_config_dir": str(tmp_path / "etc"), "kimi_install_dir": str(tmp_path)}


@pytest.mark.parametrize("shape", ["comma", "all"])
def test_an_inventory_without_kimi_hosts_is_served_not_skipped(tmp_path, shape):
    if shape == "comma":
        inventory = "203.0.113.5,"
    else:
        inventory = tmp_path / "hosts.yml"
        inventory.write_text(json.dumps({"all": {"hosts": {"203.0.113.5": {}}}}))
    run = ansible_playbook("playbooks/verify.yml", inventory, extra_vars=_local(tmp_path, str(inventory)))
    assert "no hosts matched" not in run.output, str(run)
    assert "The inventory has no group kimi_hosts: serving all its hosts (203.0.113.5)" in run.said, str(run)
    # The verify stage ran on the host (and failed there: nothing is installed), instead of exiting 0.
    assert "203.0.113.5" in run.recap and run.recap["203.0.113.5"]["failed"] > 0, str(run)
    assert run.returncode != 0
