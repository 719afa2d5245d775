"""`kimi-service tune`: choose vLLM's speed flags by measuring them on this host, never applying one that lost.

The plan alone sets what memory and correctness need and leaves speed to vLLM's defaults (planner/gpu.py).
Tuning starts the engine once per candidate flag set, sweeps it with the operator's workload (`bench`'s
closed loop at each concurrency, its exact-length prompts, for each request shape of a mix) and stops it:

1. the plan as it is, the baseline;
2. the plan plus one speed change each (the workload's trial values, smaller prefill chunks where long
   prompts meet an ITL objective, CUDA graphs captured only up to the workload's concurrency, a batch cap
   at it, larger prefill chunks for long prompts, async scheduling where the engine does not default to it,
   FP8 KV where the GPU has it and the cache is what bounds the workload, the catalog's draft model when
   its weights are on the host, or the operator's own `--candidate` sets), likeliest first, since the
   budget may end the list;
3. every single change that won, together (of two values of one flag, the better one's).

A candidate wins only when it is at least `floor` (0.98) x the baseline in output tokens/s and in goodput at
every concurrency of every request shape, with no failed request, and beats the baseline's goodput (the
geometric mean of the per-level ratios, each side given half a request more, so that a level where the
baseline met the SLO with no request still counts) by more than the noise margin. The best winner is written
to `tuned.json` in the state directory with each flag's measured reason; serve adds those flags to the plan
while the file was measured for the same model, engine, GPUs, workload, traffic and operator flags, and
ignores it otherwise. Each measurement is kept as it finishes, so an interrupted or over-budget run resumes
where it stopped; the engine's compile caches are the service's own, so the winner's first start as a service
reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kimi_service import bench, catalog
from kimi_service.config import Config
from kimi_service.engine_flags import check_extra_args, option_name
from kimi_service.errors import KimiError, UsageError
from kimi_service.files import write_atomic
from kimi_service.planner.budget import DEFAULT_BATCHED_TOKENS
from kimi_service.plots import pyplot
from kimi_service.tuned import TUNED_FILE, Workload, configuration_key, read_tuned
from kimi_service.workloads import PROFILES

FLOOR = 0.98  # a candidate below this share of the baseline at any point loses
NOISE = 0.02  # and must beat the baseline's summed goodput by more than this to win
START_TIMEOUT_S = 1800.0
SHORT_PREFILL_TOKENS = 2048  # prefill chunks that keep decode steps short; prompts longer than this are long
LONG_PREFILL_TOKENS = 16384  # and chunks that prefill them in fewer, larger steps
# vLLM 0.21 logs "Asynchronous scheduling is enabled" with no flag given: the candidate would be the
# baseline measured again.
ASYNC_SCHEDULING_DEFAULT_SINCE = (0, 21)


@dataclass(frozen=True)
class Candidate:
    name: str
    flags: tuple[str, ...]
    why: str  # what the change is expected to buy

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.flags).encode()).hexdigest()[:12]


@dataclass
class Measurement:
    candidate: Candidate
    levels: list[dict[str, Any]]
    start_s: float  # from spawning the engine until it answered
    total_s: float  # start, sweep and stop: what the next candidate will likely cost
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    wins: bool
    score: float  # summed goodput (or tokens/s) over the baseline's
    reason: str


def parse_duration(text: str) -> float:
    """`20m`, `1h`, `90s` or plain seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not found:
        raise UsageError(f"--budget: expected a duration like 20m, 1h or 900s, got {text!r}")
    value = float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]
    if value <= 0:
        raise UsageError("--budget must be positive")
    return value


Point = tuple[str, int]  # (the request shape's label, "" for a workload of one shape; concurrency)


def level_map(levels: Sequence[dict[str, Any]]) -> dict[Point, dict[str, Any]]:
    """A measurement's levels by (request shape, concurrency)."""
    return {(level.get("traffic", ""), level["concurrency"]): level for level in levels}


def _said(point: Point) -> str:
    traffic, conc = point
    return f"concurrency {conc}" + (f" of {traffic}" if traffic else "")


