"""Preflight names a driverless host's GPUs from their PCI ids; the planner must accept every name it can produce.

The names come from kimi-service's own table (`kimi-service gpus --json`), rendered through the preflight
role's vars with Ansible's templar, exactly as the role derives kimi_gpu_spec.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from kimi_service import cli, hardware
from kimi_service.hardware import parse_gpu_spec

ROLES = Path(__file__).resolve().parents[2] / "roles"
# Ids preflight's own table held before kimi-service became the one home: none of them may fall out.
EARLIER_PREFLIGHT_IDS = {"0x20b0", "0x20b2", "0x20f1", "0x20b5", "0x2330", "0x2331", "0x2321", "0x2335", "0x233b",
                         "0x2901", "0x26b9", "0x26b5", "0x27b8", "0x2236", "0x2237", "0x2235"}


def _gpus_json() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["gpus", "--json"]) == 0
    return out.getvalue()


def _spec_from_pci(device: str, count: int) -> str:
    """kimi_gpu_spec as preflight derives it for `count` boards of PCI id `device` and no nvidia-smi."""
    loader = DataLoader()
    values = dict(loader.load_from_file(str(ROLES / "preflight/vars/main.yml"), trusted_as_template=True))
    lines = [f'pci {{"slot": "0000:{i:02x}:00.0", "class": "0x0302", "device": "{device}"}}' for i in range(count)]
    values.update(
        _preflight_probe={"stdout_lines": lines},
        _preflight_gpu_table={"rc": 0, "stdout": _gpus_json()},
        ansible_facts={"memtotal_mb": 1024},
    )
    return Templar(loader=loader, variables=values).template(trust_as_template("{{ _preflight_spec_from_pci }}"))


def _pci_ids() -> list[str]:
    return sorted({pci_id for gpu in hardware.KNOWN_GPUS for pci_id in gpu.pci_ids} | EARLIER_PREFLIGHT_IDS)


@pytest.mark.parametrize("device", _pci_ids())
def test_every_pci_id_preflight_names_is_a_gpu_the_planner_accepts(device):
    spec = _spec_from_pci(device, 8)
    assert spec, f"preflight cannot name PCI id {device}"
    gpus = parse_gpu_spec(spec)
    assert gpus.count == 8 and device in hardware.known_gpu(gpus.name).pci_ids


def test_an_unknown_pci_id_leaves_the_spec_empty():
    assert _spec_from_pci("0x0001", 2) == ""


def test_each_pci_id_names_one_gpu():
    ids = [pci_id for gpu in hardware.KNOWN_GPUS for pci_id in gpu.pci_ids]
    assert len(ids) == len(set(ids))
    listed = json.loads(_gpus_json())["gpus"]
    assert [gpu["name"] for gpu in listed] == [gpu.name for gpu in hardware.KNOWN_GPUS]


def test_preflight_keeps_no_gpu_table_of_its_own():
    text = "".join(path.read_text() for path in (ROLES / "preflight").rglob("*.yml"))
    assert not [pci_id for pci_id in EARLIER_PREFLIGHT_IDS if pci_id in text]
