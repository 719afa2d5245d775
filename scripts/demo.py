"""`make demo`: the whole product on this machine, without a GPU.

Boots a local systemd test host (a Debian 12 systemd-nspawn guest on this machine's network, so its
ports are this machine's ports), serves a small generated model from a local hub-protocol server, and
runs site.yml against the host with the CPU engine installed from an offline wheelhouse. Then it
prints the endpoint and an `openai` snippet that works. `make demo-down` removes the host.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from tests.hosts.nspawn import HostError, TestHost, run_dir, write_inventory  # noqa: E402
from tests.support.hub_server import HubServer  # noqa: E402
from tests.support.tiny_model import ensure_tiny_model  # noqa: E402
from tests.support.wheelhouse import ensure_cpu_wheelhouse, wheelhouse_vars  # noqa: E402

HOST_NAME = "kimi-demo"
STATE_DIR = PROJECT_ROOT / ".demo"
DEMO_REPO = "kimi-demo/tiny-llama"
SERVED_NAME = "kimi-demo"


# No kimi_api_key is given: the play makes one beside the demo's inventory, as for any operator.
API_KEY_FILE = STATE_DIR / ".credentials" / "kimi-api-key"


def up(extra_args: list[str]) -> int:
    if os.geteuid() != 0:
        print("make demo needs root (it boots a systemd-nspawn host)", file=sys.stderr)
        return 1
    if (run_dir() / HOST_NAME / "host.json").exists():
        host = TestHost.load(HOST_NAME)
        print(f"demo: reusing the running host {HOST_NAME}")
    else:
        print(f"demo: booting {HOST_NAME} (the first run builds a Debian 12 root, about a minute)")
        host = TestHost.create(HOST_NAME)
        try:
            host.start()
        except HostError:
            host.stop()
            raise
    STATE_DIR.mkdir(exist_ok=True)
    print("demo: preparing the small model and the offline CPU-engine wheelhouse (cached after the first run)")
    model = ensure_tiny_model()
    wheelhouse = ensure_cpu_wheelhouse()
    with HubServer(root=model, repo=DEMO_REPO, host="127.0.0.1") as hub:
        inventory = write_inventory(STATE_DIR / "inventory.yml", [host], extra_vars={
            **wheelhouse_vars(wheelhouse),
            "kimi_model": DEMO_REPO,
            "kimi_hf_endpoint": hub.url,
            "kimi_served_model_name": SERVED_NAME,
            "kimi_vllm_extra_args": ["--enforce-eager"],
        })
        (STATE_DIR / "inventory.yml").chmod(0o600)
        ansible = Path(sys.executable).parent / "ansible-playbook"
        argv = [str(ansible), "-i", str(inventory), "site.yml", *extra_args]
        print("demo: $", " ".join(argv), flush=True)
        result = subprocess.run(argv, cwd=PROJECT_ROOT)
    if result.returncode != 0:
        print(f"demo: site.yml failed (exit {result.returncode}); the host stays up for inspection:\n"
              f"  {' '.join(host.ssh_argv())}\n  make demo-down   # to remove it", file=sys.stderr)
        return result.returncode
    print(
        "\ndemo: the endpoint is up on this machine.\n"
        "  endpoint:   http://127.0.0.1:8000/v1  (OpenAI-compatible)\n"
        f"  model:      {SERVED_NAME} (a small generated Llama: its answers are noise)\n"
        f"  API key:    in {API_KEY_FILE}\n"
        "  metrics:    http://127.0.0.1:9400/metrics (exporter), http://127.0.0.1:8000/metrics (vLLM)\n"
        f"  log in:     {' '.join(host.ssh_argv())}\n"
        "  try it:\n"
        f"    export KIMI_API_KEY=$(cat {API_KEY_FILE})\n"
        "    .venv/bin/python - <<'PY'\n"
        "import os\n"
        "from openai import OpenAI\n"
        "client = OpenAI(base_url='http://127.0.0.1:8000/v1', api_key=os.environ['KIMI_API_KEY'])\n"
        f"reply = client.chat.completions.create(model={json.dumps(SERVED_NAME)}, max_tokens=16,\n"
        "                                       messages=[{'role': 'user', 'content': 'Hello!'}])\n"
        "print(reply.choices[0].message.content)\n"
        "PY\n"
        "  make demo-down removes the host."
    )
    return 0


def down() -> int:
    if (run_dir() / HOST_NAME / "host.json").exists():
        TestHost.load(HOST_NAME).stop()
        print(f"demo: {HOST_NAME} stopped and removed")
    else:
        print("demo: no demo host is running")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo.py")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("ansible_args", nargs=argparse.REMAINDER, help="passed to ansible-playbook")
    args = parser.parse_args()
    try:
        return up(args.ansible_args) if args.action == "up" else down()
    except HostError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
