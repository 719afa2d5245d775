"""The gpu stage (nvidia_driver, cuda_toolkit) and preflight on real systemd hosts.

NVIDIA's repository cannot be reached here: tests/support/fake_nvidia_repo.py serves signed stand-in
packages with NVIDIA's Debian 12 names, versions and dependencies. Test hosts are containers without
NVIDIA devices, so the install path runs with the documented test-only fact override (a host that is
not a container, with 8 GPUs) and kimi_nvidia_driver_kernel_steps: false (no kernel to reboot into);
apt, pins, holds, keyring, repository files and systemd units are real. The skip and stop paths run
on the real detection.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator

import pytest

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import TestHost, write_inventory
from tests.support.fake_nvidia_repo import FakeNvidiaRepo, driver_packages, support_packages, toolkit_packages
from tests.support.tiny_model import ensure_tiny_model

DRIVER = "580.95.05"
NEWER_IN_BRANCH = "580.105.08"
NEWER_BRANCH = "590.48.01"
OLDER_BRANCH = "575.57.08"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Iterator[tuple[FakeNvidiaRepo, str]]:
    fake = FakeNvidiaRepo(tmp_path_factory.mktemp("nvidia-repo") / "repos")
    fake.publish([*driver_packages(DRIVER), *driver_packages(NEWER_BRANCH), *driver_packages(OLDER_BRANCH),
                  *toolkit_packages(13, 0, 2), *support_packages()])
    url = fake.serve("127.0.0.1")
    yield fake, url
    fake.stop()


@pytest.fixture(scope="module")
def new_host(tmp_path_factory) -> Iterator[Callable[[], tuple[TestHost, object]]]:
    """Boots fresh hosts on the controller's network (they reach the repository on 127.0.0.1)."""
    hosts: list[TestHost] = []

    def factory() -> tuple[TestHost, object]:
        host = TestHost.create(f"kt-gpu-{secrets.token_hex(3)}")
        hosts.append(host)
        host.start()
        return host, write_inventory(tmp_path_factory.mktemp("inventory") / "hosts.yml", [host])

    yield factory
    for host in hosts:
        host.stop()


def _install_vars(url: str, *, nvswitch: bool, **extra) -> dict:
    return {
        "kimi_nvidia_driver_repo_url": url,
        "kimi_nvidia_driver_kernel_steps": False,
        "kimi_preflight_facts_override": {
            "kimi_host_in_container": False, "kimi_gpu_count": 8, "kimi_gpu_nvswitch": nvswitch,
            "kimi_gpu_spec": "H100-SXM5-80GB:8",
        },
        **extra,
    }


def _versions(host: TestHost) -> dict[str, str]:
    out = host.ssh("dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'").stdout
    return {f[1]: f[2] for f in (line.split() for line in out.splitlines()) if f[0] in ("ii", "hi")}


# ---------------------------------------------------------------------------------------------
# Install on an HGX-like host (NVSwitch) with the toolkit


@pytest.fixture(scope="module")
def hgx(repo, new_host):
    _, url = repo
    host, inventory = new_host()
    extra = _install_vars(url, nvswitch=True, kimi_cuda_toolkit_enabled=True)
    first = ansible_playbook("site.yml", inventory, "--tags", "gpu", extra_vars=extra)
    return host, inventory, extra, first


def test_installs_the_pinned_driver_fabric_manager_and_toolkit(hgx):
    host, _, _, first = hgx
    assert first.returncode == 0, str(first)
    assert first.changed > 0
    versions = _versions(host)
    for name in ("nvidia-kernel-open-dkms", "nvidia-driver-cuda", "libcuda1", "libnvidia-ml1",
                 "nvidia-persistenced", "nvidia-fabricmanager", "libnvidia-nscq"):
        assert versions.get(name) == f"{DRIVER}-1", (name, versions.get(name))
    assert "nvidia-kernel-dkms" not in versions, "open modules are the default"
    assert versions.get("cuda-toolkit-13-0") == "13.0.2-1"
    assert "/usr/local/cuda-13.0/bin" in host.ssh("bash -lc 'echo $PATH'").stdout


