"""Every role documents and validates exactly the variables it exposes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if (p / "tasks").is_dir() or (p / "defaults").is_dir())


def _defaults(role: str) -> dict:
    return yaml.safe_load((ROLES_DIR / role / "defaults/main.yml").read_text()) or {}


def _spec_options(role: str) -> dict:
    specs = yaml.safe_load((ROLES_DIR / role / "meta/argument_specs.yml").read_text())["argument_specs"]
    return specs["main"].get("options") or {}


def test_there_are_roles():
    assert {"kimi_common", "preflight", "service_account"} <= set(ROLES)


@pytest.mark.parametrize("role", ROLES)
def test_role_has_the_standard_files(role):
    for name in ("defaults/main.yml", "meta/main.yml", "meta/argument_specs.yml", "tasks/main.yml", "README.md"):
        assert (ROLES_DIR / role / name).is_file(), f"roles/{role}/{name} is missing"


@pytest.mark.parametrize("role", ROLES)
def test_defaults_and_argument_specs_list_the_same_variables(role):
    defaults, options = set(_defaults(role)), set(_spec_options(role))
    assert defaults - options == set(), f"roles/{role}: in defaults/main.yml but not in meta/argument_specs.yml"
    assert options - defaults == set(), f"roles/{role}: in meta/argument_specs.yml but not in defaults/main.yml"


@pytest.mark.parametrize("role", ROLES)
def test_documented_defaults_match_the_real_defaults(role):
    defaults = _defaults(role)
    for name, option in _spec_options(role).items():
        if "default" in option:
            assert option["default"] == defaults[name], f"roles/{role}: {name} default differs from defaults/main.yml"
        assert option.get("description"), f"roles/{role}: {name} has no description"


@pytest.mark.parametrize("role", ROLES)
def test_role_readme_lists_every_variable(role):
    readme = (ROLES_DIR / role / "README.md").read_text()
    missing = [name for name in _defaults(role) if f"`{name}`" not in readme]
    assert missing == [], f"roles/{role}/README.md does not document {missing}"


def test_operator_variables_are_prefixed():
    for role in ROLES:
        bad = [name for name in _defaults(role) if not name.startswith("kimi_")]
        assert bad == [], f"roles/{role}: public variables must start with kimi_: {bad}"


def _entry_points(role: str) -> dict:
    return yaml.safe_load((ROLES_DIR / role / "meta/argument_specs.yml").read_text())["argument_specs"]


def _tasks_from_calls():
    """(calling file, role, tasks_from) for every include_role/import_role with tasks_from."""
    root = ROLES_DIR.parent
    files = [*ROLES_DIR.glob("*/tasks/*.yml"), *ROLES_DIR.glob("*/handlers/*.yml")]
    files += (root / "playbooks").rglob("*.yml")

    def walk(node):
        if isinstance(node, dict):
            for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
                if isinstance(node.get(key), dict) and "tasks_from" in node[key]:
                    yield node[key]["name"], node[key]["tasks_from"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    for path in files:
        for role, entry in walk(yaml.safe_load(path.read_text())):
            yield str(path.relative_to(root)), role, entry


@pytest.mark.parametrize(("caller", "role", "entry"), sorted(set(_tasks_from_calls())))
def test_another_roles_tasks_are_used_only_through_a_declared_entry_point(caller, role, entry):
    # Ansible validates an entry point's inputs only when tasks_from names it exactly (no .yml suffix).
    if caller.startswith(f"roles/{role}/"):
        return
    assert entry in _entry_points(role), f"{caller} uses roles/{role} tasks_from {entry}, not an entry point"


@pytest.mark.parametrize("role", ROLES)
def test_entry_point_inputs_are_documented_public_variables(role):
    defaults = _defaults(role)
    for entry, spec in _entry_points(role).items():
        for name, option in (spec.get("options") or {}).items():
            assert option.get("description"), f"roles/{role} entry point {entry}: {name} has no description"
            assert name in defaults or option.get("required"), (
                f"roles/{role} entry point {entry}: {name} is neither a default of the role nor required"
            )
