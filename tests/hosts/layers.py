"""Captured hosts: a host converged once, its changes kept as an overlay layer that later hosts boot on.

Installing vLLM into the runtime venv is most of a fresh host's first site.yml run. Test modules that
check what a served host does, not how it got there, boot their hosts on a layer captured after a
playbook ran on a bare host; site.yml then runs on them for real, and the roles take the path of a
rerun (the runtime role adopts the venv whose stamp matches). Modules that test converging itself keep
booting bare hosts.

A layer is named by a hash of everything the captured state depends on: the root image, the playbook,
every role, playbook, and file of the package, ansible.cfg and the variables. A change to any of them
builds a new layer; a stale one is never used.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import tempfile
import time
from pathlib import Path

from tests.hosts.ansible import PROJECT_ROOT, ansible_playbook
from tests.hosts.nspawn import HostError, Network, TestHost, _root_key, cache_dir, cache_lock, write_inventory

# What a converged host is made of; any change under these paths makes a new layer.
_INPUTS = ("site.yml", "ansible.cfg", "pyproject.toml", "playbooks", "roles", "kimi_service")
# Layers of one name kept beside the newest (another checkout may still boot on an older one).
_KEEP_OLDER = 2


def layer_key(playbook: str, extra_vars: dict, project: Path = PROJECT_ROOT) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"root": _root_key(), "playbook": playbook, "vars": extra_vars},
                             sort_keys=True).encode())
    for top in _INPUTS:
        path = project / top
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if "__pycache__" in file.parts:
                continue
            digest.update(str(file.relative_to(project)).encode() + b"\0")
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:16]


def captured_layer(name: str, playbook: str, extra_vars: dict) -> Path:
    """The layer of a bare host after `playbook` ran on it with `extra_vars`; built on first use."""
    layers = cache_dir() / "layers"
    layer = layers / f"{name}-{layer_key(playbook, extra_vars)}"
    complete = layer.with_name(layer.name + ".complete")
    with cache_lock(layers / f"{name}.lock"):
        if complete.exists():
            return layer
        shutil.rmtree(layer, ignore_errors=True)
        started = time.monotonic()
        _capture(layer, playbook, extra_vars)
        complete.write_text(f"{playbook} {json.dumps(extra_vars, sort_keys=True)}\n")
        print(f"\ntesthost: captured layer {layer.name} in {time.monotonic() - started:.0f} s")
        _prune(layers, name)
    return layer


def _capture(layer: Path, playbook: str, extra_vars: dict) -> None:
    network = Network.create()
    host = TestHost.create(f"kt-capture-{secrets.token_hex(2)}", network=network)
    try:
        host.start()
        with tempfile.TemporaryDirectory() as scratch:
            inventory = write_inventory(Path(scratch) / "hosts.yml", [host], extra_vars=extra_vars)
            run = ansible_playbook(playbook, inventory)
        if run.returncode != 0:
            raise HostError(f"capturing {layer.name}: {playbook} failed on a bare host\n{run}")
        host.stop(timeout=60, keep_upper=layer)
    finally:
        host.stop()
        network.destroy()


def _prune(layers: Path, name: str) -> None:
    done = sorted(layers.glob(f"{name}-*.complete"), key=lambda p: p.stat().st_mtime, reverse=True)
    for marker in done[1 + _KEEP_OLDER:]:
        marker.unlink(missing_ok=True)
        shutil.rmtree(marker.with_suffix(""), ignore_errors=True)