def judge(baseline: Measurement, candidate: Measurement, floor: float = FLOOR, noise: float = NOISE) -> Verdict:
    """Whether `candidate` beats `baseline` without losing anywhere (see the module docstring)."""
    if candidate.error:
        return Verdict(False, 0.0, f"did not run: {candidate.error}")
    base, cand = level_map(baseline.levels), level_map(candidate.levels)
    if set(base) != set(cand):
        return Verdict(False, 0.0, "measured other concurrency levels or request shapes than the baseline")
    worst: tuple[float, str] | None = None
    for point in sorted(base):
        b, c = base[point], cand[point]
        if c["errors"]:
            return Verdict(False, 0.0, f"{c['errors']} failed request(s) at {_said(point)}")
        for name, label in (("output_tokens_per_s", "output tokens/s"), ("goodput_requests_per_s", "goodput")):
            if b[name] > 0 and (worst is None or c[name] / b[name] < worst[0]):
                worst = (c[name] / b[name], f"{label} {c[name] / b[name]:.2f}x the baseline at {_said(point)}")
    if worst is not None and worst[0] < floor:
        return Verdict(False, worst[0], worst[1])
    # Each level counts alike (a sum would be the highest concurrency's alone): the geometric mean of the
    # per-level goodput ratios.
    ratios = {point: goodput_ratio(base[point], cand[point]) for point in sorted(base)}
    score = math.prod(ratios.values()) ** (1 / len(ratios)) if ratios else 0.0
    best = max(sorted(ratios), key=ratios.__getitem__)
    detail = (f"{score:.2f}x the baseline's goodput (geometric mean over the levels), {ratios[best]:.2f}x at "
              f"{_said(best)} ({_goodput_said(base[best])} -> {_goodput_said(cand[best])})")
    if score <= 1 + noise:
        return Verdict(False, score, f"no better than the baseline: {detail}")
    return Verdict(True, score, detail)


def goodput_ratio(base: dict[str, Any], cand: dict[str, Any]) -> float:
    """Goodput over the baseline's with half a request added to each side. Where the baseline met the SLO
    with no request, a candidate that brings some into it still counts as a gain (a plain ratio would be
    undefined); where neither met it, the ratio is that of the same requests' durations: their throughput."""
    def smoothed(level: dict[str, Any]) -> float:
        return level["goodput_requests_per_s"] + 0.5 / level["duration_s"]

    return smoothed(cand) / smoothed(base)


def _goodput_said(level: dict[str, Any]) -> str:
    good = round(level["goodput_requests_per_s"] * level["duration_s"])
    return f"{good} of {level['requests']} requests in the SLO"


def _version(text: str | None) -> tuple[int, ...]:
    """`0.21.0` -> (0, 21): major and minor; unknown or unparsable reads as the newest."""
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else (10**6,)


