"""Weights fetch against a real local HTTP server speaking the hubs' protocols (tests/support/hub_server)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from kimi_service import weights
from kimi_service.cli import main
from tests.support import weights_fixtures
from tests.support.hub_server import Fault, HubServer
from tests.support.weights_fixtures import BIG, REPO

model_dir, hub = weights_fixtures.model_dir, weights_fixtures.hub
_request, _same_tree = weights_fixtures.hf_request, weights_fixtures.same_tree


def test_fetch_downloads_every_file_and_writes_a_marker(hub, model_dir, tmp_path):
    dest = tmp_path / "models" / "tiny@main"
    result = weights.fetch(_request(hub, dest, progress_file=tmp_path / "progress.json"))
    _same_tree(model_dir, dest)
    assert result.files_total == 4 and result.files_fetched == 4 and not result.up_to_date
    assert result.bytes_downloaded == sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    marker = json.loads((dest / weights.MARKER_NAME).read_text())
    assert (marker["repo"], marker["revision"], marker["commit"]) == (REPO, "main", hub.commit)
    by_path = {e["path"]: e for e in marker["files"]}
    assert by_path[BIG]["sha256"] == hashlib.sha256((model_dir / BIG).read_bytes()).hexdigest()
    assert {e["verified"] for e in marker["files"]} == {"full"}
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["state"] == "done"
    assert progress["bytes_done"] == progress["bytes_total"] == result.bytes_total
    assert not list(dest.rglob("*" + weights.INCOMPLETE_SUFFIX))


def test_rerun_on_a_complete_dir_touches_no_network(hub, tmp_path):
    dest = tmp_path / "m"
    weights.fetch(_request(hub, dest))
    requests_before = len(hub.log)
    result = weights.fetch(_request(hub, dest))
    assert result.up_to_date and result.files_fetched == 0 and result.bytes_downloaded == 0
    assert len(hub.log) == requests_before


def test_an_interrupted_download_resumes_with_a_range_request(hub, model_dir, tmp_path):
    size = (model_dir / BIG).stat().st_size
    cut = 1_000_000
    hub.faults[BIG] = Fault(drop_after=cut)
    dest = tmp_path / "m"
    with pytest.raises(weights.FetchError, match="giving up after 1 attempts"):
        weights.fetch(_request(hub, dest, retries=0))
    partial = dest / (BIG + weights.INCOMPLETE_SUFFIX)
    assert partial.stat().st_size == cut
    assert not (dest / weights.MARKER_NAME).exists()

    result = weights.fetch(_request(hub, dest, retries=0))
    second = hub.gets(BIG)[-1]
    assert second.range == f"bytes={cut}-" and second.status == 206
    assert second.sent == size - cut < size
    assert hub.sent_bytes(BIG) == size  # nothing was transferred twice
    assert result.bytes_downloaded < result.bytes_total
    _same_tree(model_dir, dest)


def test_a_dropped_connection_is_retried_within_the_run(hub, model_dir, tmp_path):
    hub.faults[BIG] = Fault(drop_after=500_000, times=2)
    sleeps: list[float] = []
    weights.fetch(_request(hub, dest := tmp_path / "m", retries=3), sleep=sleeps.append)
    assert [r.range for r in hub.gets(BIG)] == [None, "bytes=500000-", "bytes=1000000-"]
    assert sleeps == [1.0, 2.0]
    _same_tree(model_dir, dest)


def test_a_corrupted_download_is_caught_and_fetched_again(hub, model_dir, tmp_path):
    hub.faults[BIG] = Fault(corrupt=True)
    weights.fetch(_request(hub, dest := tmp_path / "m"), sleep=lambda _: None)
    assert len(hub.gets(BIG)) == 2
    _same_tree(model_dir, dest)


def test_corruption_in_a_small_git_file_is_caught_by_its_blob_id(hub, model_dir, tmp_path):
    hub.faults["config.json"] = Fault(corrupt=True)
    weights.fetch(_request(hub, dest := tmp_path / "m"), sleep=lambda _: None)
    assert len(hub.gets("config.json")) == 2
    _same_tree(model_dir, dest)


def test_a_published_hash_is_checked_for_downloads_even_when_verifying_sizes_only(hub, model_dir, tmp_path):
    """verify=size spares hashing files a marker recorded; what a run downloads is checked against the
    hash the listing publishes (LFS sha256, git blob id) whatever the mode."""
    hub.faults[BIG] = Fault(corrupt=True)
    weights.fetch(_request(hub, dest := tmp_path / "m", verify="size"), sleep=lambda _: None)
    assert len(hub.gets(BIG)) == 2
    _same_tree(model_dir, dest)
    marker = json.loads((dest / weights.MARKER_NAME).read_text())
    assert {e["verified"] for e in marker["files"]} == {"full"}


def test_size_only_verification_trusts_a_source_without_hashes(model_dir, tmp_path):
    """Documents the trade-off of verify=size where nothing is published: sizes only, no hashing."""
    request = weights.FetchRequest(source="local", repo=REPO, revision="main", dest=tmp_path / "m",
                                   local_path=model_dir, verify="size")
    weights.fetch(request)
    marker = json.loads((tmp_path / "m" / weights.MARKER_NAME).read_text())
    assert {e["verified"] for e in marker["files"]} == {"size"}


def test_a_file_changed_on_disk_is_fetched_again_alone(hub, model_dir, tmp_path):
    dest = tmp_path / "m"
    weights.fetch(_request(hub, dest))
    with (dest / BIG).open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"\0" * 16)
    (dest / "sub" / "extra.bin").unlink()
    hub.log.clear()
    result = weights.fetch(_request(hub, dest))
    fetched = sorted(r.path.rsplit("/", 1)[-1] for r in hub.log if "/resolve/" in r.path)
    assert fetched == ["extra.bin", BIG]
    assert result.files_fetched == 2
    _same_tree(model_dir, dest)


def test_not_enough_space_refuses_before_writing_anything(hub, tmp_path):
    dest = tmp_path / "models" / "m"
    free = weights._free_bytes(tmp_path)
    with pytest.raises(weights.NotEnoughSpace, match="nothing was downloaded") as err:
        weights.fetch(_request(hub, dest, headroom=free))  # needs size * (1 + free) bytes: never fits
    assert "kimi_model_dir" in str(err.value)
    assert not (tmp_path / "models").exists()
    assert hub.gets(BIG) == [] and all("/resolve/" not in r.path for r in hub.log)


def test_check_space_counts_headroom():
    gib = 1 << 30
    weights.check_space(Path("/x"), 10 * gib, 10.5 * gib, 0.05)
    expected = r"needs 10.5 GiB free \(10.0 GiB still to download \+ 5% headroom\) but .* has 10.4 GiB"
    with pytest.raises(weights.NotEnoughSpace, match=expected):
        weights.check_space(Path("/x"), 10 * gib, 10.4 * gib, 0.05)


@pytest.mark.parametrize("path", ["../etc/passwd", "/etc/passwd", "a/../../b", "", ".kimi-weights.json",
                                  "x.safetensors.incomplete"])
def test_unsafe_paths_from_a_source_are_refused(path):
    with pytest.raises(weights.FetchError):
        weights.safe_relpath(path)


def test_modelscope_source(hub, model_dir, tmp_path):
    request = weights.FetchRequest(source="modelscope", repo=REPO, revision="master", dest=tmp_path / "m",
                                   endpoint=hub.url, verify="full")
    assert weights.fetch(request).files_fetched == 4
    _same_tree(model_dir, tmp_path / "m")
    assert any("/api/v1/models/" in r.path and "FilePath=model.safetensors" in r.path for r in hub.log)


def test_http_mirror_source_with_manifest(hub, model_dir, tmp_path):
    request = weights.FetchRequest(source="http", repo=REPO, revision="main", dest=tmp_path / "m",
                                   endpoint=f"{hub.url}/mirror", verify="full")
    weights.fetch(request)
    _same_tree(model_dir, tmp_path / "m")


def test_local_source_copies_and_a_tree_already_in_place_is_adopted(model_dir, tmp_path):
    dest = tmp_path / "m"
    request = weights.FetchRequest(source="local", repo=REPO, revision="main", dest=dest,
                                   local_path=model_dir)
    assert weights.fetch(request).files_fetched == 4
    _same_tree(model_dir, dest)
    in_place = weights.FetchRequest(source="local", repo=REPO, revision="v2", dest=dest, local_path=dest)
    adopted = weights.fetch(in_place)
    assert adopted.files_fetched == 0 and adopted.bytes_downloaded == 0
    assert json.loads((dest / weights.MARKER_NAME).read_text())["revision"] == "v2"


def test_token_is_sent_and_a_missing_token_is_explained(model_dir, tmp_path):
    with HubServer(root=model_dir, repo=REPO, token="hf_secret") as server:
        with pytest.raises(weights.FetchError, match="needs a token with access"):
            weights.fetch(_request(server, tmp_path / "a"))
        weights.fetch(_request(server, tmp_path / "b", token="hf_secret"))
    _same_tree(model_dir, tmp_path / "b")


def test_cli_reads_the_token_from_a_file(model_dir, tmp_path, monkeypatch, capsys):
    """The weights role hands the token over in a root-only file: not in argv, not in an environment or
    module arguments that -vvv would print."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    token_file = tmp_path / "token"
    with HubServer(root=model_dir, repo=REPO, token="hf_secret") as server:
        base = ["fetch", "--repo", REPO, "--dest", str(tmp_path / "m"), "--endpoint", server.url,
                "--token-file", str(token_file)]
        assert main(base) == 2
        assert "cannot read it" in capsys.readouterr().err
        token_file.write_text("hf_wrong\n")
        assert main(base) != 0
        token_file.write_text("hf_secret\n")
        assert main(base) == 0
    assert "hf_secret" not in capsys.readouterr().out


