"""Measure device memory bandwidth and the decode roofline of a model at concurrency 1.

At batch size 1 every decoded token reads every weight once, so weight bytes / bandwidth is the
fastest a token can come; the benchmark's concurrency-1 TPOT is compared with it. Bandwidth is a
device-to-device copy of a few GB, counting bytes read plus bytes written (median of timed runs).

Usage: roofline.py MODEL_DIR [--gib 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def copy_bandwidth(nbytes: int, repeats: int = 20) -> float:
    """Bytes per second moved by `dst.copy_(src)`, reads plus writes."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    if not torch.equal(dst, src):
        raise SystemExit("the copy did not reproduce its source; the bandwidth figure would be meaningless")
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def weight_bytes(model_dir: Path) -> int:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return int(json.loads(index.read_text())["metadata"]["total_size"])
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--gib", type=float, default=4.0, help="bytes copied per timed run, GiB")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth(int(args.gib * 2**30))
    weights = weight_bytes(args.model)
    result = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weights,
        "roofline_s_per_token": weights / bandwidth,
        "roofline_tokens_per_s": bandwidth / weights,
    }
    print(f"{result['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); weights "
          f"{weights / 1e9:.2f} GB -> decode roofline at concurrency 1: {weights / bandwidth * 1000:.2f} ms "
          f"per token, {bandwidth / weights:.1f} tokens/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
