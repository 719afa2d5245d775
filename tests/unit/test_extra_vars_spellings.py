"""`-e kimi_x=false` as an operator types it means false to the roles.

A `key=value` extra var is always a string, and the roles' argument validation accepts "false" for a bool
without converting it; the roles read such variables through `| bool` (test_typed_variables.py holds them
to that). This runs the real ansible-playbook: every role's argument validation with each spelling passed as
`-e name=value`, then what `| bool` makes of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
SPECS = {
    spec_file: yaml.safe_load(spec_file.read_text())["argument_specs"]
    for spec_file in sorted(ROOT.glob("roles/*/meta/argument_specs.yml"))
}
# What a required option that is not a bool gets, so that every entry point's validation runs.
PLACEHOLDERS = {"str": "placeholder", "path": "/placeholder", "list": "placeholder", "int": "1"}


def _options() -> dict[str, dict]:
    return {
        name: option
        for entry_points in SPECS.values()
        for entry_point in entry_points.values()
        for name, option in (entry_point.get("options") or {}).items()
    }


def _bool_variables() -> list[str]:
    return sorted(name for name, option in _options().items() if option.get("type") == "bool")


def _playbook(seen_file: Path) -> list[dict]:
    seen = {name: "{{ " + name + " | bool }}" for name in _bool_variables()}
    raw_is_string = {name: "{{ " + name + " is string }}" for name in _bool_variables()}
    return [{
        "name": "Validate every role's arguments, then report what | bool reads",
        "hosts": "localhost",
        "gather_facts": False,
        "tasks": [
            {
                "name": "Validate the arguments of each role's entry point",
                "ansible.builtin.validate_argument_spec": {
                    "argument_spec": "{{ (lookup('file', item[0]) | from_yaml)"
                                     ".argument_specs[item[1]].options | default({}) }}",
                },
                "loop": [[str(spec_file), entry_point] for spec_file, entry_points in SPECS.items()
                         for entry_point in entry_points],
            },
            {
                "name": "Write what the roles read",
                "ansible.builtin.copy": {
                    "content": "{{ {'seen': seen, 'raw_is_string': raw_is_string} | to_json }}",
                    "dest": str(seen_file),
                    "mode": "0600",
                },
                "vars": {"seen": seen, "raw_is_string": raw_is_string},
            },
        ],
    }]


def _required_placeholders() -> list[str]:
    return [
        f"{name}={PLACEHOLDERS[option.get('type', 'str')]}"
        for name, option in _options().items()
        if option.get("required") and option.get("type") != "bool"
    ]


@pytest.mark.parametrize(("spelling", "meant"), [("false", False), ("true", True), ("no", False), ("0", False)])
def test_a_bool_given_as_key_equals_value_reads_as_the_operator_meant(tmp_path, spelling, meant):
    playbook = tmp_path / "spellings.yml"
    playbook.write_text(yaml.safe_dump(_playbook(tmp_path / "seen.json")))
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    extra_vars = [f"{name}={spelling}" for name in _bool_variables()] + _required_placeholders()
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(playbook)]
        + [argument for pair in extra_vars for argument in ("-e", pair)],
        env={**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")},
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "seen.json").read_text())
    # The premise: validation passed the spelling on as a string; only | bool gives it its meaning.
    assert set(report["raw_is_string"].values()) == {True}, report["raw_is_string"]
    assert report["seen"] == dict.fromkeys(_bool_variables(), meant)
