"""`kimi-service plan --model ORG/NAME` for a model outside the catalog: the hub's listing and small files,
never its weights; cached by commit for --offline; every hub failure exit 2 with one line, the token never shown."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kimi_service import hub
from kimi_service.cli import main
from kimi_service.config import parse_config
from kimi_service.model import Origin, inspect_model
from tests.support.hub_server import COMMIT, HubServer

REPO = "example-org/Qwen3-8B-like"
# A Qwen3-8B-shaped config (huggingface.co/Qwen/Qwen3-8B config.json): no catalog entry has this shape.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}
SHARDS = {"model-00001-of-00002.safetensors": 9_000_000_000, "model-00002-of-00002.safetensors": 7_400_000_000}
TOKEN = "hf_secretTOKENvalue123"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def _write_model(root: Path, config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or CONFIG))
    # total_size is what the tensors hold; the listed files are larger by their headers: the plan uses the latter.
    weight_map = {f"layer.{i}": name for i, name in enumerate(SHARDS)}
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(SHARDS.values()) - 1000}, "weight_map": weight_map}))
    (root / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 131072}))
    return root


def _listing(server: HubServer, extra: dict[str, int] | None = None) -> bytes:
    """The hub's listing of the small files on disk plus weight shards that exist only as listed sizes."""
    siblings = [server.sibling(path) for path in server.files()]
    for name, size in {**SHARDS, **(extra or {})}.items():
        siblings.append({"rfilename": name, "size": size, "blobId": "1" * 40,
                         "lfs": {"sha256": "2" * 64, "size": size, "pointerSize": 134}})
    return json.dumps({"id": server.repo, "sha": server.commit, "siblings": siblings}).encode()


@pytest.fixture
def served(tmp_path):
    server = HubServer(root=_write_model(tmp_path / "repo"), repo=REPO)
    server.listings["hf"] = _listing(server)
    with server:
        yield server


