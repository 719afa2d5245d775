"""Fixtures shared by the unit layer."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A fresh directory with a short path, for configs whose state_dir holds vLLM's IPC sockets (70
    characters at most): under pytest-xdist, tmp_path gains a worker folder and can be too long."""
    with tempfile.TemporaryDirectory(prefix="kt-", ignore_cleanup_errors=True) as path:
        yield Path(path)
