"""What the weights tests share: a small model tree served by the hub test server, and helpers.

A test module takes the fixtures by name: `model_dir, hub = weights_fixtures.model_dir, weights_fixtures.hub`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_service import weights
from tests.support.hub_server import HubServer, write_test_model

REPO = "kimi-test/tiny"
BIG = "model.safetensors"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return write_test_model(tmp_path / "repo")


@pytest.fixture
def hub(model_dir):
    with HubServer(root=model_dir, repo=REPO) as server:
        yield server


def hf_request(server: HubServer, dest: Path, **kw) -> weights.FetchRequest:
    kw.setdefault("verify", "full")
    return weights.FetchRequest(source="hf", repo=REPO, revision="main", dest=dest, endpoint=server.url, **kw)


def same_tree(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files, "empty source tree"
    for rel in files:
        assert (b / rel).read_bytes() == (a / rel).read_bytes(), rel
