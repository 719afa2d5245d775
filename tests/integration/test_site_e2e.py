"""The whole product on a fresh systemd host: the README's quick start followed as written, then systemctl,
faults, a reboot, bad input and secrets. No kimi_api_key is given: the play makes one, as it does for an
operator.

The first converge runs the shell block of the README's "Quick start: a rented GPU server" in a copy of the
checkout, with the operator's values put in (the server's address, the operator's address, the disk). What
cannot be as on a rented server is one group_vars file of test-only settings beside the example's: the SSH
details of the test host, the tiny model from the local hub server on the bridge's gateway, the CPU engine
from the offline wheelhouse. The host lives in a network namespace of its own (the firewall is on, allowing
the controller, the quick start's "own address"). Timings of the first converge and the no-op rerun are
printed (README records them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import testinfra

from tests.hosts.ansible import PROJECT_ROOT, ansible_playbook, parse_recap
from tests.hosts.nspawn import _ssh_keypair
from tests.support import clients
from tests.support.cpu_site import HF_TOKEN, REPO, SERVED, cpu_site_vars, journal_cursor, journal_since, stream_chat
from tests.support.cpu_site import gateway as gateway_of
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

WATCHDOG_SEC = 20


@pytest.fixture(scope="module")
def host(make_hosts):
    return make_hosts(1)[0]


@pytest.fixture(scope="module")
def gateway(host) -> str:
    return gateway_of(host)


@pytest.fixture(scope="module")
def hub(gateway):
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=gateway) as server:
        yield server


@pytest.fixture(scope="module")
def site_vars(hub, gateway) -> dict:
    given = cpu_site_vars(hub.url, gateway)
    del given["kimi_api_key"]  # the default: the play makes a key on the controller
    return {**given, "kimi_vllm_watchdog_sec": WATCHDOG_SEC}


QUICK_START = "## Quick start: a rented GPU server"
# The quick start's stand-ins for what each operator has (documentation addresses), and the test host's.
SERVER, OPERATOR, DISK, SERVED_AS = "203.0.113.10", "198.51.100.7/32", "/data/kimi-service", "kimi-k2.5"
# The suite's .venv is made by `make bootstrap` (a superset of `make controller`): running it in the copy
# would reinstall the project's own venv from there.
CONTROLLER_SETUP = "make controller"


def quick_start_block() -> str:
    """The first shell block under the README's quick-start heading, as an operator copies it."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    section = readme[readme.index(QUICK_START):]
    return re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1)


class QuickStart:
    """The quick start run in a copy of the checkout: the inventory it made and what it printed."""

    def __init__(self, checkout: Path, run: subprocess.CompletedProcess):
        self.inventory = checkout / "inventory" / "mine"
        self.stdout, self.returncode, self.recap = run.stdout, run.returncode, parse_recap(run.stdout)
        self.output = run.stdout + "\n" + run.stderr
        self.said = " ".join(self.output.split())

    def __str__(self) -> str:
        return f"(exit {self.returncode})\n{self.output[-20000:]}"


@pytest.fixture(scope="module")
def quick_start(host, site_vars, gateway, tmp_path_factory) -> QuickStart:
    """The README's quick start, followed as written against the test host (see the module's docstring)."""
    checkout = tmp_path_factory.mktemp("checkout")
    for entry in PROJECT_ROOT.iterdir():
        if entry.name not in ("inventory", ".git"):
            (checkout / entry.name).symlink_to(entry)
    shutil.copytree(PROJECT_ROOT / "inventory", checkout / "inventory",
                    ignore=shutil.ignore_patterns(".credentials", "credentials", "mine"))
    # Test-only settings, in the group the example documents every variable in; the operator's own
    # address comes from the quick start's edit (allowed through the firewall), not from here.
    test_only = {key: value for key, value in site_vars.items() if key != "kimi_firewall_allowed_cidrs"}
    connection = {k: v for k, v in host.inventory_vars().items() if k != "ansible_host"}
    test_vars = checkout / "inventory" / "example" / "group_vars" / "kimi_hosts" / "zz-test-only.yml"
    test_vars.parent.mkdir()
    test_vars.write_text(json.dumps({**test_only, **connection}, indent=2))

    block = quick_start_block()
    assert CONTROLLER_SETUP in block, "the quick start no longer sets up the controller as this test expects"
    script = (block.replace(CONTROLLER_SETUP, ": " + CONTROLLER_SETUP)
              .replace(SERVER, host.address).replace(OPERATOR, f"{gateway}/32").replace(DISK, "/var/lib/kimi-service")
              .replace(f'"model": "{SERVED_AS}"', f'"model": "{SERVED}"'))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    env.pop("ANSIBLE_CONFIG", None)  # as an operator runs it: the checkout's own ansible.cfg
    started = time.monotonic()
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=1800, stdin=subprocess.DEVNULL)
    print(f"\nfirst converge of site.yml (the README's quick start): {time.monotonic() - started:.0f} s")
    return QuickStart(checkout, run)


