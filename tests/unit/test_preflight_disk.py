"""Preflight's disk check, as the role evaluates it: the assertion of roles/preflight/tasks/disk.yml rendered with
Ansible's templar from what the host measured (free bytes, and the bytes of the weights already on it)."""

from __future__ import annotations

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