def test_every_driver_and_cuda_package_is_held(hgx):
    host, *_ = hgx
    held = set(host.ssh("apt-mark showhold").stdout.split())
    expected = {"nvidia-kernel-open-dkms", "nvidia-driver-cuda", "libcuda1", "libnvidia-ml1", "nvidia-persistenced",
                "nvidia-fabricmanager", "libnvidia-nscq", "cuda-toolkit-13-0", "cuda-nvcc-13-0"}
    assert expected <= held, expected - held
    assert not any(name.startswith("linux-headers") for name in held), held
    blacklist = host.ssh("cat /etc/apt/apt.conf.d/51kimi-nvidia-hold").stdout
    assert "Unattended-Upgrade::Package-Blacklist" in blacklist and '"nvidia-";' in blacklist
    config = host.ssh("apt-config dump Unattended-Upgrade::Package-Blacklist").stdout
    assert '"libnvidia-"' in config, "apt must parse the blacklist file"


def test_repository_is_signed_and_pinned(hgx, repo):
    host, *_ = hgx
    _, url = repo
    listing = host.ssh("cat /etc/apt/sources.list.d/kimi-nvidia-cuda.list").stdout
    assert f"deb [signed-by=/etc/apt/keyrings/kimi-nvidia-cuda.asc] {url}/debian12/x86_64/ /" in listing
    policy = host.ssh("apt-cache policy nvidia-driver-cuda").stdout
    assert f"{DRIVER}-1" in policy and "1001" in policy, policy
    assert "blacklist nouveau" in host.ssh("cat /etc/modprobe.d/kimi-blacklist-nouveau.conf").stdout


def test_persistenced_and_fabric_manager_run(hgx):
    host, *_ = hgx
    for unit in ("nvidia-persistenced", "nvidia-fabricmanager"):
        assert host.ssh(f"systemctl is-enabled {unit}").stdout.strip() == "enabled"
        assert host.ssh(f"systemctl is-active {unit}").stdout.strip() == "active"


def test_second_run_and_check_mode_change_nothing(hgx):
    _, inventory, extra, _ = hgx
    second = ansible_playbook("site.yml", inventory, "--tags", "gpu", extra_vars=extra)
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent: {second.changed_tasks()}\n{second}"
    # dpkg already has every package at its version: apt (seconds a package even as a no-op) is not run for
    # the headers, the module, the libraries, fabric manager or the toolkit.
    apt_tasks = [(task, status) for task, status in second.task_statuses() if task.startswith("kimi_common : Install ")]
    assert len(apt_tasks) == 5 and {status for _, status in apt_tasks} == {"skipping"}, apt_tasks
    check = ansible_playbook("site.yml", inventory, "--tags", "gpu", "--check", extra_vars=extra)
    assert check.returncode == 0, str(check)
    assert check.changed == 0, f"--check would change: {check.changed_tasks()}\n{check}"


def test_a_newer_release_is_not_picked_up_by_apt_upgrade(hgx, repo):
    host, *_ = hgx
    fake, _ = repo
    fake.publish(driver_packages(NEWER_IN_BRANCH))
    host.ssh("apt-get update -qq")
    upgradable = host.ssh("apt list --upgradable 2>/dev/null").stdout
    assert NEWER_IN_BRANCH in upgradable, f"the newer release must be visible, else this proves nothing:\n{upgradable}"
    host.ssh("DEBIAN_FRONTEND=noninteractive apt-get -y upgrade")
    assert _versions(host)["nvidia-driver-cuda"] == f"{DRIVER}-1"
    assert _versions(host)["nvidia-fabricmanager"] == f"{DRIVER}-1"


def test_reboot_needed_without_permission_stops_with_the_command(hgx):
    _, inventory, extra, _ = hgx
    run = ansible_playbook("site.yml", inventory, "--tags", "gpu",
                           extra_vars={**extra, "kimi_nvidia_driver_kernel_steps": True,
                                       "kimi_nvidia_driver_reboot": False})
    assert run.returncode != 0
    assert "Run `sudo systemctl reboot`" in run.output, str(run)
    assert "kimi_nvidia_driver_reboot is false" in run.output


# ---------------------------------------------------------------------------------------------
# Without NVSwitch: adoption, refusal and a forced replacement


