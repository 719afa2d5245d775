"""Preflight's disk check, as the role evaluates it: the assertion of roles/preflight/tasks/disk.yml rendered with
Ansible's templar from what the host measured (free bytes, and the bytes of the weights already on it)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

GIB = 1024**3
CHECK = yaml.safe_load((Path(__file__).resolve().parents[2] / "roles/preflight/tasks/disk.yml").read_text())[1]


def _room(free_gib: float, present_gib: float, model_gib: float, headroom) -> bool:
    variables = {
        **{name: trust_as_template(value) for name, value in CHECK["vars"].items()},
        "_preflight_df": {"stdout": f"/ {int(free_gib * GIB)} {int(present_gib * GIB)}"},
        "_preflight_model_gb": model_gib,
        "kimi_preflight_disk_headroom_gb": headroom,
    }
    templar = Templar(loader=DataLoader(), variables=variables)
    return bool(templar.template(trust_as_template("{{ " + CHECK["ansible.builtin.assert"]["that"][0] + " }}")))


def test_a_rerun_with_the_weights_in_place_needs_only_the_headroom():
    # The H100 rerun that failed before: 28.9 GiB free, a 15 GiB model already there, 20 GiB headroom.
    assert _room(28.9, 15.0, 15.0, 20)
    assert not _room(28.9, 0, 15.0, 20)


def test_partly_downloaded_weights_count_for_what_they_hold():
    assert _room(30, 10, 15, 20)
    assert not _room(30, 4, 15, 20)


def test_more_on_disk_than_the_model_needs_no_negative_room():
    assert not _room(10, 40, 15, 20)


@pytest.mark.parametrize("headroom", ["20", "20.0"])
def test_a_headroom_given_as_a_string_on_the_command_line_is_a_number(headroom):
    assert _room(36, 0, 15, headroom) and not _room(34, 0, 15, headroom)


def test_no_model_size_means_no_check():
    assert _room(0, 0, 0, 20)


MEASURE = yaml.safe_load((Path(__file__).resolve().parents[2] / "roles/preflight/tasks/disk.yml").read_text())[0]


def _render(template: str, variables: dict) -> str:
    templar = Templar(loader=DataLoader(), variables={k: trust_as_template(v) if isinstance(v, str) else v
                                                      for k, v in variables.items()})
    return templar.template(trust_as_template(template))


def test_a_refusal_names_the_copies_of_other_models_and_their_sizes(tmp_path):
    # Switching kimi_model on a small disk (the GPU run's 64 GiB): the old copy is what holds the space.
    state = tmp_path / "state"
    old = state / "models/e2e/llama-3.1-8b@main"
    old.mkdir(parents=True)
    with open(old / "model.safetensors", "wb") as weights:  # 1.5 GiB of blocks, allocated at once
        os.posix_fallocate(weights.fileno(), 0, 3 * GIB // 2)
    (state / "models/gpt2@main").mkdir()
    (state / "models/e2e/deepseek-v3-4l@main").mkdir()  # the model asked for: not "another" copy
    variables = {
        "kimi_state_dir": str(state),
        "kimi_model": "e2e/deepseek-v3-4l",
        "kimi_model_dir": str(state / "models/e2e/deepseek-v3-4l@main"),
    }
    script = _render(MEASURE["ansible.builtin.shell"], variables)
    measured = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    lines = measured.splitlines()
    assert len(lines) == 3, measured
    assert [line.split(" ", 1)[1] for line in lines[1:]] == [str(old), str(state / "models/gpt2@main")]
    assert lines[1].split()[0] == "1.5"

    check = CHECK["ansible.builtin.assert"]
    message = _render(check["fail_msg"], {
        **variables, **CHECK["vars"],
        "_preflight_df": {"stdout": measured, "stdout_lines": lines},
        "_preflight_model_gb": 13.7,
        "kimi_preflight_disk_headroom_gb": 20,
    })
    assert f"hold 1.5 GiB: {old} (1.5 GiB), {state}/models/gpt2@main (0.0 GiB);" in message, message
    assert "deepseek-v3-4l@main" not in message
    assert "remove those no longer served" in message, message


def test_a_refusal_without_other_copies_says_to_free_space(tmp_path):
    variables = {"kimi_state_dir": str(tmp_path / "absent"), "kimi_model": "org/m",
                 "kimi_model_dir": str(tmp_path / "absent/models/org/m@main")}
    script = _render(MEASURE["ansible.builtin.shell"], variables)
    measured = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    message = _render(CHECK["ansible.builtin.assert"]["fail_msg"], {
        **variables, **CHECK["vars"],
        "_preflight_df": {"stdout": measured, "stdout_lines": measured.splitlines()},
        "_preflight_model_gb": 15, "kimi_preflight_disk_headroom_gb": 20,
    })
    assert "Free space, attach a larger volume" in message and "Copies of other models" not in message
