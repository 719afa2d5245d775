"""`kimi-service tune`'s statistics: what one engine start measured, each point's goodput band, and the
verdict of a candidate against the baseline's runs.

A point is a (request shape, concurrency) level of a sweep. Its goodput band comes from a bootstrap over the
level's requests; the baseline's runs are pooled, and the noise between them beyond their requests' own
widens every band. A candidate wins at a point when its band lies wholly above the baseline's, loses when
its band lies wholly below `FLOOR` x the baseline's, and is the same otherwise. The bands of all points hold
together (Bonferroni), so the more points a sweep has, the wider each band.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from kimi_service.bench import Slo

FLOOR = 0.98  # a candidate whose goodput band lies wholly below this share of the baseline's band loses there
CONFIDENCE = 0.95  # each point's band: the central 95% of its bootstrap distribution
RESAMPLES = 1000

Point = tuple[str, int]  # (the request shape's label, "" for a workload of one shape; concurrency)


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]
    why: str  # what the change is expected to buy
    step: float | None = None  # if it wins: the next value to try is its number times this
    run: int = 0  # the same flags measured again: the baseline's later runs, a verification
    replaces_plan: bool = False  # the plan's memory and correctness flags alone, then these (vLLM's defaults)
    held_back: str | None = None  # why it is measured and reported but never applied, even when it wins

    @property
    def key(self) -> str:
        material = (json.dumps(self.flags) + (f"#{self.run}" if self.run else "")
                    + ("#defaults" if self.replaces_plan else ""))
        return hashlib.sha256(material.encode()).hexdigest()[:12]

    def next_value(self) -> Candidate | None:
        """The same flag one step further (a winning `--max-num-seqs 128` -> 256), or None."""
        if self.step is None or len(self.flags) != 2 or not self.flags[1].isdigit():
            return None
        value = round(int(self.flags[1]) * self.step)
        if value < 1 or value == int(self.flags[1]):
            return None
        return Candidate(f"{self.flags[0].removeprefix('--')} {value}", (self.flags[0], str(value)),
                         f"the next value after {self.flags[1]} won", self.step)


@dataclass
class Measurement:
    candidate: Candidate
    levels: list[dict[str, Any]]
    start_s: float  # from spawning the engine until it answered
    total_s: float  # start, sweep and stop: what the next candidate will likely cost
    error: str | None = None


@dataclass(frozen=True)
class Band:
    """A point's goodput (requests/s in the SLO) with its bootstrap interval."""

    value: float
    low: float
    high: float
    duration_s: float  # the seconds measured: half a request more of goodput is 0.5 / this

    def said(self) -> str:
        return f"{self.value:.2f} [{self.low:.2f}, {self.high:.2f}]"


@dataclass(frozen=True)
class PointVerdict:
    point: Point
    baseline: Band
    candidate: Band
    decision: str  # "wins", "same" or "loses"


@dataclass(frozen=True)
class Verdict:
    decision: str  # "wins" (applied if the best), "same" (within the noise: not applied) or "loses"
    score: float  # geometric mean over the points of goodput over the baseline's
    reason: str
    points: tuple[PointVerdict, ...] = ()

    @property
    def wins(self) -> bool:
        return self.decision == "wins"


def level_map(levels: Sequence[dict[str, Any]]) -> dict[Point, dict[str, Any]]:
    """A measurement's levels by (request shape, concurrency)."""
    return {(level.get("traffic", ""), level["concurrency"]): level for level in levels}


def point_said(point: Point) -> str:
    traffic, conc = point
    return f"concurrency {conc}" + (f" of {traffic}" if traffic else "")


def _binomial_cdf(n: int, p: float) -> list[float]:
    if p <= 0 or p >= 1:
        return [float(p <= 0)] * n + [1.0]  # every resample has none, or all, in the SLO
    log_pmf = [math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(p)
               + (n - k) * math.log1p(-p) for k in range(n + 1)]
    cdf, total = [], 0.0
    for value in log_pmf:
        total += math.exp(value)
        cdf.append(total)
    return cdf


# Standard normal deviates as a table of quantiles: one lookup per resample, where random.gauss would
# double the bootstrap's cost.
_NORMAL = [NormalDist().inv_cdf((i + 0.5) / 4096) for i in range(4096)]