def trial_candidates(
    plan: dict[str, Any], workload: Workload, *, gpu_fp8: bool = False, draft: catalog.Speculative | None = None,
    draft_dir: Path | None = None,
) -> list[Candidate]:
    """The single changes worth measuring for this plan and workload; none that the plan already sets.
    `draft` is the catalog's draft model for this model, `draft_dir` where its weights are on this host."""
    argv = plan.get("argv") or []
    has = {option_name(token) for token in argv if token.startswith("-")}
    profile = PROFILES.get(plan.get("workload") or "chat", PROFILES["chat"])
    top = max(workload.concurrency)
    longest_prompt = max(shape.input_len + shape.shared_prefix_len for shape in workload.shapes)
    longest = max(shape.input_len + shape.shared_prefix_len + shape.output_len for shape in workload.shapes)
    found: list[Candidate] = []

    def add(name: str, flags: tuple[str, ...], why: str) -> None:
        if option_name(flags[0]) not in has and all(c.flags != flags for c in found):
            found.append(Candidate(name, flags, why))

    if profile.trial_max_num_seqs:
        add("max-num-seqs", ("--max-num-seqs", str(profile.trial_max_num_seqs)),
            f"the {profile.name} workload's batch size ({profile.why})")
    if profile.trial_batched_tokens:
        add("max-num-batched-tokens", ("--max-num-batched-tokens", str(profile.trial_batched_tokens)),
            f"the {profile.name} workload's prefill chunk ({profile.why})")
    if workload.slo.itl and top > 1 and longest_prompt > SHORT_PREFILL_TOKENS:
        # A decode step that shares its batch with a full default chunk of someone's prompt takes as long
        # as that prefill; with many clients and long prompts that is most steps, and each can break the ITL
        # objective. Smaller chunks keep steps short at some cost in time to first token.
        add("short-prefill-chunks", ("--max-num-batched-tokens", str(SHORT_PREFILL_TOKENS)),
            f"prompts of up to {longest_prompt:,} tokens prefilled {SHORT_PREFILL_TOKENS:,} at a time (vLLM's "
            f"default chunk is {DEFAULT_BATCHED_TOKENS:,}): decode steps that share a batch with a prefill stay "
            f"short, for the SLO's ITL <= {workload.slo.itl} s")
    if plan.get("engine") == "cuda" and top < 512:
        add("cuda-graphs-to-load", ("--max-cudagraph-capture-size", str(max(top, 8))),
            f"CUDA graphs captured only up to the {top} clients: a faster start, more KV cache")
    add("max-num-seqs-at-load", ("--max-num-seqs", str(max(top, 8))),
        f"batches no larger than the {top} clients: smaller activation reserve, more KV cache")
    if longest_prompt >= SHORT_PREFILL_TOKENS:
        add("long-prefill-chunks", ("--max-num-batched-tokens", str(LONG_PREFILL_TOKENS)),
            "long prompts: fewer, larger prefill chunks")
    if plan.get("engine") == "cuda":
        if _version(plan.get("vllm_version")) < ASYNC_SCHEDULING_DEFAULT_SINCE:
            add("async-scheduling", ("--async-scheduling",), "schedules the next step while the GPU runs this one")
        if gpu_fp8 and plan.get("kv_cache_dtype") in (None, "auto") and \
                plan.get("kv_cache_tokens", 0) < top * longest * 2:
            add("fp8-kv-cache", ("--kv-cache-dtype", "fp8"),
                "the KV cache bounds this workload: FP8 halves its bytes per token")
    if draft and draft_dir is not None and plan.get("pipeline_parallel_size", 1) == 1:
        config = {"model": str(draft_dir), "method": draft.method,
                  "num_speculative_tokens": draft.num_speculative_tokens}
        add("speculative", ("--speculative-config", json.dumps(config, separators=(",", ":"))),
            f"{draft.method} draft {draft.model} ({draft.source})")
    return found


def operator_candidates(specs: Sequence[str]) -> list[Candidate]:
    """`--candidate "--max-num-seqs 64"`: each a flag set the operator wants measured."""
    found = []
    for spec in specs:
        flags = tuple(spec.split())
        if not flags or not flags[0].startswith("--"):
            raise UsageError(f"--candidate: expected vLLM flags like '--max-num-seqs 64', got {spec!r}")
        try:
            check_extra_args(flags, "--candidate")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        found.append(Candidate(" ".join(flags), flags, "asked for by the operator"))
    return found


class Store:
    """One JSON file per measured candidate under DIR/KEY/, written as each finishes (resume reads them)."""

    def __init__(self, directory: Path, key: str):
        # Made when the first measurement is saved: `tune --status` runs as root and must leave nothing
        # that the service user's `tune` could not write into.
        self.directory = directory / key

    def load(self, candidate: Candidate) -> Measurement | None:
        path = self.directory / f"{candidate.key}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return Measurement(candidate=candidate, levels=data["levels"], start_s=data["start_s"],
                           total_s=data["total_s"], error=data.get("error"))

    def save(self, measurement: Measurement) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = {**asdict(measurement), "candidate": asdict(measurement.candidate)}
        write_atomic(self.directory / f"{measurement.candidate.key}.json", json.dumps(data, indent=2) + "\n",
                     mode=0o644)


Measure = Callable[[Candidate], Measurement]


