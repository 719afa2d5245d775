"""The whole product on a host shaped like a rented container (RunPod, Vast.ai): no systemd, no network
administration, a persistent volume at /workspace. site.yml runs the services under supervisord; then
faults, a restart of the container on a fresh root, an upgrade's roll-back and the uninstall.

The volume is a directory of the controller bind-mounted into the host; a restart is a new host (fresh root)
on the same directory, booted with the start command the play printed. The venv lives on the volume, so
these hosts cannot boot on the captured runtime layer (it holds a venv under /opt). Instead the venv the
first converge left is kept in the cache (hard links) and put on the next run's fresh volume: the runtime
role adopts it only where its name, the role's identity of the pins, this project's files and the
wheelhouse, still matches, so any change to them installs the CPU engine from the offline wheelhouse
again, as on a new pod.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.hosts.ansible import PlaybookRun, ansible_playbook
from tests.hosts.nspawn import TestHost, cache_dir, cache_lock, write_inventory
from tests.support.cpu_site import API_KEY, REPO, SERVED, cpu_site_vars, stream_chat
from tests.support.cpu_site import gateway as gateway_of
from tests.support.hub_server import HubServer
from tests.support.tiny_model import ensure_tiny_model

WATCHDOG_SEC = 20
ROOT = "/workspace/kimi-service"
START = f"{ROOT}/start.sh"
SUPERVISORCTL = f"{ROOT}/install/venv/bin/supervisorctl -c /etc/kimi-service/supervisord.conf"
CTL = f"{ROOT}/install/venv/bin/kimi-service ctl"
LOG = f"{ROOT}/state/logs/kimi-vllm.log"
MODEL = f"{ROOT}/state/models/{REPO}@main/model.safetensors"


@dataclass
class Pod:
    """The rented container: replaced by a new host when it restarts."""

    host: TestHost
    inventory: Path
    volume: Path

    @property
    def api(self) -> str:
        return f"http://{self.host.address}:8000"


@pytest.fixture(scope="module")
def persist_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("workspace")


VENVS = "kimi-service/install/venvs"  # under the volume
KEPT_VENVS = "pod-venvs"  # under the cache


def _hard_link_copy(source: Path, target: Path) -> None:
    subprocess.run(["cp", "-al", str(source), str(target)], check=True)


def _seed_kept_venv(volume: Path) -> None:
    kept = cache_dir() / KEPT_VENVS
    with cache_lock(cache_dir() / f"{KEPT_VENVS}.lock"):
        for venv in sorted(kept.glob("[!.]*")):
            (volume / VENVS).mkdir(parents=True, exist_ok=True)
            _hard_link_copy(venv, volume / VENVS / venv.name)


def _keep_venv(volume: Path, name: str) -> None:
    """The converged pod's venv replaces the one kept before (its files are never written in place)."""
    kept = cache_dir() / KEPT_VENVS
    with cache_lock(cache_dir() / f"{KEPT_VENVS}.lock"):
        if (kept / name).is_dir():
            return
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir()
        _hard_link_copy(volume / VENVS / name, kept / f".{name}")
        (kept / f".{name}").rename(kept / name)  # an interrupted copy is never seeded


@pytest.fixture(scope="module")
def pod(make_containers, persist_dir, tmp_path_factory):
    _seed_kept_venv(persist_dir)
    host = make_containers(persist_dir)
    with HubServer(root=ensure_tiny_model(), repo=REPO, host=gateway_of(host)) as hub:
        site_vars = {**cpu_site_vars(hub.url, gateway_of(host)), "kimi_persist_root": "/workspace",
                     "kimi_vllm_watchdog_sec": WATCHDOG_SEC}
        inventory = write_inventory(tmp_path_factory.mktemp("pod") / "hosts.yml", [host], extra_vars=site_vars)
        yield Pod(host, inventory, persist_dir)


@pytest.fixture(scope="module")
def first_converge(pod) -> PlaybookRun:
    started = time.monotonic()
    run = ansible_playbook("site.yml", pod.inventory)
    print(f"\nfirst converge of site.yml under supervisord: {time.monotonic() - started:.0f} s")
    if run.returncode == 0:
        _keep_venv(pod.volume, pod.host.ssh(f"readlink {ROOT}/install/venv").stdout.strip().rsplit("/", 1)[1])
    return run


