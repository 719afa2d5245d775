"""A captured host layer is reused only while nothing it was built from has changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.hosts.ansible import PROJECT_ROOT
from tests.hosts.layers import layer_key

PLAYBOOK = "playbooks/runtime.yml"
VARS = {"kimi_engine": "cpu", "kimi_wheelhouse": "/srv/wheels"}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    copy = tmp_path / "project"
    for top in ("site.yml", "ansible.cfg", "pyproject.toml", "README.md"):
        copy.mkdir(exist_ok=True)
        shutil.copy(PROJECT_ROOT / top, copy / top)
    for top in ("playbooks", "roles", "kimi_service", "docs"):
        shutil.copytree(PROJECT_ROOT / top, copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize("changed", [
    "roles/vllm_runtime/tasks/main.yml",
    "roles/vllm_service/templates/kimi-vllm.service.j2",
    "roles/kimi_common/defaults/main.yml",
    "playbooks/runtime.yml",
    "kimi_service/launcher.py",
    "pyproject.toml",
    "ansible.cfg",
])
def test_a_change_to_what_a_host_is_built_from_makes_a_new_layer(project: Path, changed: str) -> None:
    before = layer_key(PLAYBOOK, VARS, project)
    with (project / changed).open("a") as file:
        file.write("\n# changed\n")
    assert layer_key(PLAYBOOK, VARS, project) != before


def test_a_new_file_in_a_role_makes_a_new_layer(project: Path) -> None:
    before = layer_key(PLAYBOOK, VARS, project)
    (project / "roles/vllm_runtime/tasks/extra.yml").write_text("---\n")
    assert layer_key(PLAYBOOK, VARS, project) != before


def test_other_variables_or_playbook_make_a_new_layer(project: Path) -> None:
    before = layer_key(PLAYBOOK, VARS, project)
    assert layer_key(PLAYBOOK, {**VARS, "kimi_wheelhouse": "/srv/other"}, project) != before
    assert layer_key("site.yml", VARS, project) != before


def test_docs_and_bytecode_do_not(project: Path) -> None:
    before = layer_key(PLAYBOOK, VARS, project)
    (project / "README.md").write_text("another text\n")
    (project / "docs/notes.md").write_text("more\n")
    (project / "kimi_service/__pycache__").mkdir(exist_ok=True)
    (project / "kimi_service/__pycache__/x.cpython-311.pyc").write_bytes(b"\0")
    assert layer_key(PLAYBOOK, VARS, project) == before
