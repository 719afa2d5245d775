"""The tuned endpoint against vLLM's defaults, per request shape and concurrency (run_bench.sh's `tune` and
`mix-defaults` sections): what `kimi-service tune` chose, why, and the issue's two targets.

Reads DIR/tuned.json and DIR/measurements/*.json (the tuner's store: one file per candidate, levels labelled
with their request shape) and DIR/defaults/*.json (kimi-service bench reports of `vllm serve MODEL`, one per
shape; a run short of device time may have none, and then the plan and the winner stand alone). Prints
markdown; --json writes the same rows.
Usage: tune_table.py DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

# The tuner's own floor, bands and goodput ratio hold against vLLM's defaults too.
from kimi_service.tune_stats import FLOOR, Band, goodput_band, goodput_ratio, level_map
from kimi_service.tuned import Shape, Workload

TARGET = 1.25  # tuned must be this much better in goodput on at least one workload


def load_defaults(directory: Path) -> dict[tuple[str, int], dict[str, Any]]:
    points = {}
    for path in sorted(directory.glob("*.json")):
        report = json.loads(path.read_text())
        label = Shape(report["input_len"], report["output_len"], report["shared_prefix_len"]).label
        for level in report["levels"]:
            points[label, level["concurrency"]] = level
    return points


def load_measurements(directory: Path) -> dict[tuple[str, ...], dict[tuple[str, int], dict[str, Any]]]:
    """Each candidate's levels by its flags (the plan's are ())."""
    found = {}
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        if not data["candidate"].get("run"):  # the plan's later runs and verifications stand beside these
            found[tuple(data["candidate"]["flags"])] = level_map(data["levels"])
    return found


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def rows(tuned: dict[str, Any], measurements: dict, defaults: dict) -> list[dict[str, Any]]:
    plan, winner = measurements.get(()), measurements.get(tuple(tuned["flags"]))
    if plan is None or winner is None:
        raise SystemExit("the tuner's store lacks the plan's or the winner's measurement")
    # A tune of one request shape labels none of its levels: the workload names it.
    first = Workload.from_json(tuned["workload"]).shapes[0]
    plan, winner = ({(shape or first.label, conc): level for (shape, conc), level in levels.items()}
                    for levels in (plan, winner))
    slo = Workload.from_json(tuned["workload"]).slo
    table = []
    for point in winner:
        default = defaults.get(point)
        row = {"shape": point[0], "concurrency": point[1]}
        bands: dict[str, Band] = {}
        for name, level in (("defaults", default), ("plan", plan.get(point)), ("tuned", winner[point])):
            row[f"{name}_tok_s"] = level["output_tokens_per_s"] if level else None
            if level:
                bands[name] = goodput_band(level, slo, seed=0)
            row[f"{name}_goodput"] = asdict(bands[name]) if level else None
        if default:
            row["tok_s_ratio"] = _ratio(row["tuned_tok_s"], row["defaults_tok_s"])
            row["goodput_ratio"] = _ratio(bands["tuned"].value, bands["defaults"].value)
            row["goodput_gain"] = goodput_ratio(bands["defaults"], bands["tuned"])
        else:
            row["tok_s_ratio"] = row["goodput_ratio"] = row["goodput_gain"] = None
        table.append(row)
    return table


def targets(table: list[dict[str, Any]]) -> dict[str, Any]:
    """The floor at every point (where defaults met the SLO at all, for goodput), and per shape the goodput
    gain: the geometric mean over its levels of the tuner's own goodput ratio (half a request more on each
    side, so a level where vLLM's defaults met the SLO with no request counts). Points without a
    vLLM-defaults sweep count for neither."""
    table = [row for row in table if row["goodput_gain"] is not None]
    ratios = [r for row in table for r in (row["tok_s_ratio"], row["goodput_ratio"]) if r is not None]
    worst = min(ratios, default=None)
    gains = {}
    for shape in dict.fromkeys(row["shape"] for row in table):
        per_level = [row["goodput_gain"] for row in table if row["shape"] == shape]
        if per_level:
            gains[shape] = math.prod(per_level) ** (1 / len(per_level))
    best = max(gains.items(), key=lambda item: item[1], default=(None, None))
    return {"worst_ratio": worst, "floor_met": worst is not None and worst >= FLOOR,
            "goodput_gain_by_shape": gains, "best_shape": best[0], "best_gain": best[1],
            "target_met": best[1] is not None and best[1] >= TARGET}


def render(tuned: dict[str, Any], table: list[dict[str, Any]], verdict: dict[str, Any]) -> str:
    out = [f"Tuner's choice: {' '.join(tuned['flags']) or 'the plan alone (nothing beat it)'}", ""]
    for flag, why in tuned.get("reasons", {}).items():
        out.append(f"- `{flag}`: {why}")
    out += ["", "| candidate | flags | verdict |", "| --- | --- | --- |"]
    for candidate in tuned.get("candidates", []):
        said = f"{candidate['decision']}: {candidate['reason']}"
        out.append(f"| {candidate['name']} | `{' '.join(candidate['flags'])}` | {said} |")
    for skipped in tuned.get("skipped", []):
        out.append(f"| {skipped['name']} | `{' '.join(skipped['flags'])}` | skipped: {skipped['reason']} |")
    out += ["", "| shape | conc | vLLM defaults tok/s | plan tok/s | tuned tok/s | tuned / defaults tok/s "
                "| defaults goodput [band] | plan goodput [band] | tuned goodput [band] | tuned / defaults goodput |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def fmt(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def band(found: dict[str, float] | None) -> str:
        return "-" if found is None else f"{found['value']:.2f} [{found['low']:.2f}, {found['high']:.2f}]"

    for row in table:
        out.append(f"| {row['shape']} | {row['concurrency']} | {fmt(row['defaults_tok_s'], 0)} "
                   f"| {fmt(row['plan_tok_s'], 0)} | {fmt(row['tuned_tok_s'], 0)} | {fmt(row['tok_s_ratio'])} "
                   f"| {band(row['defaults_goodput'])} | {band(row['plan_goodput'])} | {band(row['tuned_goodput'])} "
                   f"| {fmt(row['goodput_ratio'])} |")
    gains = ", ".join(f"{shape} {gain:.2f}x" for shape, gain in verdict["goodput_gain_by_shape"].items())
    if all(row["defaults_tok_s"] is None for row in table):
        out += ["", "- vLLM's defaults were not swept in this run (`run_bench.sh mix-defaults`): no target is "
                    "measured; the plan and the tuned columns are the tuner's own comparison"]
        return "\n".join(out)
    out += ["",
            f"- tuned >= {FLOOR}x vLLM's defaults at every point: {'yes' if verdict['floor_met'] else 'NO'} "
            f"(worst {fmt(verdict['worst_ratio'])}x)",
            f"- goodput >= {TARGET}x on at least one workload: {'yes' if verdict['target_met'] else 'no'} "
            f"(geometric mean per shape: {gains or 'n/a'})"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tuned = json.loads((args.directory / "tuned.json").read_text())
    table = rows(tuned, load_measurements(args.directory / "measurements"), load_defaults(args.directory / "defaults"))
    verdict = targets(table)
    print(render(tuned, table, verdict))
    if args.json:
        args.json.write_text(json.dumps({"tuned": tuned, "rows": table, "targets": verdict}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
