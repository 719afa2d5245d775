"""`kimi-service fetch` against hostile destinations and sources (issue 25, items 4, 5, 6, 9 and 10).

Real files, real links, the real local hub server over loopback: what root would write through a
planted link, what a resume splices, what a source that sends more than it lists gets written.
"""

from __future__ import annotations

import json
import os
import pwd
import resource
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_service import weights
from kimi_service.cli import main
from tests.support import weights_fixtures
from tests.support.hub_server import Fault, HubServer
from tests.support.weights_fixtures import BIG, REPO

model_dir, hub = weights_fixtures.model_dir, weights_fixtures.hub
_request, _same_tree = weights_fixtures.hf_request, weights_fixtures.same_tree

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another user")



@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the model directory that root must never write (think /etc/cron.d/...)."""
    path = tmp_path / "outside" / "victim"
    path.parent.mkdir()
    path.write_text("do not touch\n")
    return path


# --- item 4: never follow links in the destination -------------------------------------------

@pytest.mark.parametrize("planted", [BIG + weights.INCOMPLETE_SUFFIX, weights.MARKER_NAME + ".tmp",
                                     "config.json" + weights.STATE_SUFFIX])
def test_a_link_planted_at_a_partial_or_temporary_path_is_replaced_not_followed(hub, model_dir, tmp_path,
                                                                                 victim, planted):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / planted).symlink_to(victim)
    weights.fetch(_request(hub, dest))
    assert victim.read_text() == "do not touch\n"
    _same_tree(model_dir, dest)
    assert not [p for p in dest.rglob("*") if p.is_symlink()]


def test_a_link_at_a_target_is_replaced_even_when_it_points_at_the_right_bytes(hub, model_dir, tmp_path):
    """A link to a file the engine's user controls would let it change the weights later."""
    dest, elsewhere = tmp_path / "m", tmp_path / "engine-owned-config.json"
    dest.mkdir()
    elsewhere.write_bytes((model_dir / "config.json").read_bytes())
    (dest / "config.json").symlink_to(elsewhere)
    weights.fetch(_request(hub, dest))
    assert not (dest / "config.json").is_symlink()
    _same_tree(model_dir, dest)


def test_a_linked_subdirectory_is_replaced_and_nothing_lands_outside(hub, model_dir, tmp_path):
    dest, outside = tmp_path / "m", tmp_path / "outside-dir"
    dest.mkdir()
    outside.mkdir()
    (dest / "sub").symlink_to(outside)
    weights.fetch(_request(hub, dest))
    assert list(outside.iterdir()) == []
    assert (dest / "sub").is_dir() and not (dest / "sub").is_symlink()
    _same_tree(model_dir, dest)


@as_root
@pytest.mark.parametrize("where", ["dest", "ancestor"])
def test_a_link_owned_by_another_user_on_the_way_to_dest_is_refused(hub, tmp_path, where, capsys):
    real = tmp_path / "real"
    (real / "m").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real / "m" if where == "dest" else real)
    os.lchown(link, 4242, 4242)
    dest = link if where == "dest" else link / "m"
    rc = main(["fetch", "--repo", REPO, "--dest", str(dest), "--endpoint", hub.url])
    err = capsys.readouterr().err
    assert rc == 1 and "symbolic link owned by uid 4242" in err and "Traceback" not in err
    assert list((real / "m").iterdir()) == []


@as_root
def test_a_link_owned_by_root_on_the_way_to_dest_is_followed(hub, model_dir, tmp_path):
    """The operator may point the model directory at another disk with a link of their own."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "models").symlink_to(tmp_path / "disk")
    weights.fetch(_request(hub, tmp_path / "models" / "m"))
    _same_tree(model_dir, tmp_path / "disk" / "m")


@as_root
def test_the_weights_end_up_root_owned_and_read_only_to_the_engine(hub, tmp_path):
    """Whatever the umask, and even when the engine's user made the directory beforehand."""
    dest = tmp_path / "m"
    (dest / "sub").mkdir(parents=True)
    for path in (dest, dest / "sub"):
        os.chown(path, 4242, 4242)
        path.chmod(0o777)
    old = os.umask(0o077)
    try:
        weights.fetch(_request(hub, dest))
    finally:
        os.umask(old)
    for path in [dest, dest / "sub"]:
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode) & 0o022) == (0, 0), path
    for path in (dest / BIG, dest / "config.json", dest / "sub" / "extra.bin"):
        st = path.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644), path