def goodput_band(level: dict[str, Any], slo: Slo, seed: int) -> Band:
    """One run of one point: its goodput and a bootstrap over its requests.

    A resample draws as many requests as were sent from those measured, with replacement: how many met
    the SLO (binomial, drawn exactly from its distribution function) and, given that, the summed latency
    of all of them (by its normal limit: pure Python affords 1,000 resamples a point this way, not by
    drawing each request). A closed loop's duration scales with its requests' summed latency."""
    outcomes, duration = level["outcomes"], level["duration_s"]
    met = [slo.met_by_outcome(outcome) for outcome in outcomes]
    good = [o["e2e"] for o, ok in zip(outcomes, met, strict=True) if ok]
    bad = [o["e2e"] for o, ok in zip(outcomes, met, strict=True) if not ok]
    count, value = len(outcomes), len(good) / duration
    latency = sum(good) + sum(bad)
    if not count or latency <= 0:
        return Band(value, value, value, duration)
    (good_mean, good_var, good_min), (bad_mean, bad_var, bad_min) = _moments(good), _moments(bad)
    # Indexed by how many of the resampled requests met the SLO: their summed latency's mean, spread, floor.
    means = [k * good_mean + (count - k) * bad_mean for k in range(count + 1)]
    spreads = [math.sqrt(k * good_var + (count - k) * bad_var) for k in range(count + 1)]
    floors = [k * good_min + (count - k) * bad_min for k in range(count + 1)]
    cdf = _binomial_cdf(count, len(good) / count)
    rng = random.Random(seed)
    uniform, table = rng.random, len(_NORMAL)
    draws = []
    for _ in range(RESAMPLES):
        k = min(bisect.bisect_left(cdf, uniform()), count)
        resampled = max(means[k] + spreads[k] * _NORMAL[int(uniform() * table)], floors[k])
        draws.append(k * latency / (duration * resampled) if resampled > 0 else 0.0)
    draws.sort()
    tail = (1 - CONFIDENCE) / 2
    low, high = draws[int(tail * RESAMPLES)], draws[min(RESAMPLES - 1, int((1 - tail) * RESAMPLES))]
    return Band(value, min(low, value), max(high, value), duration)


def _moments(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean, variance and least of some latencies (zeros for none)."""
    if not values:
        return 0.0, 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, sum((x - mean) ** 2 for x in values) / len(values), min(values)


_Z = NormalDist().inv_cdf((1 + CONFIDENCE) / 2)


def _smoothed(value: float, band: Band) -> float:
    """Half a request more: a goodput of 0 still has a logarithm."""
    return value + 0.5 / band.duration_s


def _log_sd(band: Band) -> float:
    """A band's spread as the standard deviation of log goodput it implies."""
    return math.log(_smoothed(band.high, band) / _smoothed(band.low, band)) / (2 * _Z)


def joint_z(points: int) -> float:
    """The normal deviate that makes `points` bands hold together at CONFIDENCE (Bonferroni): with many
    points, some 95% band would miss by chance in most runs, and one miss is enough to call a win."""
    return NormalDist().inv_cdf(1 - (1 - CONFIDENCE) / (2 * max(points, 1)))


def _band(value: float, duration_s: float, log_sd: float, z: float) -> Band:
    plus = value + 0.5 / duration_s
    return Band(value, max(0.0, plus * math.exp(-z * log_sd) - 0.5 / duration_s),
                plus * math.exp(z * log_sd) - 0.5 / duration_s, duration_s)


def run_bands(run: Measurement, slo: Slo) -> dict[Point, Band]:
    """Each point's bootstrap band in one run."""
    return {point: goodput_band(level, slo, zlib.crc32(f"{run.candidate.key}|{point}".encode()))
            for point, level in sorted(level_map(run.levels).items())}


def run_noise(runs: Sequence[dict[Point, Band]]) -> float:
    """How far runs of the same flags differ beyond what their requests explain: the standard deviation of
    log goodput between runs, less the bootstrap's own share, pooled over the points (from the plan's
    runs; 0 with one run). One engine start to the next varies (clocks, placement, drift) and a candidate
    measured once carries that too."""
    if len(runs) < 2:
        return 0.0
    excess = []
    for point in runs[0]:
        bands = [by[point] for by in runs]
        logs = [math.log(_smoothed(b.value, b)) for b in bands]
        mean = sum(logs) / len(logs)
        between = sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)
        excess.append(between - sum(_log_sd(b) ** 2 for b in bands) / len(bands))
    return math.sqrt(max(0.0, sum(excess) / len(excess)))


def pooled(runs: Sequence[dict[Point, Band]], noise: float) -> dict[Point, Band]:
    """Each point's band over one or more runs of one flag set, run-to-run noise included: goodput over
    all their requests, its spread that of the mean of the runs, the bands jointly at CONFIDENCE."""
    found, z = {}, joint_z(len(runs[0]))
    for point in runs[0]:
        bands = [by[point] for by in runs]
        duration = sum(b.duration_s for b in bands)
        spread = math.sqrt(sum(_log_sd(b) ** 2 + noise ** 2 for b in bands)) / len(bands)
        found[point] = _band(sum(b.value * b.duration_s for b in bands) / duration, duration, spread, z)
    return found