@pytest.fixture(scope="module")
def inventory(quick_start) -> Path:
    return quick_start.inventory


@pytest.fixture(scope="module")
def first_converge(quick_start):
    return quick_start


@pytest.fixture(scope="module")
def api_key(first_converge, inventory) -> str:
    """The key the play made: in the inventory's .credentials/ (git-ignored, never read as inventory), 0600,
    reused by every later run."""
    path = inventory / ".credentials" / "kimi-api-key"
    assert path.is_file(), f"no key was made in {path}\n{first_converge}"
    assert path.stat().st_mode & 0o777 == 0o600
    return path.read_text().strip()


@pytest.fixture(scope="module")
def api(host) -> str:
    return f"http://{host.address}:8000"


def _main_pid(host) -> int:
    return int(host.ssh("systemctl show -p MainPID --value kimi-vllm").stdout.strip())


def _engine_pid(host) -> int:
    """The vLLM API server: the child of `kimi-service serve`."""
    return int(host.ssh(f"pgrep -P {_main_pid(host)} -f vllm.entrypoints").stdout.split()[0])


def _wait_serving(host, api: str, old_main_pid: int, timeout: float = 300) -> None:
    """systemd has started a new `serve` and it is READY (active) with /health answering."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = host.ssh("systemctl is-active kimi-vllm", check=False).stdout.strip()
        if state == "active" and _main_pid(host) not in (0, old_main_pid):
            assert httpx.get(f"{api}/health", timeout=5).status_code == 200
            return
        time.sleep(2)
    journal = host.ssh("journalctl -u kimi-vllm -n 60 --no-pager", check=False).stdout
    raise AssertionError(f"kimi-vllm did not come back within {timeout:.0f} s\n{journal}")


def test_site_converges(first_converge, host, inventory, api_key):
    assert first_converge.returncode == 0, str(first_converge)
    assert first_converge.recap and all(h["failed"] == 0 for h in first_converge.recap.values()), str(first_converge)
    assert re.search(r"endpoint: +http://\S+:8000/v1", first_converge.output), "verify prints the endpoint"
    assert f"key in {inventory}/.credentials/kimi-api-key on the controller" in first_converge.said
    assert "*" in (inventory / ".credentials" / ".gitignore").read_text().splitlines()
    assert len(api_key) >= 40 and api_key not in first_converge.output
    assert host.ssh("systemctl is-active kimi-vllm kimi-exporter kimi-health.timer kimi-firewall").stdout.split() == [
        "active"] * 4


def test_the_quick_starts_request_is_answered(first_converge):
    """The block ends with the curl call an operator makes with the key: it got a completion."""
    answer = json.loads(first_converge.stdout.rstrip().splitlines()[-1])
    assert answer["choices"][0]["message"]["content"] is not None, str(first_converge)
    assert answer["usage"]["completion_tokens"] <= 64


def test_second_run_changes_nothing(first_converge, inventory):
    started = time.monotonic()
    second = ansible_playbook("site.yml", inventory)
    elapsed = time.monotonic() - started
    print(f"\nno-op rerun of site.yml: {elapsed:.0f} s")
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent: {second.changed_tasks()}\n{second}"


def test_check_mode_reports_nothing_to_change(first_converge, inventory):
    check = ansible_playbook("site.yml", inventory, "--check")
    assert check.returncode == 0, str(check)
    assert check.changed == 0, f"--check would change: {check.changed_tasks()}\n{check}"


def test_openai_client_streams_with_the_made_key_and_is_refused_without(first_converge, api, api_key):
    assert stream_chat(api, api_key)
    assert httpx.get(f"{api}/v1/models", timeout=10).status_code == 401
    # The engine's routes outside the OpenAI API answer only the host, whatever the key.
    refused = httpx.post(f"{api}/invocations", json={"prompt": "Hi", "max_tokens": 1}, timeout=10,
                         headers={"Authorization": f"Bearer {api_key}"})
    assert refused.status_code == 404, refused.text
    wrong = openai.OpenAI(base_url=f"{api}/v1", api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_the_openai_sdk_speaks_the_protocol_from_another_address(first_converge, api, api_key):
    """From the controller's bridge address, through the route gate, as a remote user calls it."""
    clients.check_openai_sdk(api, api_key, SERVED)


