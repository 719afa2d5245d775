#!/usr/bin/env python3
"""Where a `make test` run spends its time: per module and test (pytest's JUnit XML), per Ansible task
(ANSIBLE_LOG_PATH), and how busy the machine's CPUs were (/proc/stat samples).

Record a run, then read it:

    python3 scripts/suite_profile.py sample /tmp/stat.log &      # /proc/stat every 10 s until killed
    ANSIBLE_LOG_PATH=/tmp/ansible.log PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml make test
    python3 scripts/suite_profile.py report --junit /tmp/junit.xml --ansible-log /tmp/ansible.log \
        --stat /tmp/stat.log

On the 2-core machine the suite keeps both CPUs about 90% busy, so only less CPU work makes it faster:
a shorter wait in one test lets the other worker run sooner, but the sum barely moves.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) p=(\d+) .*?\| (.*)$")
_STEP = ("TASK [", "RUNNING HANDLER [", "PLAY [", "PLAY RECAP")
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def junit_times(path: Path) -> tuple[collections.Counter, list[tuple[float, str]]]:
    """Seconds per test module, and (seconds, test id) per test."""
    modules: collections.Counter = collections.Counter()
    tests = []
    for case in ET.parse(path).iter("testcase"):
        seconds = float(case.get("time", 0))
        module = case.get("classname", "").rsplit(".", 1)[-1]
        modules[module] += seconds
        tests.append((seconds, f"{module}::{case.get('name')}"))
    return modules, sorted(tests, reverse=True)


def ansible_task_times(path: Path) -> tuple[collections.Counter, collections.Counter, int]:
    """Seconds and count per task name (each step ends where the same ansible-playbook's next begins),
    and how many ansible-playbook runs the log holds."""
    seconds: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    open_step: dict[str, tuple[float, str]] = {}
    runs = set()
    for line in path.read_text(errors="replace").splitlines():
        match = _LOG_LINE.match(line)
        if not match:
            continue
        stamp, pid, text = match.groups()
        runs.add(pid)
        if not text.startswith(_STEP):
            continue
        now = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if pid in open_step:
            began, name = open_step.pop(pid)
            seconds[name] += now - began
            count[name] += 1
        if not text.startswith("PLAY RECAP"):
            open_step[pid] = (now, text.split(" ***", 1)[0].rstrip("* "))
    return seconds, count, len(runs)


def cpu_shares(path: Path) -> dict[str, float]:
    """Percent of CPU time per /proc/stat field between the first and the last sample."""
    samples = [line.split()[2:2 + len(_CPU_FIELDS)] for line in path.read_text().splitlines()
               if len(line.split()) >= 2 + len(_CPU_FIELDS)]
    if len(samples) < 2:
        raise SystemExit(f"{path}: fewer than two /proc/stat samples")
    delta = [int(b) - int(a) for a, b in zip(samples[0], samples[-1], strict=True)]
    total = sum(delta) or 1
    shares = {name: 100 * value / total for name, value in zip(_CPU_FIELDS, delta, strict=True)}
    shares["busy"] = 100 - shares["idle"] - shares["iowait"]
    return shares


def report(args: argparse.Namespace) -> None:
    if args.junit:
        modules, tests = junit_times(args.junit)
        print(f"test time: {sum(modules.values()):.0f} s in {len(tests)} tests\n\n| module | s |\n| --- | ---: |")
        for module, seconds in modules.most_common(args.top):
            print(f"| {module} | {seconds:.0f} |")
        print("\n| test | s |\n| --- | ---: |")
        for seconds, test in tests[:args.top]:
            print(f"| {test} | {seconds:.1f} |")
    if args.ansible_log:
        seconds, count, runs = ansible_task_times(args.ansible_log)
        print(f"\nansible: {runs} runs, {sum(count.values())} steps, {sum(seconds.values()):.0f} s"
              "\n\n| step | s | times |\n| --- | ---: | ---: |")
        for name, total in seconds.most_common(args.top):
            print(f"| {name} | {total:.1f} | {count[name]} |")
    if args.stat:
        shares = cpu_shares(args.stat)
        print("\nCPU: " + ", ".join(f"{name} {value:.0f}%" for name, value in shares.items() if value >= 0.5))


def program_of(pid: str) -> str:
    """A short name for what a process runs: vLLM's parts, Ansible's controller and modules, pytest, ..."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    if comm.startswith("VLLM::"):
        return comm
    text = b" ".join(argv[:4]).decode(errors="replace")
    # Before vLLM names its processes (VLLM::EngineCore, VLLM::Worker) they are multiprocessing children.
    for needle, name in (("vllm.entrypoints", "vllm api_server"), ("multiprocessing", "vllm engine (spawned)"),
                         ("kimi-service serve", "kimi-service serve"), ("kimi_service", "kimi-service other"),
                         ("ansible-playbook", "ansible-playbook"), ("AnsiballZ", "ansible module"),
                         ("pytest", "pytest"), ("-m pip", "pip"), ("bin/pip", "pip"),
                         ("exec(eval(sys.stdin", "pytest"), ("compileall", "pip")):
        if needle in text:
            return name
    return comm


def sample(out: Path, every: float) -> None:
    """/proc/stat every `every` seconds into OUT; every second, each process's CPU time by program, whose
    running totals (seconds) go to OUT.programs.json."""
    ticks = os.sysconf("SC_CLK_TCK")
    seen: dict[str, tuple[str, int]] = {}
    totals: collections.Counter[str] = collections.Counter()
    next_stat = 0.0
    with out.open("a") as log:
        while True:
            now = time.time()
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit():
                    continue
                try:
                    fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                used = int(fields[11]) + int(fields[12])
                # Named again each pass: vLLM renames its processes after they start.
                before = seen[entry.name][1] if entry.name in seen else used
                name = program_of(entry.name)
                totals[name] += (used - before) / ticks
                seen[entry.name] = (name, used)
            if now >= next_stat:
                with open("/proc/stat") as stat:
                    log.write(f"{int(now)} {stat.readline()}")
                log.flush()
                out.with_suffix(".programs.json").write_text(
                    json.dumps({k: round(v, 1) for k, v in totals.most_common() if v >= 0.5}, indent=1))
                next_stat = now + every
            time.sleep(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("sample", help="append a /proc/stat sample to OUT every --every seconds")
    rec.add_argument("out", type=Path)
    rec.add_argument("--every", type=float, default=10.0)
    rep = sub.add_parser("report", help="tables of where the run's time went")
    rep.add_argument("--junit", type=Path)
    rep.add_argument("--ansible-log", type=Path)
    rep.add_argument("--stat", type=Path)
    rep.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if args.command == "sample":
        sample(args.out, args.every)
    else:
        report(args)


if __name__ == "__main__":
    sys.exit(main())
