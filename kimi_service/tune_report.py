"""`kimi-service tune`'s report: every candidate's tokens/s and goodput band per request shape and concurrency,
its verdict, as a table (report.txt, the command's output) and a plot (tune.png)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kimi_service.bench import Slo
from kimi_service.plots import pyplot
from kimi_service.tune_candidates import DEFAULTS
from kimi_service.tune_stats import CONFIDENCE, FLOOR, RESAMPLES, Outcome, level_map, measured_bands


def _traffics(levels: Sequence[dict[str, Any]]) -> list[str]:
    """The request shapes' labels in the order they were measured ("" alone for a workload of one shape)."""
    return list(dict.fromkeys(level.get("traffic", "") for level in levels))


def format_table(outcome: Outcome, slo: Slo) -> str:
    """Per candidate and request shape: output tokens/s and goodput [its band] at each concurrency."""
    traffics = _traffics(outcome.baseline.levels)
    levels = sorted({conc for _, conc in level_map(outcome.baseline.levels)})
    width = max(len("traffic"), *map(len, traffics)) if traffics != [""] else 0
    header = (f"{'candidate':<40} " + (f"{'traffic':<{width}} " if width else "")
              + " ".join(f"{f'c={c} tok/s':>12} {'goodput [band]':>22}" for c in levels) + "  verdict")
    lines = [header, "-" * len(header)]
    baseline_said = f"baseline (goodput pooled over its {len(outcome.baselines)} runs)"
    rows = [(outcome.baseline, measured_bands(outcome.baselines, slo, outcome.noise), None),
            *((m, {p.point: p.candidate for p in v.points}, v) for m, v in outcome.measured)]
    for m, bands, verdict in rows:
        by = level_map(m.levels)
        said = baseline_said if verdict is None else f"{verdict.decision.upper()}: {verdict.reason}"
        if verdict is not None and m.candidate.held_back:
            said = f"not applied ({m.candidate.held_back}); " + said
        if m is outcome.winner:
            said = "<- applied: " + said
        for row, traffic in enumerate(traffics):
            cells = " ".join(
                f"{by[traffic, c]['output_tokens_per_s']:>12.1f} {bands[traffic, c].said():>22}"
                if (traffic, c) in bands else f"{'-':>12} {'-':>22}" for c in levels)
            name = m.candidate.name[:40] if row == 0 else ""
            lines.append(f"{name:<40} " + (f"{traffic:<{width}} " if width else "") + cells
                         + ("  " + said if row == 0 else ""))
    for candidate, why in outcome.skipped:
        lines.append(f"{candidate.name[:40]:<40} skipped: {why}")
    lines.append(f"goodput: requests/s that met the SLO ({slo.describe()}); [band]: the central {CONFIDENCE:.0%} "
                 f"of {RESAMPLES} bootstrap resamples of its requests. A candidate wins at a point when its band "
                 f"lies above the baseline's, loses when below {FLOOR}x it; it is applied when it wins somewhere "
                 f"and loses nowhere. {DEFAULTS.name!r}: vLLM's own speed defaults, the plan's memory and correctness "
                 "flags alone; a WINS there means vLLM's defaults beat the plan")
    lines.append(f"run-to-run noise measured on the plan's {len(outcome.baselines)} run(s), in every band: "
                 f"{outcome.noise:.1%}")
    lines += [f"drift: {note}" for note in outcome.drift]
    return "\n".join(lines)


def write_plot(outcome: Outcome, path: Path, slo: Slo) -> None:
    plt = pyplot("the plot")
    traffics = _traffics(outcome.baseline.levels)
    fig, axes = plt.subplots(1, len(traffics), figsize=(6 + 3 * len(traffics), 4), squeeze=False)
    measured = [(outcome.baseline, measured_bands(outcome.baselines, slo, outcome.noise)),
                *((m, {p.point: p.candidate for p in v.points}) for m, v in outcome.measured)]
    for axis, traffic in zip(axes[0], traffics, strict=True):
        for m, bands in measured:
            by = {conc: band for (shape, conc), band in bands.items() if shape == traffic}
            levels = sorted(by)
            line, = axis.plot(levels, [by[c].value for c in levels], marker="o",
                              linewidth=2.5 if m is outcome.winner else 1, label=m.candidate.name[:40])
            axis.fill_between(levels, [by[c].low for c in levels], [by[c].high for c in levels],
                              color=line.get_color(), alpha=0.15)
        axis.set(xscale="log", xlabel="concurrency", ylabel=f"goodput (requests/s at the SLO, {CONFIDENCE:.0%} band)",
                 title=f"kimi-service tune {traffic}".rstrip())
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
