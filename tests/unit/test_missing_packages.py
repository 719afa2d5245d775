"""kimi_common's `packages` entry point asks dpkg which wanted packages are missing before it runs apt. Its
shell (roles/kimi_common/vars/main.yml) runs here against this machine's real dpkg database."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

SCRIPT = yaml.safe_load((Path(__file__).resolve().parents[2] / "roles/kimi_common/vars/main.yml").read_text())[
    "_kimi_common_missing_packages_sh"]


def _installed_version(name: str) -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True,
                          check=True).stdout


def _missing(*specs: str) -> list[str]:
    run = subprocess.run(["sh", "-c", SCRIPT, "sh", *specs], capture_output=True, text=True, check=True)
    return run.stdout.splitlines()


def test_installed_packages_at_a_matching_version_are_not_missing():
    bash = _installed_version("bash")
    upstream = bash.split("-")[0]
    assert _missing("bash", f"bash={bash}", f"bash={upstream}-*", f"bash={upstream.split('.')[0]}.*", "coreutils") == []


def test_absent_packages_and_other_versions_are_missing_in_the_order_asked():
    bash = _installed_version("bash")
    wanted = ["kimi-no-such-package", "bash=0.0-*", f"bash={bash}", "kimi-no-such=1.0-*", f"bash={bash}9"]
    assert _missing(*wanted) == ["kimi-no-such-package", "bash=0.0-*", "kimi-no-such=1.0-*", f"bash={bash}9"]