@dataclass
class Outcome:
    baseline: Measurement
    measured: list[tuple[Measurement, Verdict]]
    skipped: list[tuple[Candidate, str]]
    winner: Measurement  # the baseline when nothing won
    reused: int  # measurements read back from an earlier run


def search(singles: Sequence[Candidate], measure: Measure, store: Store, budget_s: float,
           log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic) -> Outcome:
    """Baseline, each single change, then the winners together; within the budget, resumable."""
    started = clock()
    reused = 0

    def run(candidate: Candidate) -> Measurement:
        nonlocal reused
        earlier = store.load(candidate)
        if earlier is not None:
            reused += 1
            log(f"{candidate.name}: measured earlier ({earlier.total_s:.0f} s then), not measured again")
            return earlier
        log(f"{candidate.name}: starting the engine with {' '.join(candidate.flags) or 'the plan alone'}")
        result = measure(candidate)
        store.save(result)
        return result

    baseline = run(Candidate("plan", (), "the plan alone: vLLM's defaults for speed"))
    if baseline.error:
        raise KimiError(f"the plan's own engine did not serve the workload ({baseline.error}): nothing to "
                        "compare candidates with; fix that first (kimi-service serve --check, the engine log)")
    measured: list[tuple[Measurement, Verdict]] = []
    skipped: list[tuple[Candidate, str]] = []

    def within_budget(candidate: Candidate) -> bool:
        spent = clock() - started
        cost = max([baseline.total_s, *(m.total_s for m, _ in measured)])
        if store.load(candidate) is None and spent + cost > budget_s:
            skipped.append((candidate, f"budget: {spent:.0f} s of {budget_s:.0f} s spent, a candidate takes "
                                       f"about {cost:.0f} s"))
            log(f"{candidate.name}: skipped, {skipped[-1][1]}")
            return False
        return True

    for candidate in singles:
        if within_budget(candidate):
            result = run(candidate)
            measured.append((result, judge(baseline, result)))
            log(f"{candidate.name}: {'wins' if measured[-1][1].wins else 'loses'} ({measured[-1][1].reason})")
    winners = _one_per_option([m for m, v in sorted(measured, key=lambda pair: -pair[1].score) if v.wins])
    if len(winners) > 1:
        flags = tuple(flag for m in winners for flag in m.candidate.flags)
        combined = Candidate(" + ".join(m.candidate.name for m in winners), flags,
                             "every single change that won, together (of two values of one flag, the better)")
        if within_budget(combined):
            result = run(combined)
            measured.append((result, judge(baseline, result)))
            log(f"{combined.name}: {'wins' if measured[-1][1].wins else 'loses'} ({measured[-1][1].reason})")
    best = max(((m, v) for m, v in measured if v.wins), key=lambda pair: pair[1].score, default=None)
    return Outcome(baseline, measured, skipped, best[0] if best else baseline, reused)


def clock_label(seconds: float) -> str:
    """mm:ss, rounded once (59.6 s is 01:00, not 00:60)."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes:02d}:{rest:02d}"


def _one_per_option(ranked: Sequence[Measurement]) -> list[Measurement]:
    """Of winners that set the same option to other values, the first (the best ranked)."""
    kept: list[Measurement] = []
    taken: set[str] = set()
    for measurement in ranked:
        options = {option_name(token) for token in measurement.candidate.flags if token.startswith("-")}
        if not options & taken:
            kept.append(measurement)
            taken |= options
    return kept


def tuned_document(outcome: Outcome, key: str, workload: Workload) -> dict[str, Any]:
    """tuned.json: the winner's flags, why each is there (measured), and every candidate's verdict."""
    winner = outcome.winner
    verdicts = {m.candidate.name: v for m, v in outcome.measured}
    reasons = {}
    if winner is not outcome.baseline:
        reason = verdicts[winner.candidate.name].reason
        for token in winner.candidate.flags:
            if token.startswith("--"):
                reasons[token] = f"measured by kimi-service tune on this host ({workload.describe()}): {reason}"
    return {
        "key": key,
        "flags": list(winner.candidate.flags),
        "reasons": reasons,
        "winner": winner.candidate.name if winner is not outcome.baseline else "plan",
        "workload": asdict(workload),
        "candidates": [{"name": m.candidate.name, "flags": list(m.candidate.flags), "wins": v.wins,
                        "score": round(v.score, 4), "reason": v.reason, "start_s": round(m.start_s, 1)}
                       for m, v in outcome.measured],
        "skipped": [{"name": c.name, "flags": list(c.flags), "reason": why} for c, why in outcome.skipped],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _traffics(levels: Sequence[dict[str, Any]]) -> list[str]:
    """The request shapes' labels in the order they were measured ("" alone for a workload of one shape)."""
    return list(dict.fromkeys(level.get("traffic", "") for level in levels))