def test_present_driver_is_adopted_refused_or_forced(repo, new_host):
    _, url = repo
    host, inventory = new_host()
    # A rented host that came with a newer branch, installed from the same repository by hand.
    host.ssh(f"curl -fsS {url}/debian12/x86_64/3bf863cc.pub -o /etc/apt/keyrings/vendor.asc && "
             f"echo 'deb [signed-by=/etc/apt/keyrings/vendor.asc] {url}/debian12/x86_64/ /' "
             f">/etc/apt/sources.list.d/vendor.list && apt-get update -qq && "
             f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nvidia-kernel-open-dkms={NEWER_BRANCH}-1 "
             f"nvidia-driver-cuda={NEWER_BRANCH}-1 && "
             "rm /etc/apt/sources.list.d/vendor.list /etc/apt/keyrings/vendor.asc")
    base = _install_vars(url, nvswitch=False)

    adopt = ansible_playbook("site.yml", inventory, "--tags", "gpu", extra_vars=base)
    assert adopt.returncode == 0, str(adopt)
    assert f"Adopted NVIDIA driver {NEWER_BRANCH}" in adopt.output
    assert adopt.changed == 0, adopt.changed_tasks()
    assert _versions(host)["nvidia-driver-cuda"] == f"{NEWER_BRANCH}-1"

    # As an operator types it: `-e name=false` is the string "false", which must not force.
    refuse = ansible_playbook("site.yml", inventory, "--tags", "gpu", "-e", "kimi_nvidia_driver_force=false",
                              extra_vars={**base, "kimi_nvidia_driver_version": DRIVER})
    assert refuse.returncode != 0
    assert "Nothing was changed" in refuse.output and "kimi_nvidia_driver_force: true" in refuse.output
    assert refuse.changed == 0
    assert _versions(host)["nvidia-driver-cuda"] == f"{NEWER_BRANCH}-1"

    forced = ansible_playbook("site.yml", inventory, "--tags", "gpu", "-e", "kimi_nvidia_driver_force=yes",
                              extra_vars={**base, "kimi_nvidia_driver_version": DRIVER})
    assert forced.returncode == 0, str(forced)
    versions = _versions(host)
    assert versions["nvidia-driver-cuda"] == f"{DRIVER}-1"
    assert "nvidia-driver-cuda" in host.ssh("apt-mark showhold").stdout
    # A host without NVSwitch gets no fabric manager; persistenced runs all the same.
    assert "nvidia-fabricmanager" not in versions
    assert host.ssh("systemctl is-active nvidia-persistenced").stdout.strip() == "active"


def test_older_branch_is_refused(repo, new_host):
    _, url = repo
    host, inventory = new_host()
    run = ansible_playbook("site.yml", inventory, "--tags", "gpu",
                           extra_vars=_install_vars(url, nvswitch=False, kimi_preflight_facts_override={
                               "kimi_host_in_container": False, "kimi_gpu_count": 8,
                               "kimi_gpu_driver_version": OLDER_BRANCH}))
    assert run.returncode != 0
    assert f"NVIDIA driver {OLDER_BRANCH} is present (loaded)" in run.output, str(run)
    assert "nvidia-driver-cuda" not in _versions(host)


# ---------------------------------------------------------------------------------------------
# Skip and stop paths on the real detection (a container without NVIDIA devices)


@pytest.fixture(scope="module")
def plain(new_host):
    return new_host()


def _gpu(inventory, **extra):
    return ansible_playbook("site.yml", inventory, "--tags", "gpu", extra_vars=extra)


def test_container_is_detected_and_skipped(plain):
    host, inventory = plain
    run = _gpu(inventory)
    assert run.returncode == 0, str(run)
    assert "NVIDIA driver skipped: the host is a container (systemd-nspawn)" in run.output, str(run)
    assert run.changed == 0
    assert "nvidia" not in host.ssh("ls /etc/apt/sources.list.d /etc/apt/preferences.d").stdout


def test_no_gpu_and_manage_false_are_skipped(plain):
    _, inventory = plain
    run = _gpu(inventory, kimi_preflight_facts_override={"kimi_host_in_container": False})
    assert run.returncode == 0, str(run)
    assert "NVIDIA driver skipped: no NVIDIA PCI devices were found" in run.output
    run = _gpu(inventory, kimi_nvidia_driver_manage=False)
    assert "NVIDIA driver skipped: kimi_nvidia_driver_manage is false" in run.output


