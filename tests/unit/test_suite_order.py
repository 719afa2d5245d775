"""The suite's longest-first order names modules that exist, and puts them before the rest."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import MODULE_SECONDS, ROOT, module_cost


def test_every_costed_module_exists() -> None:
    missing = [name for name in MODULE_SECONDS if not (ROOT / name).is_file()]
    assert missing == [], f"tests/conftest.py costs modules that are gone: {missing}"


def test_a_costed_module_sorts_before_an_uncosted_one() -> None:
    longest = max(MODULE_SECONDS, key=MODULE_SECONDS.__getitem__)
    assert module_cost(ROOT / longest) > module_cost(Path(__file__)) == 0