@as_root
def test_a_partial_file_owned_by_another_user_is_not_resumed(hub, model_dir, tmp_path):
    """The engine's user could keep it open and write into it after root checked it."""
    dest = tmp_path / "m"
    hub.faults[BIG] = Fault(drop_after=1_000_000)
    with pytest.raises(weights.FetchError):
        weights.fetch(_request(hub, dest, retries=0))
    os.chown(dest / (BIG + weights.INCOMPLETE_SUFFIX), 4242, 4242)
    weights.fetch(_request(hub, dest))
    assert hub.gets(BIG)[-1].range is None
    assert (dest / BIG).stat().st_uid == 0
    _same_tree(model_dir, dest)


# --- issue 39: root never follows a link planted in a directory the service user owns --------------

SERVICE_USER = "nobody"
SECRET = b"root-only secret\n"
as_root_with_a_service_user = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root and runuser to act as another user")


def _as_service_user(*argv: str) -> None:
    subprocess.run(["runuser", "-u", SERVICE_USER, "--", *argv], check=True)


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "root-only"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def service_dir(model_dir) -> Iterator[Path]:
    """A state directory the service user owns, holding a copy of the model it owns too."""
    base = Path(tempfile.mkdtemp(prefix="kimi-service-state-"))
    try:
        base.chmod(0o755)  # the service user must reach its directory to plant anything
        state = base / "state"
        shutil.copytree(model_dir, state / "model")
        account = pwd.getpwnam(SERVICE_USER)
        for path in [state, *state.rglob("*")]:
            os.lchown(path, account.pw_uid, account.pw_gid)
        yield state
    finally:
        shutil.rmtree(base)


def _local_fetch(source: Path, dest: Path) -> list[str]:
    return ["fetch", "--source", "local", "--local-path", str(source), "--dest", str(dest), "--repo", REPO]


def _holds_secret(tree: Path) -> bool:
    """Whether a plain file (a copy, not the planted link itself) holds the secret."""
    return any(p.is_file() and not p.is_symlink() and SECRET in p.read_bytes() for p in tree.rglob("*"))


@as_root_with_a_service_user
@pytest.mark.parametrize("planted", ["stolen.bin", "sub/stolen.bin"])
@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in-place"])
def test_a_link_planted_in_a_local_source_is_refused_and_its_target_never_copied(
        service_dir, tmp_path, secret, capsys, planted, in_place):
    source = service_dir / "model"
    _as_service_user("ln", "-s", str(secret), str(source / planted))
    dest = source if in_place else tmp_path / "m"
    rc = main(_local_fetch(source, dest))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and f"{source / planted} is a symbolic link" in err and "Traceback" not in err
    assert not dest.exists() or not _holds_secret(dest)
    assert (secret.read_bytes(), stat.S_IMODE(secret.stat().st_mode)) == (SECRET, 0o600)


@as_root_with_a_service_user
@pytest.mark.parametrize("swapped", [".", "sub"], ids=["the-source", "a-subdirectory"])
def test_a_source_directory_swapped_for_a_link_after_the_listing_is_not_read_through(
        service_dir, tmp_path, model_dir, monkeypatch, swapped):
    """What the copy reads is what was listed: the same directories, held open, never a path resolved again."""
    source = service_dir / "model"
    decoy = tmp_path / "root-only-dir"
    shutil.copytree(model_dir / swapped, decoy)
    for path in decoy.rglob("*"):
        if path.is_file():
            path.write_bytes(SECRET.ljust(path.stat().st_size, b"#")[:path.stat().st_size])
    decoy.chmod(0o700)
    listed = weights.list_local

    def list_then_swap(*args, **kwargs):
        listing = listed(*args, **kwargs)
        victim = source / swapped
        _as_service_user("mv", str(victim), f"{victim}.old")
        _as_service_user("ln", "-s", str(decoy), str(victim))
        return listing

    monkeypatch.setattr(weights, "list_local", list_then_swap)
    dest = tmp_path / "m"
    weights.fetch(weights.FetchRequest(source="local", repo=REPO, revision="main", dest=dest, local_path=source))
    _same_tree(model_dir, dest)
    assert not _holds_secret(dest)