def test_tool_calls_come_back_parsed_with_the_parser_the_planner_chose(first_converge, api, api_key):
    """The tiny model's template has Hermes-style markers and no catalog entry: the plan chose the parser."""
    assert "tools: on (--tool-call-parser hermes)" in first_converge.said, str(first_converge)
    clients.check_tool_choices(api, api_key, SERVED)


def test_litellm_and_langchain_invoke_stream_and_call_tools(first_converge, api, api_key):
    clients.check_litellm(api, api_key, SERVED)
    clients.check_langchain(api, api_key, SERVED)


def test_guidellm_and_vllm_bench_serve_complete_through_the_gate(first_converge, api, api_key, tmp_path):
    """guidellm checks /health before it starts: the controller is in kimi_api_trusted_cidrs, as the
    README's Clients section tells a benchmarking machine to be."""
    totals = clients.run_guidellm(api, api_key, SERVED, ensure_tiny_model(), tmp_path)
    assert totals["successful"] == totals["total"] > 0 and totals["errored"] == 0, totals
    result = clients.run_vllm_bench_serve(api, api_key, SERVED, ensure_tiny_model(), tmp_path)
    assert result["completed"] == result["num_prompts"] > 0 and result["failed"] == 0, result


def test_exporter_serves_the_plan(first_converge, host):
    metrics = httpx.get(f"http://{host.address}:9400/metrics", timeout=10).text
    assert "kimi_plan_info{" in metrics
    assert re.search(r"^kimi_nvml_up(\{[^}]*\})? 0\.0$", metrics, re.MULTILINE), "no GPU here: NVML is down"


def test_a_failed_start_stops_the_play_with_serves_root_cause(first_converge, host, inventory):
    """The first converge's path (an engine that does not run is started, not restarted), with serve's /ready
    port taken by another program: the play names serve's own reason, not "see systemctl status". Preflight
    would name the program first (tests/integration/test_gpu_roles.py), so it is skipped here."""
    host.ssh("systemctl stop kimi-vllm")
    host.ssh("runuser -u nobody -- setsid python3 -m http.server 8001 >/dev/null 2>&1 < /dev/null & sleep 1")
    try:
        run = ansible_playbook("site.yml", inventory, "--skip-tags", "preflight")
    finally:
        host.ssh("pkill -f 'http.server 8001'", check=False)
    assert run.returncode != 0, str(run)
    assert "kimi-vllm.service did not become ready. root cause: cannot answer /ready" in run.said, str(run)
    assert "8001 (serve.ready_port)" in run.said, str(run)


def test_systemctl_start_returns_only_when_serving(first_converge, host, api):
    host.ssh("systemctl stop kimi-vllm")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{api}/health", timeout=3)
    # A restart is this stop and start; the play's own restarts (upgrade, roll-back) return the same way.
    host.ssh("systemctl start kimi-vllm", timeout=600)
    assert httpx.get(f"{api}/health", timeout=5).status_code == 200


def test_killed_engine_is_restarted_by_systemd(first_converge, host, api):
    main = _main_pid(host)
    cursor = journal_cursor(host)
    host.ssh(f"kill -9 {_engine_pid(host)}")
    _wait_serving(host, api, main)
    journal = journal_since(host, cursor)
    assert "vLLM killed by signal SIGKILL" in journal, journal
    # serve names the signal, exits 128 + 9 without a traceback, and systemd starts it again.
    dying = journal.split("vLLM killed by signal SIGKILL", 1)[1].split("Main process exited", 1)
    assert "Traceback" not in dying[0], journal
    assert dying[1].lstrip(", ").startswith("code=exited, status=137"), journal


