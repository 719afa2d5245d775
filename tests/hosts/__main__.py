"""Start, list and stop test hosts by hand: python -m tests.hosts {up,down,list,ssh} [NAME]."""

from __future__ import annotations

import argparse
import sys

from tests.hosts.nspawn import HostError, TestHost, run_dir


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.hosts")
    parser.add_argument("action", choices=["up", "down", "list", "ssh"])
    parser.add_argument("name", nargs="?", default="kimi-demo")
    args = parser.parse_args()
    try:
        if args.action == "up":
            host = TestHost.create(args.name)
            try:
                host.start()
            except HostError:
                host.stop()
                raise
            print(f"{host.name}: ssh {' '.join(host.ssh_argv())}")
        elif args.action == "down":
            if (run_dir() / args.name / "host.json").exists():
                TestHost.load(args.name).stop()
                print(f"{args.name}: stopped")
        elif args.action == "list":
            for state in sorted(run_dir().glob("*/host.json")):
                print(state.parent.name)
        else:
            print(" ".join(TestHost.load(args.name).ssh_argv()))
    except HostError as exc:
        print(f"testhost: {exc}", file=sys.stderr)
        return 1
    return 0


raise SystemExit(main())