def measured_bands(runs: Sequence[Measurement], slo: Slo, noise: float) -> dict[Point, Band]:
    """The bands of one flag set's runs as the verdicts use them."""
    return pooled([run_bands(run, slo) for run in runs], noise)


def decide(baseline: Band, candidate: Band, floor: float = FLOOR) -> str:
    """Wins where the candidate's band lies wholly above the baseline's, loses where it lies wholly below
    `floor` times it; anything else is the same, as far as this measurement can tell."""
    if candidate.low > baseline.high:
        return "wins"
    if candidate.high < floor * baseline.low:
        return "loses"
    return "same"


def goodput_ratio(baseline: Band, candidate: Band) -> float:
    """Goodput over the baseline's with half a request added to each side: where the baseline met the SLO
    with no request, a candidate that brings some into it still counts as a gain; where neither met it,
    the ratio is that of the durations: their throughput."""
    return (candidate.value + 0.5 / candidate.duration_s) / (baseline.value + 0.5 / baseline.duration_s)


def judge(baseline: Sequence[Measurement], candidate: Measurement, slo: Slo, floor: float = FLOOR) -> Verdict:
    """Whether `candidate` beats the baseline's runs somewhere and loses nowhere (see `decide`)."""
    if candidate.error:
        return Verdict("loses", 0.0, f"did not run: {candidate.error}")
    base, cand = level_map(baseline[0].levels), level_map(candidate.levels)
    if set(base) != set(cand):
        return Verdict("loses", 0.0, "measured other concurrency levels or request shapes than the baseline")
    for point in sorted(cand):
        if cand[point]["errors"]:
            return Verdict("loses", 0.0, f"{cand[point]['errors']} failed request(s) at {point_said(point)}")
    baseline_runs = [run_bands(run, slo) for run in baseline]
    noise = run_noise(baseline_runs)
    base_bands, cand_bands = pooled(baseline_runs, noise), pooled([run_bands(candidate, slo)], noise)
    points = tuple(PointVerdict(point, base_bands[point], cand_bands[point],
                                decide(base_bands[point], cand_bands[point], floor)) for point in sorted(base))
    ratios = {p.point: goodput_ratio(p.baseline, p.candidate) for p in points}
    score = math.prod(ratios.values()) ** (1 / len(ratios)) if ratios else 0.0

    def said(p: PointVerdict) -> str:
        return (f"{ratios[p.point]:.2f}x at {point_said(p.point)} (goodput {p.candidate.said()} against the "
                f"baseline's {p.baseline.said()})")

    losses = [p for p in points if p.decision == "loses"]
    if losses:
        worst = min(losses, key=lambda p: ratios[p.point])
        return Verdict("loses", score, f"below {floor}x the baseline's band: {said(worst)}", points)
    best = max(points, key=lambda p: ratios[p.point])
    wins = [p for p in points if p.decision == "wins"]
    if wins:
        return Verdict("wins", score, f"above the baseline's band at {len(wins)} of {len(points)} points, "
                       f"{score:.2f}x its goodput over all: {said(max(wins, key=lambda p: ratios[p.point]))}",
                       points)
    return Verdict("same", score, f"within the noise at every point, {score:.2f}x over all: best {said(best)}",
                   points)


def precision_said(baseline: Measurement, slo: Slo, budget_s: float) -> str:
    """How many requests the plan's sweep sent, what the budget affords, and what that can tell apart."""
    bands = measured_bands([baseline], slo, 0.0)
    counts = dict.fromkeys(f"{level['requests']} at concurrency {level['concurrency']}" for level in baseline.levels)

    def half_width(band: Band) -> float:
        return (band.high - band.low) / 2 / band.value if band.value else math.inf

    widest = max(bands, key=lambda point: half_width(bands[point]))
    affordable = max(0, int(budget_s // max(baseline.total_s, 1e-9)) - 2)
    return (f"requests per level: {', '.join(counts)}; the plan's start and sweep took {baseline.total_s:.0f} s, "
            f"so the budget affords about {affordable} candidate(s) besides the plan's two runs; its goodput is "
            f"known to +-{half_width(bands[widest]):.0%} ({CONFIDENCE:.0%} band) at worst ({point_said(widest)}, "
            f"{bands[widest].said()} requests/s): a candidate must gain about twice that there to show")


@dataclass
class Outcome:
    baselines: list[Measurement]  # the plan's runs: before the candidates and after them
    measured: list[tuple[Measurement, Verdict]]
    skipped: list[tuple[Candidate, str]]
    winner: Measurement  # the plan's first run when nothing won
    reused: int  # measurements read back from an earlier run
    drift: list[str]  # points where the plan's two runs disagreed beyond their bands
    noise: float  # run_noise over the plan's runs

    @property
    def baseline(self) -> Measurement:
        return self.baselines[0]
