"""`kimi-service bench`'s report: per level, latency percentiles, throughput, errors and goodput as a table,
and the same as a plot."""

from __future__ import annotations

from pathlib import Path

from kimi_service.bench import BenchReport, Slo
from kimi_service.plots import pyplot


def format_table(report: BenchReport) -> str:
    ms = 1000.0
    header = (
        f"{'rate/s':>6} {'conc':>4} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'req/s':>7} {'goodput':>8} "
        f"{'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'TPOT p50':>9} "
        f"{'E2E p50':>8} {'p99':>8}"
    )
    lines = [
        f"{report.model} at {report.url} ({report.api}); input {report.input_len} tokens"
        + (f" after a shared {report.shared_prefix_len}-token system prompt" if report.shared_prefix_len else "")
        + f", output {report.output_len} tokens; latencies in ms",
        header,
        "-" * len(header),
    ]
    for lv in report.levels:
        rate = "closed" if lv.request_rate is None else f"{lv.request_rate:g}"
        lines.append(
            f"{rate:>6} {lv.concurrency:>4} {lv.requests:>5} {lv.errors:>4} {lv.output_tokens_per_s:>10.1f} "
            f"{lv.requests_per_s:>7.2f} {lv.goodput_requests_per_s:>8.2f} "
            f"{lv.ttft_s.p50 * ms:>9.1f} {lv.ttft_s.p90 * ms:>8.1f} {lv.ttft_s.p99 * ms:>8.1f} "
            f"{lv.itl_s.p50 * ms:>8.1f} {lv.itl_s.p99 * ms:>8.1f} {lv.tpot_s.p50 * ms:>9.1f} "
            f"{lv.e2e_s.p50 * ms:>8.1f} {lv.e2e_s.p99 * ms:>8.1f}"
        )
    slo = report.slo
    if slo != Slo():
        lines.append(f"goodput: requests/s that met every objective ({slo.describe()})")
    if slo.itl is not None:
        lines.append("vLLM's goodput, its terms alone (no ITL bound): "
                     + ", ".join(f"{lv.vllm_goodput_requests_per_s:.2f}" for lv in report.levels))
    for lv in report.levels:
        level = f"concurrency {lv.concurrency}" if lv.request_rate is None else f"{lv.request_rate:g} requests/s"
        for sample in lv.error_samples:
            lines.append(f"error at {level}: {sample}")
    return "\n".join(lines)


def write_plot(report: BenchReport, path: Path) -> None:
    plt = pyplot("--plot")
    open_loop = any(lv.request_rate is not None for lv in report.levels)
    xs = [(lv.request_rate if open_loop else lv.concurrency) for lv in report.levels]
    xlabel = "requests/s offered" if open_loop else "concurrency"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [lv.output_tokens_per_s for lv in report.levels], marker="o")
    left.set(xscale="log", xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
    right.plot(xs, [lv.ttft_s.p99 for lv in report.levels], marker="o", color="tab:red")
    right.set(xscale="log", xlabel=xlabel, ylabel="seconds", title="TTFT p99")
    for axis in (left, right):
        axis.set_xticks(xs, [f"{x:g}" for x in xs])
        axis.grid(True, alpha=0.3)
    fig.suptitle(f"{report.model}: input {report.input_len}, output {report.output_len} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
