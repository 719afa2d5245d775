"""Parallel, ranged, resumable downloads against the local hub server (issue 23).

Behaviour only, no timings: which ranges were asked for, how many responses were in flight at once
as the server saw them, what a resume fetches again, and that the result is byte-identical.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_service import weights
from tests.support import weights_fixtures
from tests.support.hub_server import Fault, HubServer
from tests.support.weights_fixtures import BIG, REPO

model_dir, hub = weights_fixtures.model_dir, weights_fixtures.hub
_request, _same_tree = weights_fixtures.hf_request, weights_fixtures.same_tree

MIB = 1 << 20


def _ranges(size: int, step: int) -> list[str]:
    return [f"bytes={start}-{min(start + step, size) - 1}" for start in range(0, size, step)]


def test_a_large_file_comes_in_byte_ranges_and_is_byte_identical(hub, model_dir, tmp_path):
    size = (model_dir / BIG).stat().st_size
    dest = tmp_path / "m"
    result = weights.fetch(_request(hub, dest, connections=4, range_size=MIB, verify="size"))
    assert sorted(r.range for r in hub.gets(BIG)) == sorted(_ranges(size, MIB))
    assert all(r.status == 206 for r in hub.gets(BIG))
    assert hub.sent_bytes(BIG) == size
    assert result.bytes_downloaded == result.bytes_total
    _same_tree(model_dir, dest)
    marker = json.loads((dest / weights.MARKER_NAME).read_text())
    assert {e["verified"] for e in marker["files"]} == {"full"}  # the hub publishes every file's hash
    assert not list(dest.rglob("*.incomplete*"))


def test_small_files_and_one_connection_use_a_single_stream(hub, model_dir, tmp_path):
    weights.fetch(_request(hub, tmp_path / "a", connections=1, range_size=MIB))
    assert [r.range for r in hub.gets(BIG)] == [None]
    assert all(r.range is None for r in hub.log if "/resolve/" in r.path)


@pytest.mark.parametrize("connections", [1, 3])
def test_connections_are_bounded_as_the_server_sees_them(hub, model_dir, tmp_path, connections):
    hub.rate = 4 * MIB  # slow enough per response that transfers overlap
    weights.fetch(_request(hub, tmp_path / "m", connections=connections, range_size=256 << 10))
    assert hub.max_active <= connections
    assert hub.max_active > 1 or connections == 1  # several at once when allowed
    _same_tree(model_dir, tmp_path / "m")


def test_an_interrupted_ranged_download_resumes_only_what_is_missing(hub, model_dir, tmp_path):
    size = (model_dir / BIG).stat().st_size
    dest = tmp_path / "m"
    hub.rate = 8 * MIB
    hub.faults[BIG] = Fault(drop_after=300_000)
    with pytest.raises(weights.FetchError, match="giving up after 1 attempts"):
        weights.fetch(_request(hub, dest, connections=2, range_size=MIB, retries=0))
    state = json.loads((dest / (BIG + weights.STATE_SUFFIX)).read_text())
    assert [r[:2] for r in state["ranges"]] == [[s, min(s + MIB, size)] for s in range(0, size, MIB)]
    missing = _missing(dest)
    assert sum(done for _, _, done in state["ranges"]) > 0

    hub.settle()  # the ranges run 1 dropped when it stopped are logged too
    hub.log.clear()
    weights.fetch(_request(hub, dest, connections=2, range_size=MIB, retries=0))
    asked = sorted(r.range for r in hub.gets(BIG))
    assert asked == sorted(f"bytes={start}-{end - 1}" for start, end in missing.items())
    assert hub.sent_bytes(BIG) == sum(end - start for start, end in missing.items()) < size
    _same_tree(model_dir, dest)


def test_a_killed_run_resumes_without_fetching_finished_ranges_again(hub, model_dir, tmp_path):
    """SIGKILL mid-download, as a timed-out async task or a reboot would: the state file survives."""
    size = (model_dir / BIG).stat().st_size
    dest, progress = tmp_path / "m", tmp_path / "progress.json"
    hub.rate = MIB // 2
    child = subprocess.Popen(
        [sys.executable, "-m", "kimi_service", "fetch", "--repo", REPO, "--dest", str(dest), "--endpoint",
         hub.url, "--connections", "2", "--range-mib", "1", "--progress-file", str(progress)],
        env={"PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = dest / (BIG + weights.STATE_SUFFIX)
            if state.exists() and sum(r[2] for r in json.loads(state.read_text())["ranges"]) >= MIB:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the child never got a range done")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    hub.settle()
    hub.rate = None
    hub.log.clear()
    missing = _missing(dest)
    weights.fetch(_request(hub, dest, connections=2, range_size=MIB))
    assert sorted(r.range for r in hub.gets(BIG)) == sorted(f"bytes={a}-{b - 1}" for a, b in missing.items())
    assert hub.sent_bytes(BIG) == sum(b - a for a, b in missing.items()) <= size - MIB
    _same_tree(model_dir, dest)


def _missing(dest: Path) -> dict[int, int]:
    """What the state file beside the partial file says is still to fetch: {first byte: end}."""
    state = json.loads((dest / (BIG + weights.STATE_SUFFIX)).read_text())
    return {start + done: end for start, end, done in state["ranges"] if start + done < end}


def test_a_server_that_ignores_ranges_gets_one_stream(model_dir, tmp_path):
    """python -m http.server, which serves the fan-out, answers every Range with the whole file."""
    with HubServer(root=model_dir, repo=REPO) as hub:
        hub.ignore_ranges = True
        weights.fetch(_request(hub, tmp_path / "m", connections=4, range_size=MIB))
        statuses = [r.status for r in hub.gets(BIG)]
    assert statuses[-1] == 200 and hub.sent_bytes(BIG) >= (model_dir / BIG).stat().st_size
    _same_tree(model_dir, tmp_path / "m")


def test_connections_outside_the_bounds_are_refused(hub, tmp_path):
    for bad in (0, weights.MAX_CONNECTIONS + 1):
        with pytest.raises(weights.UsageError, match="connections must be 1 to"):
            weights.fetch(_request(hub, tmp_path / "m", connections=bad))
