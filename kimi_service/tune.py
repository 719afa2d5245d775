"""`kimi-service tune`: choose vLLM's speed flags by measuring them on this host, never applying one that lost.

The plan alone sets what memory and correctness need and leaves speed to vLLM's defaults (planner/gpu.py).
Tuning starts the engine once per candidate flag set, sweeps it with the operator's workload (`bench`'s
closed loop at each concurrency, its exact-length prompts, for each request shape of a mix) and stops it:

1. the plan as it is, the baseline;
2. vLLM's defaults: the plan's memory and correctness flags alone (`tune_candidates.DEFAULTS`), a reference
   row judged like any candidate and never applied;
3. the plan plus one speed change each (`tune_candidates.trial_candidates`, or the operator's own
   `--candidate` sets), likeliest first, since the budget may end the list; a speculative-decoding winner
   is reported and applied only with `--allow-speculative`;
4. the plan again: its two runs are the baseline, and a drift between them widens its bands;
5. the next value of each winning flag while it keeps winning (a winning `--max-num-seqs 128`: 256), then
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
from kimi_service.tune_candidates import (
    DEFAULTS,
    HELD_BACK_SPECULATIVE,
    SPECULATIVE_OPTION,
    defaults_argv,
    trial_candidates,
)
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

MIN_REQUESTS = 64  # requests per level at least, and at least
REQUESTS_PER_CLIENT = 4  # this many per client: one slow request must not swing a level's goodput far
START_TIMEOUT_S = 1800.0


def parse_duration(text: str) -> float:
    """`20m`, `1h`, `90s` or plain seconds."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not found:
        raise UsageError(f"--budget: expected a duration like 20m, 1h or 900s, got {text!r}")
    value = float(found.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[found.group(2)]
    if value <= 0:
        raise UsageError("--budget must be positive")
    return value


def operator_candidates(specs: Sequence[str], allow_speculative: bool = False) -> list[Candidate]:
    """`--candidate "--max-num-seqs 64"`: each a flag set the operator wants measured (one that sets
    --speculative-config applied only with `allow_speculative`, as tune's own)."""
    found = []
    for spec in specs:
        flags = tuple(spec.split())
        if not flags or not flags[0].startswith("--"):
            raise UsageError(f"--candidate: expected vLLM flags like '--max-num-seqs 64', got {spec!r}")
        try:
            check_extra_args(flags, "--candidate")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        speculative = not allow_speculative and SPECULATIVE_OPTION in {option_name(token) for token in flags}
        found.append(Candidate(" ".join(flags), flags, "asked for by the operator",
                               held_back=HELD_BACK_SPECULATIVE if speculative else None))
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
    """The plan, vLLM's defaults, each single change, the plan again; then the next values of the winners and
    the winners together: within the budget, resumable. A held-back candidate is judged, never applied."""
    started = clock()
    reused = 0

    def run(candidate: Candidate) -> Measurement:
        nonlocal reused
        earlier = store.load(candidate)
        if earlier is not None:
            reused += 1
            log(f"{candidate.name}: measured earlier ({earlier.total_s:.0f} s then), not measured again")
            return earlier
        alone = "the plan's memory and correctness flags alone" if candidate.replaces_plan else "the plan alone"
        log(f"{candidate.name}: starting the engine with {' '.join(candidate.flags) or alone}")
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
    singles_run = [run(c) for c in (DEFAULTS, *singles) if within_budget(c, reserve=cost())]
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
        following = single.candidate.next_value() if verdict.wins and not single.candidate.held_back else None
        while following is not None and within_budget(following):
            _, verdict = judged(following)
            if not (verdict.wins and verdict.score > best.score):
                break
            best, following = verdict, following.next_value()
    winners = _one_per_option([m for m, v in sorted(measured, key=lambda pair: -pair[1].score)
                               if v.wins and not m.candidate.held_back])
    if len(winners) > 1:
        flags = tuple(flag for m in winners for flag in m.candidate.flags)
        combined = Candidate(" + ".join(m.candidate.name for m in winners), flags,
                             "every single change that won, together (of two values of one flag, the better)")
        if within_budget(combined):
            judged(combined)
    best_pair = max(((m, v) for m, v in measured if v.wins and not m.candidate.held_back),
                    key=lambda pair: pair[1].score, default=None)
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
                        "points": [_band_json(p.point, p.candidate, p.decision) for p in v.points],
                        **({"held_back": m.candidate.held_back} if m.candidate.held_back else {})}
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
        if candidate.replaces_plan:
            self.launch = replace(self.launch, argv=defaults_argv(self.launch.argv))
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

    def __init__(self, config: Config, workload: Workload, budget_s: float, candidate_specs: Sequence[str] = (),
                 allow_speculative: bool = False):
        from kimi_service import launcher
        from kimi_service.model import inspect_model
        from kimi_service.planner.budget import default_max_num_seqs

        self.config, self.workload, self.budget_s = config, workload, budget_s
        self.plan = launcher.prepare(config, apply_tuned=False).plan_document
        self.key = configuration_key(config, workload, vllm_version=self.plan["vllm_version"],
                                     hardware=self.plan["hardware"])
        self.tuned_path = config.paths.state_dir / TUNED_FILE
        self.store = Store(config.paths.state_dir / "tune", self.key)
        if candidate_specs:
            self.singles = operator_candidates(candidate_specs, allow_speculative)
        else:
            spec = inspect_model(str(config.model.path), config.model.origin)
            entry = catalog.get(spec.catalog_name) if spec.catalog_name else None
            draft = entry.speculative if entry else None
            gpus = launcher.discover(config)
            self.singles = trial_candidates(
                self.plan, workload, gpu_fp8=gpus.fp8, draft=draft,
                draft_dir=self._local_model(draft.model) if draft else None,
                vllm_max_num_seqs=None if gpus.is_cpu else default_max_num_seqs(gpus),
                allow_speculative=allow_speculative)

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