def _serve_pid(host: TestHost) -> int:
    """serve's pid under supervisord; 0 while supervisord does not answer (a container still starting)."""
    answer = host.ssh(f"{SUPERVISORCTL} pid kimi-vllm", check=False).stdout.strip()
    return int(answer) if answer.isdigit() else 0


def _engine_pid(host: TestHost) -> int:
    """The vLLM API server: the child of `kimi-service serve`."""
    return int(host.ssh(f"pgrep -P {_serve_pid(host)} -f vllm.entrypoints").stdout.split()[0])


def _wait_serving(pod: Pod, old_serve_pid: int, timeout: float = 300) -> None:
    """supervisord runs a new `serve` and its /ready answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _serve_pid(pod.host) not in (0, old_serve_pid):
            try:
                if httpx.get(f"http://{pod.host.address}:8001/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
        time.sleep(2)
    log = pod.host.ssh(f"cat /var/log/kimi-start.log; tail -n 60 {LOG}", check=False).stdout
    status = pod.host.ssh(f"{SUPERVISORCTL} status", check=False).stdout
    raise AssertionError(f"kimi-vllm did not serve again within {timeout:.0f} s\n{status}\n{log}")


def _chat(api: str) -> str:
    client = openai.OpenAI(base_url=f"{api}/v1", api_key=API_KEY)
    reply = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return reply.choices[0].message.content or ""


def test_site_converges_under_supervisord(first_converge, pod):
    said = first_converge.said
    assert first_converge.returncode == 0, str(first_converge)
    assert "service manager: supervisord" in said, "preflight names the service manager"
    assert "Firewall skipped: supervisord runs this host" in said, "the firewall is left to the provider"
    assert f"`bash {START}`" in said, "the play prints the provider's start command"
    status = pod.host.ssh(f"{CTL} status", check=False)
    assert status.returncode == 0, f"not all three programs run:\n{status.stdout}{status.stderr}"
    assert pod.host.ssh("test -d /run/systemd/system", check=False).returncode != 0, "this host has no systemd"
    assert pod.host.ssh("readlink /etc/kimi-service").stdout.strip() == f"{ROOT}/etc"
    conf = pod.host.ssh("cat /etc/kimi-service/supervisord.conf /etc/kimi-service/supervisord.d/*.conf").stdout
    assert API_KEY not in conf, "the key is in a world-readable supervisord file"
    assert pod.host.ssh("stat -c %a /etc/kimi-service/supervisord.conf").stdout.strip() == "644"


def test_second_run_changes_nothing(first_converge, pod):
    started = time.monotonic()
    second = ansible_playbook("site.yml", pod.inventory)
    print(f"\nno-op rerun of site.yml under supervisord: {time.monotonic() - started:.0f} s")
    assert second.returncode == 0, str(second)
    assert second.changed == 0, f"not idempotent under supervisord: {second.changed_tasks()}\n{second}"


def test_openai_client_streams_with_the_key_and_is_refused_without(first_converge, pod):
    assert stream_chat(pod.api), "the streamed completion carried no text"
    assert httpx.get(f"{pod.api}/v1/models", timeout=10).status_code == 401, "a request without the key was served"


def test_exporter_answers_with_the_plan(first_converge, pod):
    metrics = httpx.get(f"http://{pod.host.address}:9400/metrics", timeout=10).text
    assert "kimi_plan_info{" in metrics, "the exporter under supervisord does not serve the plan"


def test_killed_engine_is_restarted_by_supervisord(first_converge, pod):
    serve = _serve_pid(pod.host)
    pod.host.ssh(f"kill -9 {_engine_pid(pod.host)}")
    _wait_serving(pod, serve)
    assert "vLLM killed by signal SIGKILL" in pod.host.ssh(f"cat {LOG}").stdout, "serve did not log why it exited"


def test_hung_engine_is_restarted_by_serves_own_watchdog(first_converge, pod):
    serve = _serve_pid(pod.host)
    engine = _engine_pid(pod.host)
    pod.host.ssh(f"kill -STOP {engine}")
    _wait_serving(pod, serve, timeout=WATCHDOG_SEC + 300)
    assert "serve.watchdog_sec is" in pod.host.ssh(f"cat {LOG}").stdout, "serve's own watchdog did not fire"
    assert pod.host.ssh(f"test -d /proc/{engine}", check=False).returncode != 0, "the hung engine still exists"


def test_killed_serve_leaves_no_orphan_engine(first_converge, pod):
    serve = _serve_pid(pod.host)
    engine = _engine_pid(pod.host)
    # serve starts vLLM in a process group of its own and records it for the next start.
    group = pod.host.ssh(f"pgrep -g {engine}").stdout.split()
    assert str(engine) in group and len(group) >= 2, f"the API server and its engine core at least: {group}"
    assert json.loads(pod.host.ssh(f"cat {ROOT}/state/run/engine.pgid").stdout)["pgid"] == engine
    pod.host.ssh(f"kill -9 {serve}")
    deadline = time.monotonic() + 30
    while pod.host.ssh(f"pgrep -g {engine}", check=False).returncode == 0:
        assert time.monotonic() < deadline, f"vLLM's group ({engine}) outlived its killed serve ({serve})"
        time.sleep(1)
    _wait_serving(pod, serve)
    engines = pod.host.ssh("pgrep -f vllm.entrypoints", check=False).stdout.split()
    assert engines == [str(_engine_pid(pod.host))], f"more than one engine runs: {engines}"


def test_restarted_container_serves_again_from_its_start_script(first_converge, pod, make_containers, persist_dir):
    model_before = pod.host.ssh(f"stat -c %Y {MODEL}").stdout.strip()
    venv_before = pod.host.ssh(f"readlink {ROOT}/install/venv").stdout.strip()
    started = time.monotonic()
    # As `START --background; <the image's own command>` at the provider; here in the background so sshd (the
    # image's command) answers while the fresh root installs the runtime's system packages again.
    pod.host = make_containers(persist_dir, start_command=f"({START} --background >/var/log/kimi-start.log 2>&1 &)")
    write_inventory(pod.inventory, [pod.host], extra_vars=_vars_of(pod.inventory))
    _wait_serving(pod, 0, timeout=600)
    print(f"\ncontainer restart to serving: {time.monotonic() - started:.0f} s")
    assert _chat(pod.api) is not None
    assert pod.host.ssh(f"stat -c %Y {MODEL}").stdout.strip() == model_before, "the weights were fetched again"
    assert pod.host.ssh(f"readlink {ROOT}/install/venv").stdout.strip() == venv_before
    run = ansible_playbook("site.yml", pod.inventory)
    assert run.returncode == 0, str(run)
    rebuilt = [t for t in run.changed_tasks() if t.startswith(("vllm_runtime : Install", "model_weights"))]
    assert rebuilt == [], f"the play installed or downloaded again after the restart: {rebuilt}"


def _vars_of(inventory: Path) -> dict:
    import json

    return json.loads(inventory.read_text())["all"]["vars"]


def test_a_failed_upgrade_rolls_back_and_serves_again(first_converge, pod):
    venv = pod.host.ssh(f"readlink {ROOT}/install/venv").stdout.strip()
    args = _vars_of(pod.inventory)["kimi_vllm_extra_args"]
    run = ansible_playbook("playbooks/upgrade.yml", pod.inventory,
                           extra_vars={"kimi_vllm_extra_args": [*args, "--no-such-vllm-flag"]})
    assert run.returncode != 0, "an upgrade to an engine that cannot start passed"
    assert f"it is back on {venv} and serving. No further host was touched." in run.said, str(run)
    assert re.search(r"root cause: vLLM failed to start: .*--no-such-vllm-flag", run.output), str(run)
    assert pod.host.ssh(f"readlink {ROOT}/install/venv").stdout.strip() == venv
    assert _chat(pod.api) is not None


def test_uninstall_removes_everything_but_the_weights(first_converge, pod):
    """Last in this module: it takes the service away."""
    run = ansible_playbook("playbooks/uninstall.yml", pod.inventory, "-e", "kimi_uninstall_weights=no")
    assert run.returncode == 0, str(run)
    left = pod.host.ssh("pgrep -af '[s]upervisord|[k]imi-service serve|[v]llm.entrypoints'", check=False).stdout
    assert left.strip() == "", f"processes of the service are left: {left}"
    for path in (f"{ROOT}/install", "/etc/kimi-service", START, f"{ROOT}/etc"):
        assert pod.host.ssh(f"test -e {path}", check=False).returncode != 0, f"{path} is still there"
    assert pod.host.ssh("ss -Hltn 'sport = :8000 or sport = :8001 or sport = :9400'").stdout.strip() == ""
    assert pod.host.ssh(f"test -f {MODEL}", check=False).returncode == 0, "the weights were removed"
    again = ansible_playbook("playbooks/uninstall.yml", pod.inventory)
    assert again.returncode == 0 and again.changed == 0, str(again)
