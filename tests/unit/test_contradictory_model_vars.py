"""kimi_model as a host path together with kimi_model_source: local contradict each other. Before, the
weights stage said "no weights to fetch" and the service stage failed later telling the operator to run
the weights stage; now preflight refuses them first, naming both, before anything is looked at or changed."""

from __future__ import annotations

import sys

import pytest

from tests.hosts.ansible import ansible_playbook

LOOKS_AT_THE_HOST = "TASK [preflight : Check the operating system is supported]"


@pytest.mark.parametrize("source, refused", [("local", True), ("hf", False)])
def test_a_model_path_with_source_local_is_refused_naming_both(tmp_path, source, refused):
    inventory = tmp_path / "hosts"
    inventory.write_text("[kimi_hosts]\nhere\n")
    run = ansible_playbook("playbooks/preflight.yml", inventory, "--tags", "preflight", extra_vars={
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "kimi_model": str(tmp_path / "weights"), "kimi_model_source": source,
        "kimi_model_local_path": str(tmp_path / "controller-copy"),
    })
    said = run.output
    if refused:
        assert run.returncode != 0
        assert "kimi_model is a directory on the host" in said and "kimi_model_source is local" in said, str(run)
        assert LOOKS_AT_THE_HOST not in said, "refused only after looking at the host"
    else:
        assert "kimi_model is a directory on the host" not in said, str(run)
        assert LOOKS_AT_THE_HOST in said, str(run)
