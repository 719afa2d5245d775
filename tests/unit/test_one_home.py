"""Each fact has one home; where a copy must remain (argument_specs choices, README text) it agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kimi_service import config, planner
from tests.support.unit_templates import start_timeout

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "roles"
GIB = 1024**3


def _ansible_files() -> list[Path]:
    playbooks = [*(ROOT / "playbooks").rglob("*.yml"), ROOT / "site.yml"]
    return sorted([*ROLES.rglob("*.yml"), *ROLES.rglob("*.j2"), *playbooks])


@pytest.mark.parametrize(
    ("rule", "home"),
    [
        # Cluster membership: kimi_common's kimi_cluster_member / kimi_cluster_hosts.
        (r"groups\[kimi_cluster_group\]", "roles/kimi_common/vars/main.yml"),
        # The served-name default: kimi_common's kimi_served_name.
        (r"kimi_served_model_name\s+or\b", "roles/kimi_common/vars/main.yml"),
        # The start window: vllm_service's _vllm_service_start_timeout.
        (r"1024\s*\*\*\s*3\)\)\s*\*\s*60", "roles/vllm_service/vars/main.yml"),
    ],
)
def test_a_rule_is_spelled_in_its_home_only(rule, home):
    spelled = [str(path.relative_to(ROOT)) for path in _ansible_files() if re.search(rule, path.read_text())]
    assert spelled == [home]


def test_the_start_window_in_the_readme_is_the_one_the_role_computes():
    readme = (ROLES / "vllm_service/README.md").read_text()
    words = re.search(r"(\d+) minutes plus one per (\d+) GiB of weights, at least (\d+) minutes", readme)
    assert words, "roles/vllm_service/README.md must state the start window"
    base, step, floor = (int(group) for group in words.groups())
    for size in (0, 7 * 1024**2, 49 * GIB, 50 * GIB, 600 * 10**9, 2048 * GIB):
        said = max(floor * 60, base * 60 + (size // (step * GIB)) * 60)
        assert start_timeout(size) == said, f"{size} bytes of weights"


def test_every_copy_of_the_workload_list_is_the_planners():
    home = list(planner.WORKLOADS)
    assert list(config.WORKLOADS) == home
    specs = yaml.safe_load((ROLES / "kimi_common/meta/argument_specs.yml").read_text())
    assert specs["argument_specs"]["main"]["options"]["kimi_workload"]["choices"] == home
    readme_row = next(line for line in (ROLES / "kimi_common/README.md").read_text().splitlines()
                      if line.startswith("| `kimi_workload`"))
    assert re.findall(r"`([a-z-]+)`", readme_row.split("|")[3]) == home
    defaults = (ROLES / "kimi_common/defaults/main.yml").read_text()
    assert f"Workload the planner tunes for: {', '.join(home[:-1])} or {home[-1]}." in defaults
    example = (ROOT / "inventory/example/group_vars/kimi_hosts.yml").read_text()
    assert re.search(r"kimi_workload: \w+ +# " + re.escape(" | ".join(home)), example)
    readme = (ROOT / "README.md").read_text()
    assert f"--workload {'|'.join(home)}" in readme
