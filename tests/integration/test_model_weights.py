"""model_weights on two real hosts in their own network namespaces, fetching the generated tiny model
from the hub server (tests/support/hub_server.py) on the bridge's gateway: fan-out, a fast no-op
rerun, a damaged file re-fetched alone, resume after a dropped connection, a corrupted download
caught, and the free-space refusal before any byte is written.

The weights stage only needs the `kimi-service` command on the host. Instead of the 3.5 GB engine
venv (tests/integration/test_vllm_runtime.py covers that stage), each host gets a venv with this
project's wheel over Debian's own httpx and PyYAML, at the path the runtime stage uses.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory
from tests.support.hub_server import Fault, HubServer
from tests.support.tiny_model import ensure_tiny_model

REPO = "kimi-test/tiny-llama"
MODEL_DIR = f"/var/lib/kimi-service/models/{REPO}@main"
BIG = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_model():
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def project_wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), "."], check=True)
    return next(out.glob("kimi_service-*.whl"))


@pytest.fixture(scope="module")
def hosts(make_hosts, project_wheel):
    booted = make_hosts(2)
    for host in booted:
        (host.merged / "root" / project_wheel.name).write_bytes(project_wheel.read_bytes())
        host.ssh(
            "apt-get update -q >/dev/null"
            " && apt-get install -y -q python3-venv python3-httpx python3-yaml >/dev/null"
            " && python3 -m venv --system-site-packages /opt/kimi-service/venv"
            f" && /opt/kimi-service/venv/bin/pip install -q --no-deps --no-index /root/{project_wheel.name}"
            " && useradd --system --no-create-home kimi"
            " && install -d -o kimi -g kimi -m 0750 /var/lib/kimi-service",
            timeout=600,
        )
    return booted


@pytest.fixture(scope="module")
def hub(hosts, tiny_model):
    gateway = hosts[0].address.rsplit(".", 1)[0] + ".1"
    with HubServer(root=tiny_model, repo=REPO, host=gateway) as server:
        yield server


@pytest.fixture(scope="module")
def inventory(hosts, hub, tmp_path_factory):
    return write_inventory(tmp_path_factory.mktemp("inv") / "hosts.yml", hosts, extra_vars={
        "kimi_model": REPO, "kimi_model_revision": "main", "kimi_hf_endpoint": hub.url,
        "kimi_model_verify": "full", "kimi_model_fanout": True, "kimi_model_progress_interval": 1,
        "kimi_hf_token": "hf_test_token_never_logged",
    })


def _digests(host, directory: str = MODEL_DIR) -> dict[str, str]:
    listing = "find . -type f ! -name '.kimi-*' -printf '%P\\0' | xargs -0 sha256sum"
    out = host.ssh(f"cd {directory} && {listing}").stdout
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def _expected(tiny_model) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny_model.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def converged(inventory, hub):
    run = ansible_playbook("playbooks/weights.yml", inventory)
    assert run.returncode == 0, str(run)
    return run


def test_fanout_downloads_once_and_every_host_has_verified_weights(converged, hosts, hub, tiny_model):
    expected = _expected(tiny_model)
    for host in hosts:
        assert _digests(host) == expected, host.name
        marker = host.ssh(f"cat {MODEL_DIR}/.kimi-weights.json").stdout
        assert '"commit": "' + hub.commit in marker and '"verified": "full"' in marker
        assert host.ssh(f"stat -c '%a %U' {MODEL_DIR}/{BIG}").stdout.split() == ["644", "root"]
    # The hub sent every file exactly once: the second host copied from the first.
    assert hub.sent_bytes(BIG) == (tiny_model / BIG).stat().st_size
    assert "hf_test_token_never_logged" not in converged.output
    assert "kimi-weights-fanout" not in hosts[0].ssh("systemctl list-units --no-legend").stdout


def test_rerun_on_converged_hosts_is_a_no_op(converged, inventory, hub):
    requests = len(hub.log)
    started = time.monotonic()
    rerun = ansible_playbook("playbooks/weights.yml", inventory)
    elapsed = time.monotonic() - started
    print(f"weights rerun on 2 converged hosts: {elapsed:.1f} s")
    assert rerun.returncode == 0, str(rerun)
    assert rerun.changed == 0, rerun.changed_tasks()
    assert len(hub.log) == requests
    check = ansible_playbook("playbooks/weights.yml", inventory, "--check")
    assert check.returncode == 0 and check.changed == 0, str(check)


def test_a_damaged_or_missing_file_is_fetched_again_alone(converged, inventory, hosts, hub, tiny_model):
    hosts[0].ssh(f"rm {MODEL_DIR}/config.json")
    hosts[1].ssh(f"printf 'XXXX' | dd of={MODEL_DIR}/{BIG} bs=1 seek=4096 conv=notrunc status=none")
    hub.log.clear()
    run = ansible_playbook("playbooks/weights.yml", inventory)
    assert run.returncode == 0, str(run)
    fetched = sorted(r.path.rsplit("/", 1)[1] for r in hub.log if r.method == "GET" and "/resolve/" in r.path)
    assert fetched == ["config.json"], fetched  # the damaged big file came from the first host, not the hub
    for host in hosts:
        assert _digests(host) == _expected(tiny_model)


def test_interrupted_and_corrupted_transfers_are_resumed_and_caught(converged, inventory, hosts, hub,
                                                                   tiny_model):
    size = (tiny_model / BIG).stat().st_size
    hub.faults[BIG] = Fault(drop_after=size // 3)
    hub.faults["tokenizer.json"] = Fault(corrupt=True)
    hub.log.clear()
    run = ansible_playbook("playbooks/weights.yml", inventory, "--limit", hosts[0].name,
                           extra_vars={"kimi_model_dir": "/var/lib/kimi-service/models/resume-test"})
    assert run.returncode == 0, str(run)
    big = hub.gets(BIG)
    assert [r.range for r in big] == [None, f"bytes={size // 3}-"]
    assert big[1].sent == size - size // 3 < size
    assert len(hub.gets("tokenizer.json")) == 2
    assert _digests(hosts[0], "/var/lib/kimi-service/models/resume-test") == _expected(tiny_model)


def test_not_enough_space_is_refused_before_any_byte(converged, inventory, hosts, hub):
    host = hosts[0]
    mounted = host.ssh("mkdir -p /mnt/small && mount -t tmpfs -o size=1M tmpfs /mnt/small", check=False)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs in the guest: {mounted.stderr}")
    hub.log.clear()
    run = ansible_playbook("playbooks/weights.yml", inventory, "--limit", host.name,
                           extra_vars={"kimi_model_dir": "/mnt/small/models/m", "kimi_model_fanout": False})
    assert run.returncode != 0
    assert "nothing was downloaded" in run.output, str(run)
    assert [r for r in hub.log if "/resolve/" in r.path] == []
    assert host.ssh("test -e /mnt/small/models/m", check=False).returncode != 0


def test_fanout_gets_through_the_first_hosts_firewall_only_while_it_copies(converged, inventory, hosts, hub,
                                                                          tiny_model, tmp_path):
    """A later run, the first host's firewall loaded from an inventory that listed it alone: the second host
    is new to its rules, and the weights stage lets it in for the transfer only."""
    first, second = hosts
    gateway = first.address.rsplit(".", 1)[0] + ".1"
    alone = write_inventory(tmp_path / "alone.yml", [first], extra_vars={
        **json.loads(inventory.read_text())["all"]["vars"], "kimi_firewall_allowed_cidrs": [f"{gateway}/32"],
    })
    firewall = ansible_playbook("playbooks/service.yml", alone, "--tags", "firewall")
    assert firewall.returncode == 0, str(firewall)
    chain = first.ssh("nft list chain inet kimi_service input").stdout
    assert "ip saddr @fanout_transfer_v4 tcp dport 8765 accept" in chain, chain
    second.ssh(f"rm -r {MODEL_DIR}")
    hub.log.clear()
    run = ansible_playbook("playbooks/weights.yml", inventory)
    assert run.returncode == 0, str(run)
    assert _digests(second) == _expected(tiny_model)
    assert hub.gets(BIG) == []  # from the first host, through its firewall
    for family in ("v4", "v6"):
        listed = first.ssh(f"nft list set inet kimi_service fanout_transfer_{family}").stdout
        assert "elements" not in listed, listed  # closed again
    assert "kimi-weights-fanout" not in first.ssh("systemctl list-units --all --no-legend").stdout


def test_preflight_plans_the_hub_model_and_the_weights_stage_fetches_only_that_commit(converged, inventory, hosts,
                                                                                      hub, tmp_path):
    """kimi-test/tiny-llama is in no catalog: preflight plans it on the controller from the hub's listing and
    small files (no weight byte), and records the commit it read; the weights stage takes that commit and
    no other, so a branch that moved between the plan and the fetch is named, not fetched. Last in this
    module: it moves the hub's branch."""
    hub.log.clear()
    # An empty cache of the hub's small files on the controller: a warm one (an earlier run's, kept by
    # commit) would answer for the hub.
    plan = ansible_playbook("playbooks/preflight.yml", inventory, env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
                            extra_vars={"kimi_preflight_gpus": "H100-SXM5-80GB:1"})
    assert plan.returncode == 0, str(plan)
    assert ("preflight : Record the plan and the commit it read for later stages", "ok") in plan.task_statuses()
    files = [r.path.rsplit("/", 1)[1] for r in hub.log if r.method == "GET" and "/resolve/" in r.path]
    assert "config.json" in files and not [f for f in files if f.endswith(".safetensors")], files
    assert "hf_test_token_never_logged" not in plan.output
    planned = hub.commit
    same = ansible_playbook("playbooks/weights.yml", inventory, "-e", f"kimi_model_planned_commit={planned}")
    assert same.returncode == 0 and same.changed == 0, str(same)
    for host in hosts:  # weights already there are the planned commit's: only a fetch reads the branch again
        host.ssh(f"rm -r {MODEL_DIR}")
    hub.commit = "b" * 40  # main moved after the plan
    try:
        moved = ansible_playbook("playbooks/weights.yml", inventory, "-e", f"kimi_model_planned_commit={planned}")
    finally:
        hub.commit = planned
    assert moved.returncode != 0
    assert planned in moved.said and "b" * 40 in moved.said, str(moved)