def test_unknown_revision_is_a_clear_error(hub, tmp_path):
    request = weights.FetchRequest(source="hf", repo="nobody/none", revision="main", dest=tmp_path / "m",
                                   endpoint=hub.url)
    with pytest.raises(weights.FetchError, match="does not exist; check the repo id and the revision"):
        weights.fetch(request)


def test_cli_fetch_check_and_exit_codes(hub, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "m"
    base = ["fetch", "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url]
    assert main([*base, "--check"]) == 1
    monkeypatch.setenv("HF_TOKEN", "unused-by-this-hub")
    assert main([*base, "--verify", "full"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["files_fetched"] == 4 and out["commit"] == hub.commit
    assert main([*base, "--check"]) == 0
    assert main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "x"), "--source", "local"]) == 2
    assert "needs --local-path" in capsys.readouterr().err
    assert main([*base[:4], str(tmp_path / "y"), "--endpoint", hub.url, "--headroom", "1e12"]) == 4


def test_write_manifest_serves_an_http_mirror(model_dir):
    path = weights.write_manifest(model_dir)
    manifest = json.loads(path.read_text())
    entry = next(e for e in manifest["files"] if e["path"] == BIG)
    assert entry["sha256"] == hashlib.sha256((model_dir / BIG).read_bytes()).hexdigest()
    assert weights.MANIFEST_NAME not in {e["path"] for e in manifest["files"]}


def test_write_manifest_works_as_the_readme_shows_it(model_dir, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    documented = re.search(r"`(kimi-service fetch --write-manifest[^`]*)` writes `DIR/([^`]+)`", readme)
    assert documented, "README.md no longer shows the --write-manifest command"
    command, written = documented.groups()
    argv = [str(model_dir) if word == "DIR" else word for word in shlex.split(command)]
    assert main(argv[1:]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir / written) and written == weights.MANIFEST_NAME
    assert {e["path"] for e in json.loads((model_dir / written).read_text())["files"]} == {
        p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file() and p.name != written
    }


def test_fetch_without_a_repo_or_a_writable_manifest_says_so(model_dir, capsys):
    assert main(["fetch", "--dest", str(model_dir)]) == 2
    assert "fetch needs --repo" in capsys.readouterr().err
    (model_dir / weights.MANIFEST_NAME).mkdir()
    assert main(["fetch", "--write-manifest", "--dest", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-service: error: manifest of") and "Is a directory" in err and "Traceback" not in err


def test_hub_server_speaks_the_protocol_huggingface_hub_uses(hub, model_dir, tmp_path):
    """The official client downloads the same tree from the test server, so our client is tested
    against a faithful server, not one shaped after our own code."""
    import huggingface_hub as hf
    out = hf.snapshot_download(REPO, revision="main", endpoint=hub.url, local_dir=tmp_path / "hf",
                               cache_dir=tmp_path / "cache", token=False)
    _same_tree(model_dir, Path(out))
    info = hf.HfApi(endpoint=hub.url).model_info(REPO, revision="main", files_metadata=True, token=False)
    big = next(s for s in info.siblings if s.rfilename == BIG)
    assert big.lfs.sha256 == hashlib.sha256((model_dir / BIG).read_bytes()).hexdigest()


def test_a_same_size_change_on_disk_is_caught_even_when_verifying_sizes_only(hub, model_dir, tmp_path):
    """verify=size trusts the download, not a file that was written to after it was recorded."""
    dest = tmp_path / "m"
    weights.fetch(_request(hub, dest, verify="size"))
    with (dest / BIG).open("r+b") as handle:
        handle.seek(4096)
        handle.write(b"garbage")
    assert not weights.is_up_to_date(_request(hub, dest, verify="size"))
    hub.log.clear()
    result = weights.fetch(_request(hub, dest, verify="size"))
    fetched = [r.path.rsplit("/", 1)[-1] for r in hub.log if "/resolve/" in r.path]
    assert fetched == [BIG]
    assert result.files_fetched == 1
    _same_tree(model_dir, dest)


def test_a_changed_file_without_a_published_hash_is_fetched_again(model_dir, tmp_path):
    """A plain mirror without sha256 in its manifest: a touched file cannot be proven intact."""
    source = weights.FetchRequest(source="local", repo=REPO, revision="main", dest=tmp_path / "m",
                                  local_path=model_dir, verify="size")
    weights.fetch(source)
    target = tmp_path / "m" / "tokenizer.json"
    target.write_text("[]" * 1000)
    weights.fetch(source)
    assert target.read_text() == (model_dir / "tokenizer.json").read_text()
