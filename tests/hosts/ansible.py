"""Run ansible-playbook from the project's venv against test hosts and read the PLAY RECAP."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_RECAP_LINE = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
    r"\s+failed=(?P<failed>\d+)\s+skipped=(?P<skipped>\d+)\s+rescued=(?P<rescued>\d+)\s+ignored=(?P<ignored>\d+)",
    re.MULTILINE,
)


@dataclass
class PlaybookRun:
    argv: list[str]
    returncode: int
    output: str
    recap: dict[str, dict[str, int]]

    @property
    def changed(self) -> int:
        return sum(host["changed"] for host in self.recap.values())

    @property
    def failed(self) -> int:
        return sum(host["failed"] + host["unreachable"] for host in self.recap.values())

    @property
    def said(self) -> str:
        """The output as one line: a message matches however the callback wrapped it."""
        return " ".join(self.output.split())

    def changed_tasks(self) -> list[str]:
        """Names of the tasks that reported a change (for readable idempotence failures)."""
        return [task for task, status in self.task_statuses() if status == "changed"]

    def task_statuses(self) -> list[tuple[str, str]]:
        """(task name, status) for each host's result line, in order: ok, changed, skipping, failed, fatal."""
        results, current = [], None
        for line in self.output.splitlines():
            if line.startswith("TASK ["):
                current = line[6:].split("]")[0]
            elif current and (status := line.split(":", 1)[0]) in ("ok", "changed", "skipping", "failed", "fatal"):
                results.append((current, status))
        return results

    def __str__(self) -> str:
        return f"$ {' '.join(self.argv)}\n(exit {self.returncode})\n{self.output[-20000:]}"


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    recap_at = output.rfind("PLAY RECAP")
    if recap_at < 0:
        return {}
    return {
        m["host"]: {k: int(v) for k, v in m.groupdict().items() if k != "host"}
        for m in _RECAP_LINE.finditer(output[recap_at:])
    }


def ansible_playbook(
    playbook: str | Path,
    inventory: Path,
    *args: str,
    extra_vars: dict | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 1800,
) -> PlaybookRun:
    """Run a playbook of the project (path relative to the project root) and capture everything."""
    bindir = Path(sys.executable).parent
    argv = [str(bindir / "ansible-playbook"), "-i", str(inventory), str(playbook), *args]
    if extra_vars:
        import json

        argv += ["--extra-vars", json.dumps(extra_vars)]
    full_env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(PROJECT_ROOT / "ansible.cfg"),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        "PATH": f"{bindir}:{os.environ.get('PATH', '')}",
        **(env or {}),
    }
    result = subprocess.run(
        argv, cwd=PROJECT_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    output = result.stdout + result.stderr
    return PlaybookRun(argv=argv, returncode=result.returncode, output=output, recap=parse_recap(result.stdout))