@as_root_with_a_service_user
def test_write_manifest_refuses_a_link_at_the_manifest_and_leaves_its_target_alone(service_dir, secret, capsys):
    source = service_dir / "model"
    _as_service_user("ln", "-s", str(secret), str(source / weights.MANIFEST_NAME))
    rc = main(["fetch", "--write-manifest", "--dest", str(source)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "is a symbolic link" in err, err
    assert (secret.read_bytes(), stat.S_IMODE(secret.stat().st_mode)) == (SECRET, 0o600)


@as_root_with_a_service_user
def test_a_link_planted_at_the_manifest_while_hashing_is_replaced_not_written_through(
        service_dir, secret, model_dir, monkeypatch):
    source = service_dir / "model"
    hashed = weights.hash_fd

    def plant_then_hash(fd: int) -> str:
        if not (source / weights.MANIFEST_NAME).is_symlink():
            _as_service_user("ln", "-s", str(secret), str(source / weights.MANIFEST_NAME))
        return hashed(fd)

    monkeypatch.setattr(weights, "hash_fd", plant_then_hash)
    manifest = weights.write_manifest(source)
    assert (secret.read_bytes(), stat.S_IMODE(secret.stat().st_mode)) == (SECRET, 0o600)
    assert not manifest.is_symlink()
    listed = {f["path"] for f in json.loads(manifest.read_text())["files"]}
    assert listed == {p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*") if p.is_file()}


# --- item 5: a resume is valid only against the same commit and ETag --------------------------

def _interrupt(server: HubServer, dest: Path, **kw) -> None:
    server.faults[BIG] = Fault(drop_after=1_000_000)
    with pytest.raises(weights.FetchError, match="giving up"):
        weights.fetch(_request(server, dest, retries=0, **kw))
    assert (dest / (BIG + weights.INCOMPLETE_SUFFIX)).stat().st_size == 1_000_000


def _new_revision(root: Path) -> bytes:
    """The same file at a new commit: same size, other bytes."""
    before = (root / BIG).stat()
    data = os.urandom(before.st_size)
    (root / BIG).write_bytes(data)
    # The hub server knows a file by its size and mtime; a rewrite within the clock's tick (a few ms) would
    # keep the old mtime and so the old ETag.
    os.utime(root / BIG, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    return data


def test_a_resume_after_the_revision_moved_starts_the_file_over(hub, model_dir, tmp_path):
    dest = tmp_path / "m"
    _interrupt(hub, dest, verify="size")
    new = _new_revision(model_dir)
    hub.commit = "fedcba9876543210fedcba9876543210fedcba98"
    weights.fetch(_request(hub, dest, verify="size"))
    assert hub.gets(BIG)[-1].range is None  # no Range: the old bytes were discarded
    assert (dest / BIG).read_bytes() == new
    assert not (dest / (BIG + weights.STATE_SUFFIX)).exists()


def test_a_resume_against_another_etag_starts_the_file_over(hub, model_dir, tmp_path):
    """A plain mirror publishing no hashes, same "revision": only the ETag tells the bytes changed."""
    hub.manifest_hashes = False
    request = weights.FetchRequest(source="http", repo=REPO, revision="main", dest=tmp_path / "m",
                                   endpoint=f"{hub.url}/mirror", retries=0)
    hub.faults[BIG] = Fault(drop_after=1_000_000)
    with pytest.raises(weights.FetchError, match="giving up"):
        weights.fetch(request)
    new = _new_revision(model_dir)
    weights.fetch(request)
    ranges = [r.range for r in hub.gets(BIG)]
    assert ranges == [None, "bytes=1000000-", None]  # resumed, saw another ETag, started over
    assert (tmp_path / "m" / BIG).read_bytes() == new


def _mirror_request(hub: HubServer, dest: Path, **kw) -> weights.FetchRequest:
    """A plain mirror publishing no hashes."""
    hub.manifest_hashes = False
    return weights.FetchRequest(source="http", repo=REPO, revision="main", dest=dest,
                                endpoint=f"{hub.url}/mirror", retries=0, **kw)


def _rewrite_in_the_same_second(root: Path) -> bytes:
    """The same file, same size, other bytes, and the mtime it had: its ETag or date stays the same."""
    before = (root / BIG).stat()
    data = os.urandom(before.st_size)
    (root / BIG).write_bytes(data)
    os.utime(root / BIG, ns=(before.st_atime_ns, before.st_mtime_ns))
    return data


@pytest.mark.parametrize("validator", ["weak", "last-modified"])
def test_without_a_hash_or_strong_etag_a_file_travels_whole_and_is_never_spliced(hub, model_dir, tmp_path,
                                                                                 validator):
    """A mirror's weak ETag or Last-Modified date does not change when a file is rewritten within a
    second: such a file is fetched in one piece, and an interrupted one starts over, so the old first half
    is never joined to the new second half."""
    hub.validator = validator
    request = _mirror_request(hub, tmp_path / "m", range_size=weights.MIN_RANGE_SIZE, connections=4)
    hub.faults[BIG] = Fault(drop_after=1_000_000)
    with pytest.raises(weights.FetchError, match="giving up"):
        weights.fetch(request)
    assert [r.range for r in hub.gets(BIG)] == [None]  # one range, though ranges of 64 KiB were asked for
    new = _rewrite_in_the_same_second(model_dir)
    weights.fetch(request)
    assert [r.range for r in hub.gets(BIG)] == [None, None]  # no resume
    assert (tmp_path / "m" / BIG).read_bytes() == new


def test_a_resume_from_a_mirror_repeats_its_strong_etag_as_if_range(hub, model_dir, tmp_path):
    """A strong ETag makes a resume provable only with If-Range: a source whose file changed sends it whole."""
    request = _mirror_request(hub, tmp_path / "m")
    hub.faults[BIG] = Fault(drop_after=1_000_000)
    with pytest.raises(weights.FetchError, match="giving up"):
        weights.fetch(request)
    etag = f'"{hub.sibling(model_dir / BIG)["lfs"]["sha256"]}"'  # the hub server's ETag of a large file
    weights.fetch(request)
    assert [(r.range, r.if_range, r.status) for r in hub.gets(BIG)][1:] == [("bytes=1000000-", etag, 206)]
    _same_tree(model_dir, tmp_path / "m")


def test_a_partial_file_without_its_state_is_not_resumed(hub, model_dir, tmp_path):
    dest = tmp_path / "m"
    _interrupt(hub, dest)
    (dest / (BIG + weights.STATE_SUFFIX)).unlink()
    weights.fetch(_request(hub, dest))
    assert hub.gets(BIG)[-1].range is None
    _same_tree(model_dir, dest)


def test_a_published_hash_catches_a_bad_resume_under_verify_size(hub, model_dir, tmp_path):
    """Even a resume whose state matches is hashed when the source publishes a hash."""
    dest = tmp_path / "m"
    _interrupt(hub, dest, verify="size")
    partial = dest / (BIG + weights.INCOMPLETE_SUFFIX)
    with partial.open("r+b") as handle:  # what a disk error or a stray writer leaves behind
        handle.write(b"\0" * 4096)
    weights.fetch(_request(hub, dest, verify="size"), sleep=lambda _: None)
    assert [r.range for r in hub.gets(BIG)][1:] == ["bytes=1000000-", None]
    _same_tree(model_dir, dest)


# --- item 6: never write beyond the listed size --------------------------------------------

@pytest.mark.parametrize("no_length", [False, True], ids=["content-length", "until-close"])
def test_a_source_sending_more_than_it_listed_is_stopped_at_the_listed_size(hub, model_dir, tmp_path,
                                                                            no_length):
    listed = (model_dir / "config.json").stat().st_size
    hub.faults["config.json"] = Fault(extra=8 << 20, no_length=no_length)
    dest = tmp_path / "m"
    with pytest.raises(weights.FetchError) as err:
        weights.fetch(_request(hub, dest))
    message = str(err.value)
    assert f"config.json: the source listed {listed} bytes but sen" in message
    assert "stopped at the listed size" in message
    partial = dest / ("config.json" + weights.INCOMPLETE_SUFFIX)
    assert not partial.exists() or partial.stat().st_size <= listed
    assert len(hub.gets("config.json")) == 1  # not retried: the source would only do it again


# --- item 9: malformed listings end with exit 2 and one line -----------------------------

MALFORMED = {
    "not-json": b"<html>busy</html>",
    "invalid-utf8": b'{"siblings": [{"rfilename": "\xff\xfe", "size": 1}]}',
    "a-list": b"[]",
    "siblings-not-a-list": b'{"siblings": {"a": 1}}',
    "entry-not-an-object": b'{"siblings": ["config.json"]}',
    "missing-name": b'{"siblings": [{"size": 3}]}',
    "name-not-a-string": b'{"siblings": [{"rfilename": 5, "size": 3}]}',
    "negative-size": b'{"siblings": [{"rfilename": "a.bin", "size": -1}]}',
    "size-a-string": b'{"siblings": [{"rfilename": "a.bin", "size": "12"}]}',
    "size-a-bool": b'{"siblings": [{"rfilename": "a.bin", "size": true}]}',
    "size-a-float": b'{"siblings": [{"rfilename": "a.bin", "size": 1e400}]}',
    "lfs-not-an-object": b'{"siblings": [{"rfilename": "a.bin", "size": 3, "lfs": 7}]}',
    "bad-sha256": b'{"siblings": [{"rfilename": "a.bin", "lfs": {"size": 3, "sha256": "xyz"}}]}',
    "commit-not-a-string": b'{"sha": ["x"], "siblings": []}',
    "commit-with-a-slash-space": b'{"sha": "a b", "siblings": []}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "unsafe-path": b'{"siblings": [{"rfilename": "../../etc/cron.d/x", "size": 3}]}',
    # One file written two ways, or two files at one place: the second would overwrite the first.
    "a-dot-component": b'{"siblings": [{"rfilename": "./config.json", "size": 3}]}',
    "a-dot-inside": b'{"siblings": [{"rfilename": "a/./b.bin", "size": 3}]}',
    "a-path-twice": b'{"siblings": [{"rfilename": "a.bin", "size": 3}, {"rfilename": "a.bin", "size": 4}]}',
    "a-path-twice-in-case": b'{"siblings": [{"rfilename": "A.bin", "size": 3}, {"rfilename": "a.bin", "size": 3}]}',
    "a-file-and-a-directory": b'{"siblings": [{"rfilename": "a", "size": 3}, {"rfilename": "a/b.bin", "size": 3}]}',
    # Names that show as other names: a C1 control, a line separator, a right-to-left override.
    "a-c1-control": '{"siblings": [{"rfilename": "model\u0085.bin", "size": 3}]}'.encode(),
    "a-line-separator": '{"siblings": [{"rfilename": "model\u2028.bin", "size": 3}]}'.encode(),
    "a-bidi-override": '{"siblings": [{"rfilename": "model\u202egpj.bin", "size": 3}]}'.encode(),
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_hub_listing_exits_2_with_one_line(hub, tmp_path, capsys, body):
    hub.listings["hf"] = body
    rc = main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "m"), "--endpoint", hub.url])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("kimi-service: error: ") and "Traceback" not in err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("kind", "body"), [
    ("modelscope", b'{"Data": {"Files": [{"Path": "a.bin", "Type": "blob", "Size": -5}]}}'),
    ("modelscope", b'{"Data": []}'),
    ("modelscope", b'{"Data": {"Files": [{"Path": "a.bin", "Type": "blob"}]}}'),
    ("mirror", b'{"files": "a.bin"}'),
    ("mirror", b'{"files": [{"path": "a.bin", "size": 3, "sha256": 12}]}'),
    ("mirror", b'{"commit": 3, "files": []}'),
])
def test_malformed_modelscope_and_mirror_listings_exit_2(hub, tmp_path, capsys, kind, body):
    hub.listings[kind] = body
    source = ["--source", "modelscope", "--endpoint", hub.url] if kind == "modelscope" else [
        "--source", "http", "--endpoint", f"{hub.url}/mirror"]
    rc = main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "m"), *source])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err


