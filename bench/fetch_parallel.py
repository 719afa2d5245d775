"""How much `kimi-service fetch --connections N` gains over one connection on a slow per-stream link.

Serves a generated model (a few shards and one large file) from the local hub test server with each
response limited to --rate-mib MiB/s, like one TCP stream over a long path to the hub, fetches it
with each connection count into a fresh directory and prints a Markdown table:

    .venv/bin/python bench/fetch_parallel.py                 # the docs/benchmarks.md table
    .venv/bin/python bench/fetch_parallel.py --connections 1,2,4,8,16 --rate-mib 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_service import weights
from tests.support.hub_server import HubServer

MIB = 1 << 20
REPO = "bench/parallel"


def make_model(root: Path, shards: int, shard_mib: int, big_mib: int) -> int:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"architectures": ["DeepseekV3ForCausalLM"]}')
    (root / "tokenizer.json").write_text("{}" * 4096)
    sizes = {f"model-{i + 1:05d}-of-{shards + 1:05d}.safetensors": shard_mib for i in range(shards)}
    sizes[f"model-{shards + 1:05d}-of-{shards + 1:05d}.safetensors"] = big_mib
    for name, mib in sizes.items():
        with (root / name).open("wb") as handle:
            for _ in range(mib):
                handle.write(os.urandom(MIB))
    return sum(p.stat().st_size for p in root.iterdir())


def run(hub: HubServer, dest: Path, connections: int, range_mib: int) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    request = weights.FetchRequest(source="hf", repo=REPO, revision="main", dest=dest, endpoint=hub.url,
                                   connections=connections, range_size=range_mib * MIB)
    started = time.monotonic()
    result = weights.fetch(request)
    elapsed = time.monotonic() - started
    assert result.bytes_downloaded == result.bytes_total, result
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", default="1,4,8", help="connection counts to compare (default 1,4,8)")
    parser.add_argument("--rate-mib", type=float, default=16, help="MiB/s per response (default 16)")
    parser.add_argument("--shards", type=int, default=4, help="shard files besides the large one (default 4)")
    parser.add_argument("--shard-mib", type=int, default=32, help="size of each shard (default 32)")
    parser.add_argument("--big-mib", type=int, default=256, help="size of the large file (default 256)")
    parser.add_argument("--range-mib", type=int, default=64, help="byte range size (default 64, fetch's)")
    args = parser.parse_args()
    counts = [int(c) for c in args.connections.split(",")]
    with tempfile.TemporaryDirectory(prefix="kimi-fetch-bench-") as tmp:
        total = make_model(Path(tmp) / "repo", args.shards, args.shard_mib, args.big_mib)
        with HubServer(root=Path(tmp) / "repo", repo=REPO, rate=int(args.rate_mib * MIB)) as hub:
            for path in hub.files():  # warm the server's hash cache: time the fetch, not the server
                hub.sibling(path)
            times = {n: run(hub, Path(tmp) / f"dest-{n}", n, args.range_mib) for n in counts}
    print(f"{args.shards} x {args.shard_mib} MiB + 1 x {args.big_mib} MiB + 2 small files "
          f"({total / MIB:.0f} MiB), {args.rate_mib:g} MiB/s per connection, {args.range_mib} MiB ranges, "
          "sha256 checked\n")
    print("| connections | seconds | MB/s | speed-up |")
    print("|---:|---:|---:|---:|")
    for n, seconds in times.items():
        print(f"| {n} | {seconds:.1f} | {total / seconds / 1e6:.1f} | {times[counts[0]] / seconds:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
