"""The test-host machinery itself: boot, reboot, namespaces, failure evidence and cleanup."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.hosts.nspawn import HostError, TestHost


def _processes_rooted_in(path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                root = os.readlink(f"/proc/{entry}/root")
            except OSError:
                continue
            if root.startswith(str(path)):
                found.append(int(entry))
    return found


def test_host_runs_systemd_and_survives_a_reboot(testhost):
    assert testhost.ssh("systemctl is-system-running").stdout.strip() in {"running", "degraded"}
    assert testhost.ssh("systemd-detect-virt").stdout.strip() == "systemd-nspawn"
    testhost.ssh("touch /var/tmp/survives-reboot")
    boots = testhost.boots
    testhost.reboot()
    assert testhost.boots == boots + 1
    assert testhost.ssh("test -f /var/tmp/survives-reboot && cat /proc/1/comm").stdout.strip() == "systemd"


def test_hosts_in_namespaces_reach_each_other(make_hosts):
    first, second = make_hosts(2)
    assert first.address != second.address
    probe = f"import socket; socket.create_connection(('{second.address}', 22), 3)"
    out = first.ssh(f'python3 -c "{probe}" && echo ok')
    assert out.stdout.strip() == "ok"
    assert first.ssh("hostname").stdout.strip() == first.name


def test_the_same_unit_on_two_hosts_is_two_cgroups(make_hosts):
    """Stopping a unit on one host must not touch the unit of the same name on another."""
    first, second = make_hosts(2)
    for host in (first, second):
        host.ssh("systemd-run --unit=kimi-probe --property=KillMode=mixed sleep 600")
    first.ssh("systemctl stop kimi-probe")
    assert second.ssh("systemctl is-active kimi-probe", check=False).stdout.strip() == "active"
    journal = first.ssh("journalctl -u kimi-probe --no-pager -o cat").stdout
    assert "Failed to kill control group" not in journal, journal
    mine = {host.name: Path(f"/proc/{host.nspawn_pid}/cgroup").read_text() for host in (first, second)}
    assert all(f"kimi-testhosts/{name}" in text for name, text in mine.items()), mine
    second.ssh("systemctl stop kimi-probe")


def test_a_guest_that_fails_to_boot_reports_its_journal_and_leaves_nothing(capsys):
    host = TestHost.create("kt-broken-boot")
    merged, workdir = host.merged.resolve(), host.workdir
    # No init to run: the guest cannot boot.
    (host.merged / "sbin/init").unlink()
    (host.merged / "lib/systemd/systemd").unlink()
    with pytest.raises(HostError) as failure:
        try:
            host.start(timeout=10)
        finally:
            host.stop()
    message = str(failure.value)
    assert "exited while booting" in message or "did not reach running" in message
    assert "--- console of kt-broken-boot" in message
    assert "--- journal of kt-broken-boot" in message
    assert _processes_rooted_in(merged) == []
    mounts = subprocess.run(["cat", "/proc/self/mounts"], capture_output=True, text=True).stdout
    assert str(merged) not in mounts
    assert not workdir.exists()