# --- item 10: a token never reaches an error message -----------------------------------

@pytest.mark.parametrize("content", [b"hf_first_secret\nhf_second_secret\n", b"hf_with space_secret",
                                     b"hf_tab\tsecret", b"hf_\xff\xfe_secret", b"hf_bell\x07secret"])
def test_a_bad_token_file_is_named_and_never_echoed(hub, tmp_path, capsys, monkeypatch, content):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_bytes(content)
    rc = main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "m"), "--endpoint", hub.url,
               "--token-file", str(token_file)])
    captured = capsys.readouterr()
    assert rc == 2
    assert f"--token-file {token_file}" in captured.err
    assert "secret" not in captured.err + captured.out and "Bearer" not in captured.err
    assert hub.log == []  # refused before any request


def test_a_bad_token_in_the_environment_is_refused_without_echo(hub, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_one_secret\nhf_two_secret")
    rc = main(["fetch", "--repo", REPO, "--dest", str(tmp_path / "m"), "--endpoint", hub.url])
    err = capsys.readouterr().err
    assert rc == 2 and "HF_TOKEN" in err and "secret" not in err and "Bearer" not in err


# --- redirects -------------------------------------------------------------------------------------

def test_a_file_without_a_hash_is_not_taken_from_a_host_nobody_named(hub, model_dir, tmp_path, capsys):
    """A mirror publishing no hashes redirects its files elsewhere ("localhost" for "127.0.0.1"): what
    would come from there could not be checked, so it is refused, naming the host and the option."""
    hub.manifest_hashes = False
    hub.redirect_host = "localhost"
    argv = ["fetch", "--source", "http", "--repo", REPO, "--dest", str(tmp_path / "m"),
            "--endpoint", f"{hub.url}/mirror", "--retries", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "redirected to localhost, a host the listing did not name" in err and "--redirect-host localhost" in err
    landed = [p for p in (tmp_path / "m").rglob("*") if p.is_file() and p.stat().st_size
              and not p.name.endswith(weights.STATE_SUFFIX)]
    assert landed == [], "a byte was taken from the other host"
    assert main([*argv, "--redirect-host", "localhost"]) == 0
    _same_tree(model_dir, tmp_path / "m")


def test_a_file_with_a_published_hash_may_be_redirected_anywhere(hub, model_dir, tmp_path):
    hub.redirect_host = "localhost"  # the hub hands its large files to a CDN: what arrives is hashed
    weights.fetch(_request(hub, tmp_path / "m"))
    assert any(r.status == 302 for r in hub.log)
    _same_tree(model_dir, tmp_path / "m")


# --- listings nobody here wrote: many files ---------------------------------------------

def test_many_files_are_fetched_within_a_small_descriptor_limit(model_dir, tmp_path):
    """A partial file is opened when its turn comes and closed when it is done: 400 files fetch under a
    limit of 48 descriptors more than the test process already holds (8 connections, 8 files in flight)."""
    shards = model_dir / "shards"
    shards.mkdir()
    for n in range(400):
        (shards / f"part-{n:05d}.bin").write_bytes(n.to_bytes(4, "big") * 16)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with HubServer(root=model_dir, repo=REPO) as server:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 48, hard))
        try:
            weights.fetch(_request(server, tmp_path / "m", verify="size"))
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _same_tree(model_dir, tmp_path / "m")
