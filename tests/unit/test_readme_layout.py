"""README's Layout is where a newcomer starts: it names every top-level folder and the package's subpackages."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What tools and runs leave behind, not part of the project.
NOT_OURS = re.compile(r"^(\.git|\.venv|\.hypothesis|\.pytest_cache|\.ruff_cache|\.ansible|__pycache__|build|dist|"
                      r"\.device|\.demo|\.whl|bench-results)$|"
                      r"\.egg-info$")


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def named() -> set[str]:
    return {line.split()[0] for line in layout_block().splitlines() if line.strip()}


def test_every_top_level_folder_is_in_the_layout():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not NOT_OURS.search(p.name)}
    # A folder named only through its own subfolders (tests/unit/, tests/hosts/ ...) counts as named.
    missing = sorted(f"{name}/" for name in folders if not any(entry.startswith(f"{name}/") for entry in named()))
    assert not missing, f"README.md's Layout does not name: {', '.join(missing)}"


def test_every_subpackage_of_kimi_service_is_in_the_layout():
    packages = {p.parent.name for p in (ROOT / "kimi_service").glob("*/__init__.py")}
    missing = sorted(f"{name}/" for name in packages if f"{name}/" not in named())
    assert not missing, f"README.md's Layout does not name the kimi_service subpackages: {', '.join(missing)}"
