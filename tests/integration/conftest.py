"""Fixtures that boot real systemd test hosts (see tests/hosts/nspawn.py).

- `testhost`: one fresh host per test module on the controller's network, with `testhost_inventory`.
- `make_hosts(n)`: n fresh hosts, each in a network namespace of its own on a shared bridge; they
  reach each other and the controller (the bridge's gateway address) by IP. `make_hosts(n, layers)`
  boots them on captured layers (tests/hosts/layers.py), except the indexes named in `bare`.
A host's journal and console are printed when any test that used it failed, and with a failed test its
report shows every process of the controller and the hosts, with their states; hosts are always stopped
by PID and unmounted.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pytest

from tests.hosts.nspawn import HostError, Network, TestHost, write_inventory

_failed_nodes: set[str] = set()


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _failed_nodes.add(item.module.__name__ if item.module else item.nodeid)
        report.sections.append(("processes when it failed", _process_snapshot()))


def _process_snapshot() -> str:
    """Every process of the controller and its test hosts when a test failed: which engine was stuck
    where (state, CPU it last ran on, CPU time, kernel wait channel, the CPUs it may run on)."""
    table = subprocess.run(
        ["ps", "-eo", "pid,ppid,stat,psr,pcpu,time,wchan:24,args", "--sort=-pcpu"],
        capture_output=True, text=True, check=False,
    ).stdout.splitlines()
    lines = [line[:220] for line in table[:60]]
    for line in table[1:]:
        pid, _, state = line.split(None, 3)[:3]
        if state[0] in "DR" and "python" in line:
            status = Path(f"/proc/{pid}/status")
            with contextlib.suppress(OSError):
                fields = dict(f.split(":", 1) for f in status.read_text().splitlines() if ":" in f)
                lines.append(f"{pid}: " + ", ".join(
                    f"{k}={fields[k].strip()}" for k in ("State", "Cpus_allowed_list", "nonvoluntary_ctxt_switches")
                    if k in fields))
    with contextlib.suppress(OSError):
        lines += [line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("cpu")]
    return "\n".join(lines)


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("test hosts need root (systemd-nspawn, mounts, network namespaces)")


def _boot(host: TestHost) -> TestHost:
    try:
        host.start()
    except HostError:
        host.stop()
        raise
    return host


def _teardown(hosts: list[TestHost], module_name: str, networks: Collection[Network] = ()) -> None:
    try:
        if module_name in _failed_nodes:
            for host in hosts:
                print(f"\n===== diagnostics of {host.name} (a test in {module_name} failed) =====")
                print(host.diagnostics())
    finally:
        try:
            for host in hosts:
                host.stop()
        finally:
            for network in networks:
                network.destroy()


@pytest.fixture(scope="module")
def testhost(request) -> Iterator[TestHost]:
    _require_root()
    host = _boot(TestHost.create(f"kt-{secrets.token_hex(3)}"))
    yield host
    _teardown([host], request.module.__name__)


@pytest.fixture(scope="module")
def testhost_inventory(testhost, tmp_path_factory) -> Path:
    return write_inventory(tmp_path_factory.mktemp("inventory") / "hosts.yml", [testhost])


@pytest.fixture(scope="module")
def make_containers(request) -> Iterator[Callable[..., TestHost]]:
    """A factory: make_containers(persist_dir) boots a host shaped like a rented container (no systemd, no
    network administration) in a network namespace of its own, with `persist_dir` bind-mounted at
    /workspace. Calling it again with the same directory is the container restarted: a fresh root, the
    same volume, `start_command` run before sshd (the provider's start command)."""
    _require_root()
    network = Network.create()
    hosts: list[TestHost] = []

    def factory(persist_dir: Path, start_command: str = "") -> TestHost:
        for old in hosts:
            old.stop()
        host = TestHost.create(f"kt-{network.name}-c{len(hosts)}", network=network, index=len(hosts),
                               systemd=False, binds=(f"{persist_dir}:/workspace",), start_command=start_command)
        hosts.append(host)
        host.start()
        return host

    yield factory
    _teardown(hosts, request.module.__name__, [network])


@pytest.fixture(scope="module")
def make_hosts(request) -> Iterator[Callable[..., list[TestHost]]]:
    """A factory: make_hosts(n) boots n hosts in separate network namespaces on one bridge."""
    _require_root()
    networks: list[Network] = []
    hosts: list[TestHost] = []

    def factory(count: int, layers: tuple[Path, ...] = (), *, bare: Collection[int] = ()) -> list[TestHost]:
        network = Network.create()
        networks.append(network)
        booted = []
        for index in range(count):
            host = TestHost.create(f"kt-{network.name}-{index}", network=network, index=index,
                                   layers=() if index in bare else layers)
            hosts.append(host)
            booted.append(host)
            host.start()
        return booted

    yield factory
    _teardown(hosts, request.module.__name__, networks)