def test_hung_engine_is_restarted_by_the_watchdog(first_converge, host, api):
    main = _main_pid(host)
    host.ssh(f"kill -STOP {_engine_pid(host)}")
    _wait_serving(host, api, main, timeout=WATCHDOG_SEC + 300)
    journal = host.ssh("journalctl -u kimi-vllm --no-pager").stdout
    assert "Watchdog timeout" in journal


def test_serving_again_after_a_reboot(first_converge, host, api):
    host.reboot()
    deadline = time.monotonic() + 300
    while host.ssh("systemctl is-active kimi-vllm", check=False).stdout.strip() != "active":
        assert time.monotonic() < deadline, host.ssh("journalctl -u kimi-vllm -b --no-pager", check=False).stdout
        time.sleep(2)
    assert httpx.get(f"{api}/health", timeout=5).status_code == 200


def test_corrupted_weight_file_is_fetched_again(first_converge, host, inventory):
    model = f"/var/lib/kimi-service/models/{REPO}@main/model.safetensors"
    good = host.ssh(f"sha256sum {model}").stdout.split()[0]
    host.ssh(f"printf 'garbage' | dd of={model} bs=1 seek=4096 conv=notrunc status=none")
    assert host.ssh(f"sha256sum {model}").stdout.split()[0] != good
    run = ansible_playbook("site.yml", inventory, "--tags", "weights")
    assert run.returncode == 0, str(run)
    assert host.ssh(f"sha256sum {model}").stdout.split()[0] == good


def test_invalid_value_fails_validation_before_any_change(first_converge, host, inventory):
    before = host.ssh("stat -c %Y /etc/kimi-service/config.yaml").stdout
    run = ansible_playbook("site.yml", inventory, extra_vars={"kimi_workload": "turbo"})
    assert run.returncode != 0
    assert "kimi_workload" in run.output and "turbo" in run.output
    assert run.changed == 0
    assert host.ssh("stat -c %Y /etc/kimi-service/config.yaml").stdout == before


def test_model_that_does_not_fit_stops_in_preflight(first_converge, inventory):
    run = ansible_playbook("site.yml", inventory, extra_vars={
        "kimi_model": "moonshotai/Kimi-K2.5", "kimi_engine": "cuda", "kimi_preflight_gpus": "A100-SXM4-80GB:4",
    })
    assert run.returncode != 0
    assert "does not fit" in run.output
    assert "TASK [nvidia_driver" not in run.output and "TASK [model_weights" not in run.output
    assert run.changed == 0


def test_secrets_never_leak(first_converge, host, inventory, api_key):
    # Reverify makes the fetch (which carries the hub token) run again, under -vvv.
    verbose = ansible_playbook("site.yml", inventory, "-vvv", extra_vars={"kimi_model_reverify": True})
    assert verbose.returncode == 0, str(verbose)
    for secret in (api_key, HF_TOKEN):
        assert secret not in verbose.output, f"{secret} in the -vvv play output"
        assert secret not in host.ssh("journalctl --no-pager -o cat").stdout, f"{secret} in the journal"
        cmdlines = host.ssh("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", check=False).stdout
        assert secret not in cmdlines, f"{secret} in a process's argv"
        hits = host.ssh(
            f"grep -rlF {secret} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null",
            check=False, timeout=600,
        ).stdout.split()
        readable = [
            path for path in hits
            if host.ssh(f"stat -c %a {path}").stdout.strip()[-1] != "0"
        ]
        assert readable == [], f"{secret} in world-readable files: {readable}"
    assert host.ssh("stat -c '%a %U' /etc/kimi-service/secrets.env").stdout.strip() == "600 root"


def test_vllm_unit_is_hardened(first_converge, host):
    out = host.ssh("systemd-analyze security --no-pager kimi-vllm.service").stdout
    exposure = float(re.search(r"Overall exposure level for kimi-vllm.service: ([0-9.]+)", out).group(1))
    print(f"\nsystemd-analyze security kimi-vllm.service: {exposure}")
    assert exposure <= 4.0


