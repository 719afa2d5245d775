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
3. the plan again: its two runs are the baseline, and a drift between them widens its bands;
4. the next value of each winning flag while it keeps winning (a winning `--max-num-seqs 128`: 256), then
   every change that won, together (of two values of one flag, the better one's).

Each level sends at least 64 requests and 4 per client. Each point (request shape, concurrency) gets a
goodput band: a bootstrap over its requests (`goodput_band`), the baseline's pooled over its runs. A
candidate wins at a point when its band lies wholly above the baseline's and loses there when its band lies
wholly below `FLOOR` (0.98) x the baseline's; anything else is the same, as far as the measurement can tell.
It is applied only when it wins somewhere, loses nowhere and failed no request (the best such by the
geometric mean of its goodput ratios). The winner is then measured again between two runs of the plan
(`verify`, also `tune --verify`), and serve applies tuned.json's flags only where that gain held and the
file was measured for the same model, engine, GPUs, workload, traffic and operator flags. Each measurement
is kept as it finishes, so an interrupted or over-budget run resumes where it stopped; the engine's compile
caches are the service's own, so the winner's first start as a service reuses them.
"""

from __future__ import annotations

import json
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
from kimi_service.bench import Slo
from kimi_service.config import Config
from kimi_service.engine_flags import check_extra_args, option_name
from kimi_service.errors import KimiError, UsageError
from kimi_service.files import write_atomic
from kimi_service.http_client import client_for
from kimi_service.planner.budget import DEFAULT_BATCHED_TOKENS
from kimi_service.tune_report import format_table, write_plot
from kimi_service.tune_stats import (
    CONFIDENCE,
    FLOOR,
    RESAMPLES,
    Band,
    Candidate,
    Measurement,
    Outcome,
    Point,
    Verdict,
    decide,
    judge,
    measured_bands,
    point_said,
    precision_said,
    run_bands,
    run_noise,
)
from kimi_service.tuned import TUNED_FILE, Workload, configuration_key, read_tuned
from kimi_service.untrusted import read_json
from kimi_service.workloads import PROFILES

MIN_REQUESTS = 64  # requests per level at least, and at least
REQUESTS_PER_CLIENT = 4  # this many per client: one slow request must not swing a level's goodput far
START_TIMEOUT_S = 1800.0
SHORT_PREFILL_TOKENS = 2048  # prefill chunks that keep decode steps short; prompts longer than this are long
LONG_PREFILL_TOKENS = 16384  # and chunks that prefill them in fewer, larger steps
# vLLM 0.21 logs "Asynchronous scheduling is enabled" with no flag given: the candidate would be the
# baseline measured again.
ASYNC_SCHEDULING_DEFAULT_SINCE = (0, 21)


def parse_duration(text: str) -> float:
    """`20m`, `1h`, `90s` or plain seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not found:
        raise UsageError(f"--budget: expected a duration like 20m, 1h or 900s, got {text!r}")
    value = float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]
    if value <= 0:
        raise UsageError("--budget must be positive")
    return value


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
    step_bound = ("ITL", workload.slo.itl) if workload.slo.itl else ("TPOT", workload.slo.tpot)
    if step_bound[1] and top > 1 and longest_prompt > SHORT_PREFILL_TOKENS:
        # A decode step that shares its batch with a full default chunk of someone's prompt takes as long
        # as that prefill; with many clients and long prompts that is most steps, and each can break an ITL
        # or TPOT objective. Smaller chunks keep steps short at some cost in time to first token.
        add("short-prefill-chunks", ("--max-num-batched-tokens", str(SHORT_PREFILL_TOKENS)),
            f"prompts of up to {longest_prompt:,} tokens prefilled {SHORT_PREFILL_TOKENS:,} at a time (vLLM's "
            f"default chunk is {DEFAULT_BATCHED_TOKENS:,}): decode steps that share a batch with a prefill stay "
            f"short, for the SLO's {step_bound[0]} <= {step_bound[1]} s")
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
            data = read_json(path)
            return Measurement(candidate=candidate, levels=data["levels"], start_s=data["start_s"],
                               total_s=data["total_s"], error=data.get("error"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # not one this store wrote: measured again

    def save(self, measurement: Measurement) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        data = {**asdict(measurement), "candidate": asdict(measurement.candidate)}
        write_atomic(self.directory / f"{measurement.candidate.key}.json", json.dumps(data, indent=2) + "\n",
                     mode=0o644)


Measure = Callable[[Candidate], Measurement]


PLAN = Candidate("plan", (), "the plan alone: vLLM's defaults for speed")


def _drift(baselines: Sequence[Measurement], slo: Slo) -> list[str]:
    if len(baselines) < 2:
        return []
    first, later = run_bands(baselines[0], slo), run_bands(baselines[-1], slo)
    return [f"the plan's goodput moved from {first[point].said()} to {later[point].said()} at {point_said(point)}"
            for point in first if point in later and decide(first[point], later[point], 1.0) != "same"]


def search(singles: Sequence[Candidate], measure: Measure, store: Store, budget_s: float, slo: Slo, *,
           log: Callable[[str], None] = print, clock: Callable[[], float] = time.monotonic) -> Outcome:
    """The plan, each single change, the plan again; then the next values of the winners and the winners
    together: within the budget, resumable."""
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

    baselines = [run(PLAN)]
    if baselines[0].error:
        raise KimiError(f"the plan's own engine did not serve the workload ({baselines[0].error}): nothing to "
                        "compare candidates with; fix that first (kimi-service serve --check, the engine log)")
    log(precision_said(baselines[0], slo, budget_s))
    measured: list[tuple[Measurement, Verdict]] = []
    skipped: list[tuple[Candidate, str]] = []

    def cost() -> float:
        return max([*(b.total_s for b in baselines), *(m.total_s for m, _ in measured)])

    def within_budget(candidate: Candidate, reserve: float = 0.0) -> bool:
        spent = clock() - started
        if store.load(candidate) is None and spent + cost() + reserve > budget_s:
            skipped.append((candidate, f"budget: {spent:.0f} s of {budget_s:.0f} s spent, a candidate takes "
                                       f"about {cost():.0f} s"))
            log(f"{candidate.name}: skipped, {skipped[-1][1]}")
            return False
        return True

    def judged(candidate: Candidate) -> tuple[Measurement, Verdict]:
        result = run(candidate)
        measured.append((result, judge(baselines, result, slo)))
        log(f"{candidate.name}: {measured[-1][1].decision} ({measured[-1][1].reason})")
        return measured[-1]

    # Room is kept for the plan's second run: without it no candidate can be judged.
    singles_run = [run(c) for c in singles if within_budget(c, reserve=cost())]
    if singles_run:
        baselines.append(run(replace(PLAN, name="plan (again)", run=1)))
    drift = _drift(baselines, slo)
    noise = run_noise([run_bands(b, slo) for b in baselines])
    for note in drift:
        log(f"drift: {note}")
    if len(baselines) > 1:
        log(f"run-to-run noise beyond the requests' own, measured on the plan's two runs: {noise:.1%} "
            "(standard deviation of log goodput); every band includes it")
    for result in singles_run:
        measured.append((result, judge(baselines, result, slo)))
        log(f"{result.candidate.name}: {measured[-1][1].decision} ({measured[-1][1].reason})")
    for single, verdict in list(measured):
        best = verdict
        following = single.candidate.next_value() if verdict.wins else None
        while following is not None and within_budget(following):
            _, verdict = judged(following)
            if not (verdict.wins and verdict.score > best.score):
                break
            best, following = verdict, following.next_value()
    winners = _one_per_option([m for m, v in sorted(measured, key=lambda pair: -pair[1].score) if v.wins])
    if len(winners) > 1:
        flags = tuple(flag for m in winners for flag in m.candidate.flags)
        combined = Candidate(" + ".join(m.candidate.name for m in winners), flags,
                             "every single change that won, together (of two values of one flag, the better)")
        if within_budget(combined):
            judged(combined)
    best_pair = max(((m, v) for m, v in measured if v.wins), key=lambda pair: pair[1].score, default=None)
    return Outcome(baselines, measured, skipped, best_pair[0] if best_pair else baselines[0], reused, drift,
                   noise)


@dataclass(frozen=True)
class Verification:
    held: bool
    reason: str
    verdict: Verdict


def verify(flags: Sequence[str], measure: Measure, slo: Slo, before: Measurement | None = None,
           log: Callable[[str], None] = print) -> Verification:
    """The applied flags measured again between two fresh runs of the plan (A/B/A; `before`, a run of the
    plan just measured, stands for the first A): the gain held when they win again."""
    tag = int(time.time())  # fresh measurements, never a stored one read back

    def fresh(candidate: Candidate) -> Measurement:
        log(f"verify: starting the engine with {' '.join(candidate.flags) or 'the plan alone'}")
        return measure(replace(candidate, run=tag))

    first = before or fresh(replace(PLAN, name="plan (verify, before)"))
    applied = fresh(Candidate("applied (verify)", tuple(flags), "tuned.json's flags measured again"))
    after = fresh(replace(PLAN, name="plan (verify, after)"))
    for run in (first, after):
        if run.error:
            return Verification(False, f"the plan did not serve while verifying: {run.error}",
                                Verdict("loses", 0.0, run.error))
    verdict = judge([first, after], applied, slo)
    held = verdict.wins
    said = "the gain held" if held else "the gain did not hold"
    return Verification(held, f"{said} when measured again between two runs of the plan: {verdict.reason}",
                        verdict)


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


def _band_json(point: Point, band: Band, decision: str | None = None) -> dict[str, Any]:
    return {"traffic": point[0], "concurrency": point[1], "goodput": round(band.value, 4),
            "low": round(band.low, 4), "high": round(band.high, 4),
            **({"decision": decision} if decision else {})}


def tuned_document(outcome: Outcome, key: str, workload: Workload) -> dict[str, Any]:
    """tuned.json: the winner's flags, why each is there (measured), every candidate's verdict with its
    bands, and whether the gain held when measured again (None until `verify` ran: serve applies the
    flags only when it held)."""
    winner = outcome.winner
    verdicts = {m.candidate.name: v for m, v in outcome.measured}
    reasons = {}
    if winner is not outcome.baseline:
        reason = verdicts[winner.candidate.name].reason
        for token in winner.candidate.flags:
            if token.startswith("--"):
                reasons[token] = f"measured by kimi-service tune on this host ({workload.describe()}): {reason}"
    baseline = measured_bands(outcome.baselines, workload.slo, outcome.noise)
    return {
        "key": key,
        "flags": list(winner.candidate.flags),
        "reasons": reasons,
        "winner": winner.candidate.name if winner is not outcome.baseline else "plan",
        "gain_held": None,
        "verification": None,
        "workload": asdict(workload),
        "rule": {"confidence": CONFIDENCE, "resamples": RESAMPLES, "floor": FLOOR},
        "baseline": {"runs": len(outcome.baselines), "drift": outcome.drift, "run_noise": round(outcome.noise, 4),
                     "points": [_band_json(point, band) for point, band in baseline.items()]},
        "candidates": [{"name": m.candidate.name, "flags": list(m.candidate.flags), "decision": v.decision,
                        "score": round(v.score, 4), "reason": v.reason, "start_s": round(m.start_s, 1),
                        "points": [_band_json(p.point, p.candidate, p.decision) for p in v.points]}
                       for m, v in outcome.measured],
        "skipped": [{"name": c.name, "flags": list(c.flags), "reason": why} for c, why in outcome.skipped],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


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
        with client_for(url, base_url=url, timeout=5) as client:
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
                        output_len=shape.output_len, prompts=max(workload.prompts, MIN_REQUESTS),
                        requests_per_client=REQUESTS_PER_CLIENT, shared_prefix_len=shape.shared_prefix_len,
                        slo=workload.slo, tokenizer=str(config.model.path),
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
            spec = inspect_model(str(config.model.path), config.model.origin)
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

    def _log(self) -> Callable[[str], None]:
        started = time.monotonic()

        def log(message: str) -> None:
            print(f"[{clock_label(time.monotonic() - started)} of {self.budget_s / 60:.0f} min] {message}",
                  file=sys.stderr, flush=True)

        return log

    def run(self, api_key: str | None) -> Outcome:
        """Search, then verify the winner while the budget lasts; write tuned.json and the report."""
        started, log = time.monotonic(), self._log()
        log(f"tuning for {self.workload.describe()}; {len(self.singles)} candidate(s): "
            + ", ".join(c.name for c in self.singles))
        self.store.directory.mkdir(parents=True, exist_ok=True)  # the engines' logs go there
        measure = engine_measure(self.config, self.workload, api_key, self.store.directory)
        outcome = search(self.singles, measure, self.store, self.budget_s, self.workload.slo, log=log)
        document = tuned_document(outcome, self.key, self.workload)
        cost = max(m.total_s for m in [*outcome.baselines, *(m for m, _ in outcome.measured)])
        if outcome.winner is not outcome.baseline:
            if time.monotonic() - started + 2 * cost <= self.budget_s:
                checked = verify(outcome.winner.candidate.flags, measure, self.workload.slo,
                                 before=outcome.baselines[-1], log=log)
                document.update(gain_held=checked.held, verification=checked.reason)
            else:
                document["verification"] = ("not measured again within the budget: serve applies nothing until "
                                            "kimi-service tune --verify finds the gain held")
            log(document["verification"])
        write_atomic(self.tuned_path, json.dumps(document, indent=2) + "\n", mode=0o644)
        (self.store.directory / "report.txt").write_text(format_table(outcome, self.workload.slo) + "\n")
        try:
            write_plot(outcome, self.store.directory / "tune.png", self.workload.slo)
        except KimiError as exc:
            log(f"no plot: {exc}")
        return outcome

    def verify(self, api_key: str | None) -> dict[str, Any]:
        """`tune --verify`: tuned.json's flags against two fresh runs of the plan (A/B/A); the file records
        whether the gain held, and serve applies the flags only when it did."""
        tuned = read_tuned(self.tuned_path)
        if tuned is None or tuned.get("key") != self.key:
            raise UsageError(f"--verify: {self.stale()}; run kimi-service tune first")
        if not tuned["flags"]:
            raise UsageError(f"--verify: {self.tuned_path} applies nothing (the plan won): nothing to verify")
        self.store.directory.mkdir(parents=True, exist_ok=True)
        checked = verify(tuned["flags"], engine_measure(self.config, self.workload, api_key, self.store.directory),
                         self.workload.slo, log=self._log())
        tuned.update(gain_held=checked.held, verification=checked.reason)
        write_atomic(self.tuned_path, json.dumps(tuned, indent=2) + "\n", mode=0o644)
        return tuned