def format_table(outcome: Outcome) -> str:
    traffics = _traffics(outcome.baseline.levels)
    levels = sorted({conc for _, conc in level_map(outcome.baseline.levels)})
    width = max(len("traffic"), *map(len, traffics)) if traffics != [""] else 0
    header = (f"{'candidate':<40} " + (f"{'traffic':<{width}} " if width else "")
              + " ".join(f"{f'c={c} tok/s':>12} {'goodput':>8}" for c in levels) + "  verdict")
    lines = [header, "-" * len(header)]
    for m, verdict in [(outcome.baseline, None), *outcome.measured]:
        by = level_map(m.levels)
        said = "baseline" if verdict is None else ("WINS " if verdict.wins else "loses ") + verdict.reason
        if m is outcome.winner:
            said = "<- applied: " + said
        for row, traffic in enumerate(traffics):
            cells = " ".join(
                f"{by[traffic, c]['output_tokens_per_s']:>12.1f} {by[traffic, c]['goodput_requests_per_s']:>8.2f}"
                if (traffic, c) in by else f"{'-':>12} {'-':>8}" for c in levels)
            name = m.candidate.name[:40] if row == 0 else ""
            lines.append(f"{name:<40} " + (f"{traffic:<{width}} " if width else "") + cells
                         + ("  " + said if row == 0 else ""))
    for candidate, why in outcome.skipped:
        lines.append(f"{candidate.name[:40]:<40} skipped: {why}")
    return "\n".join(lines)


def write_plot(outcome: Outcome, path: Path) -> None:
    plt = pyplot("the plot")
    traffics = _traffics(outcome.baseline.levels)
    fig, axes = plt.subplots(1, len(traffics), figsize=(6 + 3 * len(traffics), 4), squeeze=False)
    for axis, traffic in zip(axes[0], traffics, strict=True):
        for m in [outcome.baseline, *(m for m, _ in outcome.measured)]:
            by = {conc: level for (shape, conc), level in level_map(m.levels).items() if shape == traffic}
            levels = sorted(by)
            axis.plot(levels, [by[c]["goodput_requests_per_s"] for c in levels], marker="o",
                      linewidth=2.5 if m is outcome.winner else 1, label=m.candidate.name[:40])
        axis.set(xscale="log", xlabel="concurrency", ylabel="goodput (requests/s at the SLO)",
                 title=f"kimi-service tune {traffic}".rstrip())
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class EngineRun:
    """One candidate's engine, as serve would start it (the same argv and environment), on the configured
    port with the service stopped; stopped with its whole process group."""

    def __init__(self, config: Config, candidate: Candidate, log_path: Path):
        from kimi_service import launcher

        tried = replace(config, plan=replace(config.plan, extra_args=(*config.plan.extra_args, *candidate.flags)))
        self.launch = launcher.prepare(tried, apply_tuned=False)
        self.config, self.log_path = config, log_path

    def __enter__(self) -> EngineRun:
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(self.launch.argv, env=self.launch.env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_serving(self, timeout: float) -> None:
        url = self.config.api.local_url
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=url, timeout=5) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise KimiError(f"the engine exited with {self.process.returncode} before serving "
                                    f"(log: {self.log_path})")
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1)
        raise KimiError(f"the engine did not serve within {timeout:.0f} s (log: {self.log_path})")

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=self.config.serve.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def engine_measure(config: Config, workload: Workload, api_key: str | None, logs: Path) -> Measure:
    """Start the candidate's engine, sweep it with bench, stop it."""

    def measure(candidate: Candidate) -> Measurement:
        started = time.monotonic()
        log_path = logs / f"{candidate.key}.log"
        try:
            with EngineRun(config, candidate, log_path) as engine:
                engine.wait_serving(min(config.serve.startup_timeout, START_TIMEOUT_S))
                start_s = time.monotonic() - started
                levels = []
                for shape in workload.shapes:
                    report = bench.run_bench(bench.BenchSettings(
                        url=config.api.local_url, model=config.model.served_name, api_key=api_key,
                        concurrency=list(workload.concurrency), input_len=shape.input_len,
                        output_len=shape.output_len, prompts=workload.prompts,
                        shared_prefix_len=shape.shared_prefix_len, slo=workload.slo,
                        tokenizer=str(config.model.path),
                    ), progress=False)
                    # One engine start serves every shape of a mix; a lone shape needs no label.
                    label = {"traffic": shape.label} if workload.more_shapes else {}
                    levels += [{**asdict(level), **label} for level in report.levels]
        except KimiError as exc:
            return Measurement(candidate, [], time.monotonic() - started, time.monotonic() - started, str(exc))
        return Measurement(candidate, levels, start_s, time.monotonic() - started)

    return measure


