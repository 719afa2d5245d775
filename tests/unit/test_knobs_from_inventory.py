"""Operator knobs are role defaults, so a group_vars value reaches them (play or task vars would beat it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.playbook import Playbook
from ansible.template import Templar
from ansible.vars.manager import VariableManager

ROOT = Path(__file__).resolve().parents[2]
GROUP_VARS = {
    "kimi_bench_prompts": 7, "kimi_bench_concurrency": "2,3", "kimi_bench_results_dir": "/tmp/kimi-bench-out",
    "kimi_upgrade_health_wait_sec": 42, "kimi_uninstall_weights": True,
}
# Each playbook and the knobs a play of it reads.
USES = {
    "playbooks/bench.yml": ["kimi_bench_prompts", "kimi_bench_concurrency", "kimi_bench_results_dir"],
    "playbooks/upgrade.yml": ["kimi_upgrade_health_wait_sec"],
    "playbooks/uninstall.yml": ["kimi_uninstall_weights"],
}


def _play_vars(tmp_path: Path, playbook: str, monkeypatch) -> list[dict]:
    from ansible import constants
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader()
    monkeypatch.setattr(constants, "DEFAULT_ROLES_PATH", [str(ROOT / "roles")])
    (tmp_path / "group_vars").mkdir(exist_ok=True)
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"kimi_hosts": {"hosts": {"gpu-1": {}}}}))
    (tmp_path / "group_vars/kimi_hosts.yml").write_text(yaml.safe_dump(GROUP_VARS))
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(tmp_path / "hosts.yml")])
    variables = VariableManager(loader=loader, inventory=inventory)
    host = inventory.get_host("gpu-1")
    found = []
    for play in Playbook.load(str(ROOT / playbook), variable_manager=variables, loader=loader).get_plays():
        if play.get_name().startswith("Sort the hosts"):
            continue
        values = variables.get_vars(play=play, host=host)
        found.append({name: Templar(loader=loader, variables=values).template(values[name])
                      for name in GROUP_VARS if name in values})
    return found


@pytest.mark.parametrize("playbook", sorted(USES))
def test_a_group_vars_value_reaches_the_knob(tmp_path, playbook, monkeypatch):
    for resolved in _play_vars(tmp_path, playbook, monkeypatch):
        for name in USES[playbook]:
            assert resolved.get(name) == GROUP_VARS[name], f"{playbook}: {name}"


def _task_vars(tasks):
    for task in tasks or []:
        yield from (task.get("vars") or {})
        for key in ("block", "rescue", "always"):
            yield from _task_vars(task.get(key))


def _entry_point_inputs() -> set[str]:
    """Inputs a caller passes to another role's entry point (meta/argument_specs.yml, not main)."""
    names: set[str] = set()
    for path in (ROOT / "roles").glob("*/meta/argument_specs.yml"):
        for entry, spec in yaml.safe_load(path.read_text())["argument_specs"].items():
            if entry != "main":
                names |= set(spec.get("options") or {})
    return names


def test_no_playbook_sets_an_operator_knob_as_play_or_task_vars():
    inputs = _entry_point_inputs()
    for path in (ROOT / "playbooks").rglob("*.yml"):
        document = yaml.safe_load(path.read_text()) or []
        plays = [item for item in document if "hosts" in item]
        names = [*(name for play in plays for name in (play.get("vars") or {})),
                 *(_task_vars([t for play in plays for t in play.get("tasks") or []])),
                 *(_task_vars([item for item in document if "hosts" not in item]))]
        knobs = [name for name in names if name.startswith("kimi_") and name not in inputs]
        assert knobs == [], f"{path.relative_to(ROOT)} sets {knobs}: make them role defaults"
