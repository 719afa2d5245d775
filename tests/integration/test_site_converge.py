"""site.yml converges on a fresh systemd host, is idempotent, and --check finds nothing to do."""

from __future__ import annotations

import pytest

from tests.hosts.ansible import ansible_playbook


@pytest.fixture(scope="module")
def first_run(testhost_inventory):
    return ansible_playbook("site.yml", testhost_inventory)


def test_site_converges_on_a_fresh_host(first_run, testhost):
    assert first_run.returncode == 0, str(first_run)
    assert first_run.failed == 0, str(first_run)
    assert first_run.changed > 0, "a fresh host must need changes; did the stages run?\n" + str(first_run)
    user = testhost.ssh("getent passwd kimi").stdout.strip().split(":")
    assert user[6] == "/usr/sbin/nologin"
    dirs = "/etc/kimi-service /var/lib/kimi-service /opt/kimi-service"
    modes = testhost.ssh(f"stat -c '%n %a %U:%G' {dirs}").stdout
    assert "/etc/kimi-service 750 root:kimi" in modes
    assert "/var/lib/kimi-service 750 kimi:kimi" in modes


def test_second_run_changes_nothing(first_run, testhost_inventory):
    second = ansible_playbook("site.yml", testhost_inventory)
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent, changed: {second.changed_tasks()}\n{second}"


def test_check_mode_on_converged_host_reports_no_change(first_run, testhost_inventory):
    check = ansible_playbook("site.yml", testhost_inventory, "--check", "--diff")
    assert check.returncode == 0, str(check)
    assert check.changed == 0, f"--check would change: {check.changed_tasks()}\n{check}"


def test_idempotence_check_catches_a_command_without_changed_when(testhost_inventory, tmp_path):
    """The recap parsing the tests above rely on sees a task that always reports a change."""
    playbook = tmp_path / "not-idempotent.yml"
    playbook.write_text(
        "- hosts: kimi_hosts\n  gather_facts: false\n  tasks:\n"
        "    - name: Always changes\n      ansible.builtin.command: 'true'\n"
    )
    runs = [ansible_playbook(playbook, testhost_inventory) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), str(runs[-1])
    assert runs[1].changed == 1
    assert runs[1].changed_tasks() == ["Always changes"]