class Session:
    """One `kimi-service tune`: the plan without tuned flags, its configuration key, the candidates."""

    def __init__(self, config: Config, workload: Workload, budget_s: float, candidate_specs: Sequence[str] = ()):
        from kimi_service import launcher
        from kimi_service.model import inspect_model

        self.config, self.workload, self.budget_s = config, workload, budget_s
        self.plan = launcher.prepare(config, apply_tuned=False).plan_document
        self.key = configuration_key(config, workload, vllm_version=self.plan["vllm_version"],
                                     hardware=self.plan["hardware"])
        self.tuned_path = config.paths.state_dir / TUNED_FILE
        self.store = Store(config.paths.state_dir / "tune", self.key)
        if candidate_specs:
            self.singles = operator_candidates(candidate_specs)
        else:
            spec = inspect_model(str(config.model.path))
            entry = catalog.get(spec.catalog_name) if spec.catalog_name else None
            draft = entry.speculative if entry else None
            self.singles = trial_candidates(
                self.plan, workload, gpu_fp8=launcher.discover(config).fp8, draft=draft,
                draft_dir=self._local_model(draft.model) if draft else None)

    def _local_model(self, repo_id: str) -> Path | None:
        """A draft model fetched beside the served one (STATE_DIR/models/REPO@REVISION), if any."""
        found = sorted((self.config.paths.state_dir / "models").glob(f"{repo_id}@*/config.json"))
        return found[0].parent if found else None

    def stale(self) -> str | None:
        """Why tuning would measure (None: tuned.json holds for this configuration and workload)."""
        tuned = read_tuned(self.tuned_path)
        if tuned is None:
            return f"{self.tuned_path}: none yet"
        if tuned.get("key") != self.key:
            return f"{self.tuned_path}: measured for another model, engine, GPUs, workload or extra_args"
        return None

    def run(self, api_key: str | None) -> Outcome:
        started = time.monotonic()

        def log(message: str) -> None:
            print(f"[{clock_label(time.monotonic() - started)} of {self.budget_s / 60:.0f} min] {message}",
                  file=sys.stderr, flush=True)

        log(f"tuning for {self.workload.describe()}; {len(self.singles)} candidate(s): "
            + ", ".join(c.name for c in self.singles))
        self.store.directory.mkdir(parents=True, exist_ok=True)  # the engines' logs go there
        outcome = search(self.singles, engine_measure(self.config, self.workload, api_key, self.store.directory),
                         self.store, self.budget_s, log=log)
        document = tuned_document(outcome, self.key, self.workload)
        write_atomic(self.tuned_path, json.dumps(document, indent=2) + "\n", mode=0o644)
        (self.store.directory / "report.txt").write_text(format_table(outcome) + "\n")
        try:
            write_plot(outcome, self.store.directory / "tune.png")
        except KimiError as exc:
            log(f"no plot: {exc}")
        return outcome
