"""The example inventories run as copied, with no vault: every variable resolves and passes the roles'
argument validation, and the API key the play makes beside an inventory stays out of git."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ansible.inventory.manager import InventoryManager
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from ansible.vars.manager import VariableManager

from tests.hosts.ansible import PROJECT_ROOT, ansible_playbook

ROLES = PROJECT_ROOT / "roles"
EXAMPLES = sorted(p for p in (PROJECT_ROOT / "inventory").glob("example*") if p.is_dir())


def _role_defaults(loader: DataLoader) -> dict:
    """Every role's defaults, as a play has them beneath the inventory's values (loaded by Ansible's own
    loader, which marks them as templates to render)."""
    merged: dict = {}
    for path in sorted(ROLES.glob("*/defaults/main.yml")):
        merged.update(loader.load_from_file(str(path), trusted_as_template=True) or {})
    return merged


def _main_specs() -> dict[str, dict]:
    return {path.parents[1].name: yaml.safe_load(path.read_text())["argument_specs"]["main"].get("options") or {}
            for path in sorted(ROLES.glob("*/meta/argument_specs.yml"))}


def _resolved_host_vars(inventory_dir: Path) -> dict[str, dict]:
    """Each host's kimi_* variables as the inventory sets them, templated the way a play would."""
    loader = DataLoader()
    inventory = InventoryManager(loader=loader, sources=[str(inventory_dir)])
    variables = VariableManager(loader=loader, inventory=inventory)
    defaults = _role_defaults(loader)
    resolved = {}
    for host in inventory.get_hosts():
        values = variables.get_vars(host=host)
        templar = Templar(loader=loader, variables={**defaults, **values})
        resolved[host.name] = {name: templar.template(value) for name, value in values.items()
                               if name.startswith("kimi_")}
    return resolved


@pytest.mark.parametrize("inventory_dir", EXAMPLES, ids=lambda p: p.name)
def test_an_example_inventory_resolves_without_a_vault_and_passes_argument_validation(inventory_dir):
    specs = _main_specs()
    hosts = _resolved_host_vars(inventory_dir)
    assert hosts, f"{inventory_dir.name} has no hosts"
    for host, resolved in hosts.items():
        for role, options in specs.items():
            provided = {name: resolved[name] for name in options if name in resolved}
            validation = ArgumentSpecValidator({name: options[name] for name in provided}).validate(provided)
            assert not validation.error_messages, f"{inventory_dir.name} {host} [{role}]: {validation.error_messages}"
        # The example puts a placeholder where the operator's own address goes, not an empty list (the
        # endpoint would answer the host alone).
        assert resolved["kimi_firewall_allowed_cidrs"], f"{inventory_dir.name} {host}"
        assert resolved["kimi_api_key"] == "", f"{inventory_dir.name} {host}: without a vault the play makes the key"


def test_the_vault_example_names_only_variables_the_inventory_reads():
    vault_example = PROJECT_ROOT / "inventory/example/group_vars/all/vault.yml.example"
    names = set(yaml.safe_load(vault_example.read_text()))
    read = "".join(path.read_text() for example in EXAMPLES for path in example.rglob("*.yml"))
    assert names and all(f"{{{{ {name} | default(" in read for name in names), sorted(names)


@pytest.mark.parametrize("inventory_dir", EXAMPLES, ids=lambda p: p.name)
def test_the_key_made_beside_an_example_inventory_is_git_ignored(inventory_dir):
    loader = DataLoader()
    variables = {**_role_defaults(loader), "inventory_dir": str(inventory_dir)}
    key = Path(Templar(loader=loader, variables=variables).template(variables["kimi_api_key_file"]))
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "-q", str(key.relative_to(PROJECT_ROOT))],
                             cwd=PROJECT_ROOT, check=False)
    assert ignored.returncode == 0, f"{key} is not ignored by .gitignore"


def test_the_play_keeps_the_key_it_makes_out_of_the_inventorys_own_git_repository(tmp_path):
    """An inventory in the operator's own repository, whose .gitignore knows nothing of the key."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(json.dumps({"kimi_hosts": {"hosts": {"gpu-1": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "kimi_hosts", "gather_facts": False, "roles": ["kimi_common"],
        "tasks": [{"name": "Use the key", "ansible.builtin.assert": {"that": "kimi_api_key_effective | length == 48"}}],
    }]))
    run = ansible_playbook(playbook, inventory, timeout=300)
    assert run.returncode == 0, str(run)
    assert (tmp_path / ".credentials/kimi-api-key").is_file(), str(run)
    untracked = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    assert sorted(line for line in untracked if line) == ["?? hosts.yml", "?? play.yml"]


def test_the_key_is_never_read_as_inventory_and_a_key_made_in_credentials_moves(tmp_path):
    """Ansible reads every file under an inventory directory as inventory: a key in <inventory>/credentials/
    (where earlier versions made it) became a host named after the key, printed by every play. The key
    lives in the hidden .credentials/ now, and an old one moves there, unchanged."""
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(json.dumps({"kimi_hosts": {"hosts": {"gpu-1": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    old = inventory / "credentials" / "kimi-api-key"
    old.parent.mkdir()
    key = "k" * 24 + "0123456789abcdefghijklmn"
    old.write_text(key)
    old.chmod(0o600)
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "kimi_hosts", "gather_facts": False, "roles": ["kimi_common"],
        "tasks": [{"name": "Use the key", "ansible.builtin.assert": {"that": f"kimi_api_key_effective == '{key}'"}},
                  {"name": "List the inventory", "ansible.builtin.debug": {"msg": "{{ groups['all'] }}"}}],
    }]))
    first = ansible_playbook(playbook, inventory, timeout=300)
    assert first.returncode == 0, str(first)
    assert not old.exists() and (inventory / ".credentials/kimi-api-key").read_text() == key
    again = ansible_playbook(playbook, inventory, timeout=300)
    assert again.returncode == 0 and again.changed == 0, str(again)
    assert key in first.output, "the old place was not read as inventory: this test no longer shows the fault"
    assert key not in again.output and list(again.recap) == ["gpu-1"], str(again)
