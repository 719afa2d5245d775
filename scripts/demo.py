"""`make demo`: boot a local systemd test host, run site.yml against it, say where the endpoint is.

`make demo-down` stops the host. The host is a Debian 12 systemd-nspawn guest on this machine's
network (tests/hosts/nspawn.py), so its ports are this machine's ports.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT_ROOT))

from tests.hosts.nspawn import HostError, TestHost, run_dir, write_inventory  # noqa: E402

HOST_NAME = "kimi-demo"
STATE_DIR = PROJECT_ROOT / ".demo"


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
    inventory = write_inventory(STATE_DIR / "inventory.yml", [host])
    ansible = Path(sys.executable).parent / "ansible-playbook"
    argv = [str(ansible), "-i", str(inventory), "site.yml", *extra_args]
    print("demo: $", " ".join(argv), flush=True)
    result = subprocess.run(argv, cwd=PROJECT_ROOT)
    if result.returncode != 0:
        print(f"demo: site.yml failed (exit {result.returncode}); the host stays up for inspection:\n"
              f"  {' '.join(host.ssh_argv())}\n  make demo-down   # to remove it", file=sys.stderr)
        return result.returncode
    print(
        "\ndemo: site.yml converged on the local test host.\n"
        f"  log in:      {' '.join(host.ssh_argv())}\n"
        f"  inventory:   {inventory}\n"
        "  This release provisions the preflight and runtime stages (service account, directories);\n"
        "  the GPU, weights, service and verify stages have no roles yet, so no endpoint is served.\n"
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
