"""A cluster group (one engine over several hosts) restarts and upgrades as a unit: the runtime role leaves
its engine to the service role's ordered group restart, which lives in one task file that the service
stage and the upgrade's roll-back both use, and upgrade.yml upgrades the group in one batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "roles"
GROUP_RESTART = ["Stop the group's leader first", "Restart the group's followers", "Restart the group's leader"]



def _plays(name: str) -> list[dict]:
    """The plays of a playbook, without the imported inventory play every entry playbook starts with."""
    return [p for p in yaml.safe_load((ROOT / "playbooks" / name).read_text()) if "hosts" in p]

def _in_cluster(host: str, cluster_group: str, groups: dict) -> bool:
    """Evaluate the one membership test (kimi_common's kimi_cluster_member) the way Ansible does."""
    loader = DataLoader()
    values: dict = {}
    for path in ("kimi_common/defaults/main.yml", "kimi_common/vars/main.yml"):
        values.update(loader.load_from_file(str(ROLES / path), trusted_as_template=True))
    values.update(inventory_hostname=host, kimi_cluster_group=cluster_group, groups=groups)
    return Templar(loader=loader, variables=values).template(values["kimi_cluster_member"]) in (True, "True")


@pytest.mark.parametrize(
    ("host", "cluster_group", "groups", "expected"),
    [
        ("gpu-1", "", {"kimi_hosts": ["gpu-1"]}, False),
        ("gpu-1", "kimi_cluster", {"kimi_cluster": ["gpu-1", "gpu-2"]}, True),
        ("gpu-2", "kimi_cluster", {"kimi_cluster": ["gpu-1", "gpu-2"]}, True),
        ("gpu-3", "kimi_cluster", {"kimi_cluster": ["gpu-1", "gpu-2"]}, False),
        ("gpu-1", "no_such_group", {"kimi_hosts": ["gpu-1"]}, False),
    ],
)
def test_cluster_membership_is_decided_once(host, cluster_group, groups, expected):
    # Every role and playbook reads this one fact: a host two of them disagreed on would restart twice, or
    # never, on a new runtime (tests/unit/test_one_home.py checks nobody spells the test again).
    assert _in_cluster(host, cluster_group, groups) == expected


def _names(path: Path) -> list[str]:
    def walk(tasks):
        for task in tasks or []:
            yield task.get("name", "")
            for key in ("block", "rescue", "always", "tasks"):
                yield from walk(task.get(key))

    return list(walk(yaml.safe_load(path.read_text())))


def test_the_ordered_group_restart_lives_in_one_task_file():
    owner = ROLES / "vllm_service/tasks/restart_group.yml"
    names = _names(owner)
    positions = [next(i for i, name in enumerate(names) if name.startswith(step)) for step in GROUP_RESTART]
    assert positions == sorted(positions), "stop the leader, restart the followers, then the leader"
    files = [*ROLES.glob("*/tasks/*.yml"), *ROLES.glob("*/handlers/*.yml"), *(ROOT / "playbooks").rglob("*.yml")]
    copies = [
        str(path.relative_to(ROOT))
        for path in files
        if path != owner and any(name.startswith(step) for name in _names(path) for step in GROUP_RESTART)
    ]
    assert copies == []
    main = yaml.safe_load((ROLES / "vllm_service/tasks/main.yml").read_text())
    assert any(t.get("ansible.builtin.include_tasks", {}).get("file") == "restart_group.yml" for t in main)
    assert "tasks_from: restart_group" in (ROOT / "playbooks/upgrade.yml").read_text()


def test_upgrade_takes_single_hosts_one_at_a_time_and_a_cluster_group_in_one_batch():
    plays = {play["hosts"]: play for play in _plays("upgrade.yml")}
    assert plays["kimi_hosts:&kimi_upgrade_single"]["serial"] == 1
    assert "serial" not in plays["kimi_hosts:&kimi_upgrade_clusters"]
    assert list(plays) == ["kimi_hosts", "kimi_hosts:&kimi_upgrade_single", "kimi_hosts:&kimi_upgrade_clusters"]


@pytest.mark.parametrize("answered_first", [["gpu-3", "gpu-1", "gpu-2"], ["gpu-2", "gpu-3", "gpu-1"]])
def test_upgrade_goes_through_the_hosts_in_inventory_order_whoever_answers_first(tmp_path, answered_first):
    # group_by adds the hosts to its group in the order they answer; the operator expects the upgrade to
    # start with the first host of the inventory (and the tests check which host it stopped at).
    from ansible.inventory.manager import InventoryManager

    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump({"kimi_hosts": {"hosts": {"gpu-1": {}, "gpu-2": {}, "gpu-3": {}}}})
    )
    inventory = InventoryManager(loader=DataLoader(), sources=[str(tmp_path / "hosts.yml")])
    plays = _plays("upgrade.yml")
    for group in ("kimi_upgrade_single", "kimi_upgrade_clusters"):
        inventory.add_group(group)
        for host in answered_first:
            inventory.add_host(host, group=group)
    for play in plays[1:]:
        assert [host.name for host in inventory.get_hosts(play["hosts"])] == ["gpu-1", "gpu-2", "gpu-3"], play["name"]


def test_a_single_host_that_does_not_start_on_its_previous_runtime_is_reported_and_stays_out():
    # The roll-back's restart gets a second start; when that fails too, the play says the host does not
    # serve (instead of "back on … and serving") before it would be put back into the load balancer.
    single = next(p for p in _plays("upgrade.yml") if p["hosts"] == "kimi_hosts:&kimi_upgrade_single")
    block = next(t for t in single["tasks"] if "rescue" in t)
    names = [t["name"] for t in block["rescue"]]
    # The restart goes through vllm_service's entry point (either service manager) with a second start,
    # and its failure is caught and recorded.
    restart = next(t for t in block["rescue"] if "block" in t)
    include = restart["block"][0]
    assert include["ansible.builtin.include_role"] == {"name": "vllm_service", "tasks_from": "restart"}
    assert include["vars"]["kimi_vllm_restart_retries"] >= 1
    recorded = next(iter(restart["rescue"][0]["ansible.builtin.set_fact"]))
    not_serving = next(t for t in block["rescue"] if t.get("when") == f"{recorded} is defined")
    assert "not serving" in not_serving["ansible.builtin.fail"]["msg"]
    order = [names.index(restart["name"]), names.index(not_serving["name"]),
             names.index("Put this replica, serving its previous version again, back into the load balancer")]
    assert order == sorted(order)
