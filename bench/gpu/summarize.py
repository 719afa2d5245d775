"""Summarize a benchmark results folder (run_bench.sh) into tables and the issue's target checks.

Reads bench-<config>-p<prefix>.json (kimi-service bench reports), roofline.json and
kv-<config>.json; prints plain-text tables and writes the same numbers as JSON.
Usage: summarize.py RESULTS_DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

BASELINE = "vllm-default"
CONFIG_ORDER = ["naive", "vllm-default", "kimi-chat", "kimi-shared-prefix", "kimi-latency"]


def load_reports(results: Path) -> dict[tuple[str, int], dict[str, Any]]:
    reports = {}
    for path in sorted(results.glob("bench-*-p*.json")):
        match = re.fullmatch(r"bench-(.+)-p(\d+)\.json", path.name)
        if match:
            reports[(match.group(1), int(match.group(2)))] = json.loads(path.read_text())
    return reports


def levels(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in report["levels"]}


def _order(key: tuple[str, int]) -> tuple[int, str, int]:
    config, prefix = key
    rank = CONFIG_ORDER.index(config) if config in CONFIG_ORDER else len(CONFIG_ORDER)
    return rank, config, prefix


def sweep_table(reports: dict[tuple[str, int], dict[str, Any]]) -> list[str]:
    lines = [f"{'config':<20} {'prefix':>6} {'conc':>4} {'err':>3} {'out tok/s':>10} {'req/s':>6} "
             f"{'goodput':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'TPOT p50':>9}  (ms)"]
    for key in sorted(reports, key=_order):
        for conc, lv in sorted(levels(reports[key]).items()):
            lines.append(
                f"{key[0]:<20} {key[1]:>6} {conc:>4} {lv['errors']:>3} {lv['output_tokens_per_s']:>10.1f} "
                f"{lv['requests_per_s']:>6.2f} {lv['goodput_requests_per_s']:>7.2f} "
                f"{lv['ttft_s']['p50'] * 1000:>9.1f} {lv['ttft_s']['p99'] * 1000:>9.1f} "
                f"{lv['itl_s']['p50'] * 1000:>8.2f} {lv['tpot_s']['p50'] * 1000:>9.2f}"
            )
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def summarize(results: Path) -> tuple[list[str], dict[str, Any]]:
    reports = load_reports(results)
    out = ["Sweeps", *sweep_table(reports), ""]
    summary: dict[str, Any] = {"targets": {}}

    roof_path = results / "roofline.json"
    roof = json.loads(roof_path.read_text()) if roof_path.exists() else None
    if roof:
        summary["roofline"] = roof
        out.append(f"Roofline: copy bandwidth {roof['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s, weights "
                   f"{roof['weight_bytes'] / 1e9:.2f} GB -> {roof['roofline_tokens_per_s']:.1f} tokens/s "
                   f"({roof['roofline_s_per_token'] * 1000:.2f} ms/token) at concurrency 1")
        fractions = {}
        for (config, prefix), report in sorted(reports.items(), key=lambda kv: _order(kv[0])):
            tpot = levels(report).get(1, {}).get("tpot_s", {}).get("p50")
            if prefix == 0 and tpot:
                fractions[config] = roof["roofline_s_per_token"] / tpot
                out.append(f"  {config:<20} concurrency 1: TPOT p50 {tpot * 1000:.2f} ms = {1 / tpot:.1f} tokens/s"
                           f" = {fractions[config]:.0%} of the roofline")
        vllm_fractions = [v for k, v in fractions.items() if k != "naive"]
        summary["targets"]["decode_vs_roofline"] = {
            "fractions": fractions, "goal": 0.7,
            "met": bool(vllm_fractions) and max(vllm_fractions) >= 0.7,
        }
        out.append("")

    flags = {}
    for path in sorted(results.glob("plan-kimi-*.json")):
        argv = json.loads(path.read_text()).get("argv") or []
        flags[path.stem.removeprefix("plan-")] = argv[3:]  # after `vllm serve MODEL`
    if flags:
        summary["planner_flags"] = flags
        out.append("Planner flags (after `vllm serve MODEL`):")
        out.extend(f"  {config:<20} {' '.join(argv)}" for config, argv in flags.items())
        out.append("")

    kv_rows = {}
    for path in sorted(results.glob("kv-*.json")):
        kv = json.loads(path.read_text())
        kv_rows[kv["config"]] = kv
        kv["ratio"] = ratio(kv.get("predicted_kv_tokens"), kv.get("vllm_kv_tokens"))
    if kv_rows:
        out.append(f"KV cache tokens: {'config':<20} {'planner':>12} {'vLLM logged':>12} {'planner/vLLM':>12}")
        for config, kv in kv_rows.items():
            out.append(f"                 {config:<20} {fmt(kv.get('predicted_kv_tokens'), 'd'):>12} "
                       f"{fmt(kv.get('vllm_kv_tokens'), 'd'):>12} {fmt(kv['ratio'], '.3f'):>12}")
        checked = [kv["ratio"] for kv in kv_rows.values() if kv["ratio"] is not None]
        summary["targets"]["kv_prediction"] = {
            "rows": kv_rows, "goal": "within 10%",
            "met": bool(checked) and all(abs(r - 1) <= 0.10 for r in checked),
        }
        out.append("")

    comparisons = {}
    for (config, prefix), report in sorted(reports.items(), key=lambda kv: _order(kv[0])):
        base = reports.get((BASELINE, prefix))
        if not config.startswith("kimi-") or base is None:
            continue
        ours, theirs = levels(report), levels(base)
        rows = {}
        for conc in sorted(set(ours) & set(theirs)):
            rows[conc] = {
                "throughput": ratio(ours[conc]["output_tokens_per_s"], theirs[conc]["output_tokens_per_s"]),
                "goodput": ratio(ours[conc]["goodput_requests_per_s"], theirs[conc]["goodput_requests_per_s"]),
            }
        comparisons[f"{config}-p{prefix}"] = rows
    if comparisons:
        out.append("Planner flags / vLLM defaults (same prefix), per concurrency: throughput, goodput")
        for name, rows in comparisons.items():
            cells = "  ".join(f"c{c}: {fmt(r['throughput'])}x {fmt(r['goodput'])}x" for c, r in rows.items())
            out.append(f"  {name:<26} {cells}")
        throughput_ratios = [r["throughput"] for rows in comparisons.values() for r in rows.values()
                             if r["throughput"] is not None]
        summary["targets"]["planner_vs_defaults"] = {
            "rows": comparisons, "goal": ">= 1.0 throughput everywhere",
            "met": bool(throughput_ratios) and min(throughput_ratios) >= 1.0,
        }
        shared = [r["goodput"] for name, rows in comparisons.items() if name.startswith("kimi-shared-prefix-p")
                  and not name.endswith("-p0") for r in rows.values() if r["goodput"] is not None]
        if shared:
            summary["targets"]["shared_prefix_goodput"] = {
                "ratios": shared, "goal": ">= 1.3 goodput", "met": max(shared) >= 1.3,
            }
        out.append("")

    naive = reports.get(("naive", 0))
    if naive and 16 in levels(naive):
        naive16 = levels(naive)[16]["output_tokens_per_s"]
        speedups = {
            config: ratio(levels(report)[16]["output_tokens_per_s"], naive16)
            for (config, prefix), report in reports.items()
            if config != "naive" and prefix == 0 and 16 in levels(report)
        }
        out.append("Throughput over naive serving at concurrency 16: "
                   + ", ".join(f"{c} {fmt(s, '.1f')}x" for c, s in speedups.items()))
        summary["targets"]["vllm_vs_naive_c16"] = {
            "speedups": speedups, "goal": ">= 10x", "met": bool(speedups) and max(speedups.values()) >= 10,
        }
        out.append("")

    out.append("Targets: " + ", ".join(
        f"{name} {'met' if target['met'] else 'MISSED'}" for name, target in summary["targets"].items()
    ))
    summary["reports"] = {f"{c}-p{p}": r for (c, p), r in reports.items()}
    return out, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lines, summary = summarize(args.results)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
