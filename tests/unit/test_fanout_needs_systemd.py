"""The weights fan-out serves through a transient systemd unit: preflight (and the weights stage, before it
downloads anything) refuses it by name where supervisord runs a host. The check of
roles/preflight/tasks/fanout.yml, rendered with Ansible's templar as the play would."""

from __future__ import annotations

from pathlib import Path

import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

ROLES = Path(__file__).resolve().parents[2] / "roles"
CHECK = yaml.safe_load((ROLES / "preflight/tasks/fanout.yml").read_text())[0]
MANAGERS = {"gpu-1": "systemd", "pod-2": "supervisord", "pod-3": "supervisord"}


def _check(**settings) -> tuple[bool, str]:
    variables = {
        **CHECK["vars"],
        "kimi_model": "moonshotai/Kimi-K2.5",
        "kimi_model_fanout": True,
        "ansible_play_hosts": list(MANAGERS),
        "hostvars": {host: {"inventory_hostname": host, "kimi_host_service_manager": manager}
                     for host, manager in MANAGERS.items()},
        **settings,
    }
    templar = Templar(loader=DataLoader(), variables={k: trust_as_template(v) if isinstance(v, str) else v
                                                      for k, v in variables.items()})
    check = CHECK["ansible.builtin.assert"]
    holds = bool(templar.template(trust_as_template("{{ " + check["that"] + " }}")))
    return holds, " ".join(templar.template(trust_as_template(check["fail_msg"])).split())


def test_fanout_onto_hosts_without_systemd_is_refused_naming_them():
    holds, message = _check()
    assert not holds
    assert "kimi_model_fanout needs systemd on every host" in message
    assert "supervisord runs pod-2, pod-3." in message and "gpu-1" not in message
    assert "kimi_model_fanout: false: each host then downloads the weights itself" in message


def test_fanout_is_refused_both_in_preflight_and_before_the_weights_stage_downloads():
    assert CHECK["run_once"] is True
    preflight = yaml.safe_load((ROLES / "preflight/tasks/main.yml").read_text())
    weights = yaml.safe_load((ROLES / "model_weights/tasks/main.yml").read_text())
    assert {"name": "Check the weights can fan out", "ansible.builtin.import_tasks": "fanout.yml"} in preflight
    assert weights[0]["ansible.builtin.import_role"] == {"name": "preflight", "tasks_from": "fanout"}


def test_systemd_hosts_one_host_a_directory_or_no_fanout_pass():
    systemd_only = {host: {"inventory_hostname": host, "kimi_host_service_manager": "systemd"} for host in MANAGERS}
    assert _check(hostvars=systemd_only)[0]
    assert _check(ansible_play_hosts=["pod-2"])[0]
    assert _check(kimi_model="/srv/models/kimi")[0]
    assert _check(kimi_model_fanout="false")[0]  # as typed with -e