def test_host_state(first_converge, host):
    target = testinfra.get_host(
        f"ssh://root@{host.address}:{host.ssh_port}",
        ssh_identity_file=str(_ssh_keypair()),
        ssh_extra_args="-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR",
    )
    kimi = target.user("kimi")
    assert kimi.exists and kimi.shell == "/usr/sbin/nologin"
    for path, mode, owner, group in (
        ("/etc/kimi-service", 0o750, "root", "kimi"),
        ("/etc/kimi-service/config.yaml", 0o640, "root", "kimi"),
        ("/etc/kimi-service/secrets.env", 0o600, "root", "root"),
        ("/var/lib/kimi-service", 0o750, "kimi", "kimi"),
    ):
        item = target.file(path)
        assert (item.mode, item.user, item.group) == (mode, owner, group), path
    assert target.file("/opt/kimi-service/venv").is_symlink
    for port in (8000, 8001, 9400):  # the API, serve's /ready, the exporter
        assert target.socket(f"tcp://0.0.0.0:{port}").is_listening, port
    vllm = target.service("kimi-vllm")
    assert vllm.is_running and vllm.is_enabled
    properties = target.check_output("systemctl show kimi-vllm -p Type -p NotifyAccess -p User -p Restart")
    assert {"Type=notify", "NotifyAccess=main", "User=kimi", "Restart=on-failure"} <= set(properties.split())
    assert target.service("kimi-exporter").is_running
    assert target.service("kimi-health.timer").is_enabled


def test_idempotence_check_catches_a_command_without_changed_when(first_converge, inventory, tmp_path):
    """The recap parsing the idempotence tests rely on sees a task that always reports a change."""
    playbook = tmp_path / "not-idempotent.yml"
    playbook.write_text(
        "- hosts: kimi_hosts\n  gather_facts: false\n  tasks:\n"
        "    - name: Always changes\n      ansible.builtin.command: 'true'\n"
    )
    runs = [ansible_playbook(playbook, inventory) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), str(runs[-1])
    assert runs[1].changed == 1
    assert runs[1].changed_tasks() == ["Always changes"]


def test_upgrade_with_nothing_new_passes_the_health_gate_and_restarts_nothing(first_converge, host, inventory):
    before = _main_pid(host)
    run = ansible_playbook("playbooks/upgrade.yml", inventory)
    assert run.returncode == 0, str(run)
    assert "Health gate" in run.output
    assert _main_pid(host) == before


def test_uninstall_removes_everything_but_the_weights(first_converge, host, inventory):
    """Last in this module: it takes the service away. `-e name=false` is the string "false" to Ansible:
    the weights must survive it all the same, and `=true` then removes them."""
    run = ansible_playbook("playbooks/uninstall.yml", inventory, "-e", "kimi_uninstall_weights=false")
    assert run.returncode == 0, str(run)
    for unit in ("kimi-vllm.service", "kimi-exporter.service", "kimi-health.timer", "kimi-firewall.service"):
        assert host.ssh(f"systemctl cat {unit}", check=False).returncode != 0, f"{unit} is still installed"
    for path in ("/opt/kimi-service", "/etc/kimi-service", "/etc/nftables.d/kimi-service.nft"):
        assert host.ssh(f"test -e {path}", check=False).returncode != 0, f"{path} is still there"
    assert host.ssh("nft list table inet kimi_service", check=False).returncode != 0, "the firewall table stayed"
    assert host.ssh("ss -Hltn 'sport = :8000 or sport = :8001 or sport = :9400'").stdout.strip() == ""
    assert host.ssh(f"test -f /var/lib/kimi-service/models/{REPO}@main/model.safetensors", check=False).returncode == 0
    again = ansible_playbook("playbooks/uninstall.yml", inventory)
    assert again.returncode == 0 and again.changed == 0, str(again)
    weights = ansible_playbook("playbooks/uninstall.yml", inventory, "-e", "kimi_uninstall_weights=true")
    assert weights.returncode == 0, str(weights)
    assert host.ssh("test -e /var/lib/kimi-service", check=False).returncode != 0, "the weights stayed"
    assert host.ssh("id kimi", check=False).returncode != 0, "the service user stayed"