def test_preflight_stops_on_wrong_os_secure_boot_disk_and_fit(plain):
    _, inventory = plain
    wrong_os = ansible_playbook("playbooks/preflight.yml", inventory,
                                extra_vars={"kimi_preflight_supported_os": ["Ubuntu-24"]})
    assert wrong_os.returncode != 0 and "Debian 12" in wrong_os.output and "is not supported" in wrong_os.output

    secure_boot = ansible_playbook("playbooks/preflight.yml", inventory, extra_vars={
        "kimi_preflight_plan": False,
        "kimi_preflight_facts_override": {"kimi_host_in_container": False, "kimi_gpu_count": 8,
                                          "kimi_host_secure_boot": "enabled"}})
    assert secure_boot.returncode != 0
    assert "Secure Boot is enabled" in secure_boot.output and "mokutil --import" in secure_boot.output

    disk = ansible_playbook("playbooks/preflight.yml", inventory, extra_vars={"kimi_preflight_model_size_gb": 10**6})
    assert disk.returncode != 0 and "GiB headroom" in disk.output, str(disk)

    # A program of another user on the API port is named, with the variable that would move the service.
    host, _ = plain
    host.ssh("runuser -u nobody -- setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null & sleep 1")
    try:
        held = ansible_playbook("playbooks/preflight.yml", inventory, extra_vars={"kimi_preflight_plan": False})
    finally:
        host.ssh("pkill -f 'http.server 8000'", check=False)
    assert held.returncode != 0, str(held)
    assert re.search(r"port 8000 \(kimi_api_port\) is held by python3 \(pid \d+, uid 65534\)", held.said), str(held)

    passes = ansible_playbook("playbooks/preflight.yml", inventory)
    assert passes.returncode == 0, str(passes)
    assert "Planner check skipped: the CPU engine is used" in passes.output
    assert passes.changed == 0


def test_preflight_stops_when_the_planner_says_it_does_not_fit(plain):
    _, inventory = plain
    run = ansible_playbook("playbooks/preflight.yml", inventory, extra_vars={
        "kimi_model": "moonshotai/Kimi-K2.5", "kimi_preflight_gpus": "H200:1"})
    assert run.returncode != 0
    assert "does not fit on H200:1" in run.output, str(run)
    # `-e kimi_preflight_plan=false` as typed (a string) turns the fit check off.
    unplanned = ansible_playbook("playbooks/preflight.yml", inventory, "-e", "kimi_preflight_plan=false", extra_vars={
        "kimi_model": "moonshotai/Kimi-K2.5", "kimi_preflight_gpus": "H200:1"})
    assert "Planner check skipped: kimi_preflight_plan is false" in unplanned.output, str(unplanned)
    assert "does not fit on H200:1" not in unplanned.output, str(unplanned)
    # It fits on 8 GPUs; then the planner's weight size drives the disk check, which a test host's
    # disk cannot pass for a ~550 GiB model.
    fits = ansible_playbook("playbooks/preflight.yml", inventory, extra_vars={
        "kimi_model": "moonshotai/Kimi-K2.5", "kimi_preflight_gpus": "8xH200"})
    assert "does not fit on 8xH200" not in fits.output, str(fits)
    assert fits.returncode != 0 and "plus 20 GiB headroom" in fits.said, str(fits)
    # A model from the controller's own directory is planned from that directory (its name is in no
    # catalog); a number given on the command line (`-e name=value`) is a string, and is read as a number.
    local = ansible_playbook("playbooks/preflight.yml", inventory, "-e", "kimi_preflight_disk_headroom_gb=1",
                             extra_vars={"kimi_model": "test-org/only-on-the-controller", "kimi_model_source": "local",
                                         "kimi_model_local_path": str(ensure_tiny_model()),
                                         "kimi_preflight_gpus": "H100-SXM5-80GB:1"})
    assert local.returncode == 0, str(local)
    recorded = ("preflight : Record the plan and the commit it read for later stages", "ok")
    assert recorded in local.task_statuses(), str(local)