def _plan(capsys, *args: str, gpus: str = "H100:1") -> tuple[int, str, str]:
    code = main(["plan", "--model", REPO, "--gpus", gpus, "--json", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_repo_outside_the_catalog_plans_from_its_small_files(served, tmp_path, capsys):
    code, out, _ = _plan(capsys, "--endpoint", served.url, "--cache-dir", str(tmp_path / "cache"))
    assert code == 0
    plan = json.loads(out)
    assert plan["hub"]["commit"] == COMMIT and plan["hub"]["weight_bytes"] == sum(SHARDS.values())
    assert plan["argv"][plan["argv"].index("--served-model-name") + 1] == REPO
    assert not [r for r in served.log if r.path.endswith(".safetensors")], "a weight file was requested"
    assert {r.path.rsplit("/", 1)[1] for r in served.log} == {"config.json", "model.safetensors.index.json",
                                                             "generation_config.json", "tokenizer_config.json"}
    cached = tmp_path / "cache" / "hf" / REPO / COMMIT
    assert (cached / "config.json").is_file()


def test_the_listed_sizes_are_the_checkpoint_size(served, tmp_path):
    found = hub.inspect(REPO, "main", hub.Source("hf", served.url), tmp_path, deadline=30)
    spec = inspect_model(str(found.directory), Origin(found.repo, found.commit, found.weight_bytes))
    assert spec.weight_bytes == sum(SHARDS.values()) and spec.weight_bytes_source.startswith("hub listing")
    assert (spec.name, spec.served_name, spec.catalog_name, spec.matched_by_shape) == (REPO, REPO, None, False)


def test_a_cached_commit_plans_offline_and_says_which(served, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert _plan(capsys, "--endpoint", served.url, "--cache-dir", cache)[0] == 0
    served.stop()
    code = main(["plan", "--model", REPO, "--gpus", "H100:1", "--cache-dir", cache, "--offline"])
    out, err = capsys.readouterr()
    assert code == 0 and f"main is commit {COMMIT}" in err and f"commit {COMMIT}" in out
    code, _, err = _plan(capsys, "--cache-dir", cache, "--offline", "--revision", "v2")
    assert code == 2 and "no cached listing of" in err and "v2" in err
    served.start()  # the fixture stops it again


def test_a_mirror_through_hf_endpoint(served, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", served.url + "/")
    code, out, _ = _plan(capsys, "--cache-dir", str(tmp_path / "cache"))
    assert code == 0 and json.loads(out)["hub"]["endpoint"] == served.url


def test_fetch_reads_hf_endpoint_too(tmp_path, capsys, monkeypatch):
    root = _write_model(tmp_path / "repo")
    with HubServer(root=root, repo=REPO) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "dest")]) == 0
    assert json.loads(capsys.readouterr().out)["commit"] == COMMIT


def test_an_unknown_repo_names_the_repo_and_the_endpoint(served, tmp_path, capsys):
    code = main(["plan", "--model", "example-org/missing", "--gpus", "H100:1", "--endpoint", served.url,
                 "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "example-org/missing" in err and served.url in err and "404" in err


def test_a_gated_repo_asks_for_a_token_and_never_shows_one(tmp_path, capsys, monkeypatch):
    server = HubServer(root=_write_model(tmp_path / "repo"), repo=REPO, token=TOKEN)
    server.listings["hf"] = _listing(server)
    with server:
        code, out, err = _plan(capsys, "--endpoint", server.url, "--cache-dir", str(tmp_path / "c1"))
        assert code == 2 and "401" in err and "HF_TOKEN" in err and "--token-file" in err and "kimi_hf_token" in err
        monkeypatch.setenv("HF_TOKEN", TOKEN + "x")
        code, out2, err2 = _plan(capsys, "--endpoint", server.url, "--cache-dir", str(tmp_path / "c2"))
        assert code == 2 and "401" in err2
        monkeypatch.delenv("HF_TOKEN")
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        code, out3, err3 = _plan(capsys, "--endpoint", server.url, "--cache-dir", str(tmp_path / "c3"),
                                 "--token-file", str(token_file))
        assert code == 0, err3
    for text in (out, err, out2, err2, out3, err3):
        assert TOKEN not in text


def test_a_small_file_behind_a_gate_asks_for_a_token(served, tmp_path, capsys):
    """A gated repo's listing is public on the hub; its files answer 401 without a token."""
    served.token, served.gated = TOKEN, True
    code, _, err = _plan(capsys, "--endpoint", served.url, "--cache-dir", str(tmp_path))
    assert code == 2 and "401" in err and "config.json needs a token" in err and "HF_TOKEN" in err


def test_an_unreachable_endpoint_names_the_url(tmp_path, capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    code, _, err = _plan(capsys, "--endpoint", url, "--cache-dir", str(tmp_path))
    assert code == 2 and f"{url}/api/models/{REPO}" in err and "cannot reach" in err


def test_a_silent_endpoint_gives_up_at_the_deadline(tmp_path, capsys):
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        code, _, err = _plan(capsys, "--endpoint", f"http://127.0.0.1:{silent.getsockname()[1]}",
                             "--cache-dir", str(tmp_path), "--timeout", "0.5")
    assert code == 2 and "no complete answer within 0.5 s" in err
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("body, named", [
    (b"<html>busy</html>", "did not answer JSON"),
    (json.dumps({"sha": COMMIT, "siblings": [{"rfilename": "config.json"}]}).encode(), "without a size"),
])
def test_a_malformed_listing_is_named(served, tmp_path, capsys, body, named):
    served.listings["hf"] = body
    code, _, err = _plan(capsys, "--endpoint", served.url, "--cache-dir", str(tmp_path))
    assert code == 2 and named in err and "Traceback" not in err


def test_a_malformed_config_names_the_file(tmp_path, capsys):
    root = _write_model(tmp_path / "repo")
    (root / "config.json").write_text("{not json")
    server = HubServer(root=root, repo=REPO)
    server.listings["hf"] = _listing(server)
    with server:
        code, _, err = _plan(capsys, "--endpoint", server.url, "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and "config.json" in err and "Traceback" not in err


def test_a_large_small_file_is_refused_before_it_is_downloaded(served, tmp_path, capsys):
    (served.root / "tokenizer_config.json").unlink()
    served.listings["hf"] = _listing(served, extra={"tokenizer_config.json": hub.MAX_SMALL_FILE_BYTES + 1})
    code, _, err = _plan(capsys, "--endpoint", served.url, "--cache-dir", str(tmp_path))
    assert code == 2 and "tokenizer_config.json" in err and "refusing to download it" in err
    assert not [r for r in served.log if "tokenizer_config" in r.path]


def test_a_redirect_to_another_host_does_not_carry_the_token(tmp_path, capsys, monkeypatch):
    seen: list[str | None] = []

    class Elsewhere(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{other.server_address[1]}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    other, front = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere), ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    for server in (other, front):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        code, out, err = _plan(capsys, "--endpoint", f"http://127.0.0.1:{front.server_address[1]}",
                               "--cache-dir", str(tmp_path))
    finally:
        for server in (other, front):
            server.shutdown()
            server.server_close()
    assert code == 2 and seen == [None] and TOKEN not in out + err


def test_the_repo_not_the_shape_finds_the_catalog_entry():
    kimi = FIXTURES / "moonshotai--Kimi-K2.5"
    assert inspect_model(str(kimi)).matched_by_shape
    fork = inspect_model(str(kimi), Origin("example-org/Kimi-K2.5-fork"))
    assert (fork.catalog_name, fork.matched_by_shape, fork.served_name) == (None, False, "example-org/Kimi-K2.5-fork")
    same = inspect_model(str(kimi), Origin("moonshotai/Kimi-K2.5", COMMIT))
    assert (same.catalog_name, same.matched_by_shape) == ("moonshotai/Kimi-K2.5", False)
    assert same.name == same.served_name == "moonshotai/Kimi-K2.5"


def test_config_carries_the_repo_and_commit(tmp_path):
    config = parse_config({"model": {"path": str(tmp_path), "repo": REPO, "commit": COMMIT}})
    assert config.model.origin == Origin(REPO, COMMIT)
    with pytest.raises(Exception, match="not a hub repo id"):
        parse_config({"model": {"path": str(tmp_path), "repo": "../etc"}})
    assert parse_config({"model": {"path": str(tmp_path)}}).model.origin is None


def test_fetch_refuses_a_commit_other_than_the_planned_one(tmp_path, capsys):
    dest, planned = tmp_path / "dest", "f" * 40
    with HubServer(root=_write_model(tmp_path / "repo"), repo=REPO) as server:
        common = ["--repo", REPO, "--dest", str(dest), "--endpoint", server.url]
        assert main(["fetch", *common, "--expect-commit", planned]) == 2
        err = capsys.readouterr().err
        assert COMMIT in err and planned in err and not dest.exists()
        assert main(["fetch", *common, "--expect-commit", COMMIT]) == 0
        assert main(["fetch", "--check", *common, "--expect-commit", COMMIT]) == 0
        # Weights of an earlier commit on disk are not the planned ones.
        assert main(["fetch", "--check", *common, "--expect-commit", planned]) == 1
