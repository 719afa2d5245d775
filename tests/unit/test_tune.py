"""The tuner's rules without an engine: the goodput bands and the decision they drive (simulated requests,
seeded), the search, the budget, resume, verification, the key serve checks. tests/engine/test_tune.py
runs the same search against the real CPU engine."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kimi_service import bench, catalog
from kimi_service.config import parse_config
from kimi_service.errors import KimiError, UsageError
from kimi_service.tune import (
    Store,
    clock_label,
    operator_candidates,
    parse_duration,
    search,
    tuned_document,
    verify,
)
from kimi_service.tune_candidates import DEFAULTS, DEFAULTS_KEEP, defaults_argv, trial_candidates
from kimi_service.tune_report import format_table
from kimi_service.tune_stats import Band, Candidate, Measurement, decide, goodput_band, judge
from kimi_service.tuned import Shape, Workload, configuration_key, tuned_flags

SLO = bench.Slo(tpot=0.05)
SHAPES, LEVELS = ("512/128", "8192/256"), (16, 64)


class Engine:
    """Stands for vLLM at the one boundary the statistics need: per-request outcomes. A request's latency
    is lognormal (`request_noise`) around a median that a candidate's true effect divides at each point
    and a whole run's drift multiplies (`run_noise`); it meets the SLO when its TPOT is within the bound
    (4/5 of the bound at the median: about 77% meet it). A closed loop's duration is its summed latency
    over the clients."""

    def __init__(self, seed: int, request_noise: float = 0.3, run_noise: float = 0.02):
        self.rng, self.request_noise, self.run_noise = random.Random(seed), request_noise, run_noise

    def level(self, shape: str, concurrency: int, effect: float = 1.0, errors: int = 0) -> dict:
        drift = self.rng.lognormvariate(0, self.run_noise)
        outcomes = []
        for _ in range(max(64, 4 * concurrency)):
            slow = self.rng.lognormvariate(0, self.request_noise) * drift / effect
            outcomes.append({"ok": True, "ttft": 0.05 * slow, "tpot": 0.04 * slow, "e2e": 5.0 * slow,
                             "max_itl": 0.04 * slow})
        for outcome in outcomes[:errors]:
            outcome["ok"] = False
        duration = sum(o["e2e"] for o in outcomes) / concurrency
        return {"traffic": shape, "concurrency": concurrency, "requests": len(outcomes), "errors": errors,
                "duration_s": duration, "output_tokens_per_s": 128 * len(outcomes) / duration,
                "goodput_requests_per_s": sum(SLO.met_by_outcome(o) for o in outcomes) / duration,
                "outcomes": outcomes}

    def run(self, candidate: Candidate, effects: dict | None = None, errors: int = 0) -> Measurement:
        effects = effects or {}
        return Measurement(candidate, [self.level(s, c, effects.get((s, c), 1.0), errors)
                                       for s in SHAPES for c in LEVELS], 10.0, 30.0)


PLAN, AGAIN = Candidate("plan", (), ""), Candidate("plan (again)", (), "", run=1)
X = Candidate("x", ("--x",), "")


def decisions(effects: dict, runs: int = 100) -> Counter:
    """How the decision falls over seeded runs: the plan, the candidate, the plan again."""
    found = Counter()
    for seed in range(runs):
        engine = Engine(seed)
        first, candidate, again = engine.run(PLAN), engine.run(X, effects), engine.run(AGAIN)
        found[judge([first, again], candidate, SLO).decision] += 1
    return found


def test_two_identical_configurations_are_the_same_in_at_least_95_of_100_runs():
    found = decisions({})
    assert found["same"] >= 95, found


def test_a_true_gain_of_1_3x_on_one_shape_wins_in_at_least_90_of_100_runs():
    found = decisions({("8192/256", c): 1.3 for c in LEVELS})
    assert found["wins"] >= 90, found


def test_a_true_loss_of_10_percent_at_one_point_is_applied_in_none_of_100_runs():
    found = decisions({("512/128", 16): 0.9})
    assert found["wins"] == 0, found


def test_a_band_covers_its_point_and_narrows_with_more_requests():
    engine = Engine(1)
    few, many = engine.level("512/128", 1), engine.level("512/128", 64)
    narrow, wide = goodput_band(many, SLO, seed=0), goodput_band(few, SLO, seed=0)
    for band in (narrow, wide):
        assert band.low < band.value < band.high
    assert (narrow.high - narrow.low) / narrow.value < (wide.high - wide.low) / wide.value
    assert goodput_band(many, SLO, seed=0) == narrow  # seeded: the same requests give the same band


def test_the_rule_wins_only_above_the_band_and_loses_only_below_the_floor_of_it():

    base = Band(10.0, 9.0, 11.0, 10.0)
    assert decide(base, Band(12.0, 11.1, 13.0, 10.0)) == "wins"
    assert decide(base, Band(12.0, 10.9, 13.0, 10.0)) == "same"
    assert decide(base, Band(8.0, 7.0, 8.8, 10.0)) == "loses"  # below 0.98 x 9.0 = 8.82
    assert decide(base, Band(8.0, 7.0, 8.85, 10.0)) == "same"


def test_the_noise_the_plan_shows_between_its_runs_widens_every_band():
    quiet = Engine(3, run_noise=0.0)
    first, again = quiet.run(PLAN), quiet.run(AGAIN)
    gain = {(s, c): 1.15 for s in SHAPES for c in LEVELS}
    candidate = quiet.run(X, gain)
    calm = judge([first, again], candidate, SLO)
    # The plan's second run drifted 25% at every point: the same candidate no longer shows a win.
    drifted = Measurement(AGAIN, [{**level, "duration_s": level["duration_s"] * 1.25} for level in again.levels],
                          10.0, 30.0)
    noisy = judge([first, drifted], candidate, SLO)
    widths = [(p.candidate.high - p.candidate.low) for p in calm.points]
    assert all(w < (p.candidate.high - p.candidate.low) for w, p in zip(widths, noisy.points, strict=True))
    assert calm.wins and not noisy.wins


def test_failed_requests_or_a_failed_start_lose():
    engine = Engine(2)
    base = [engine.run(PLAN), engine.run(AGAIN)]
    failed = judge(base, engine.run(X, {(s, c): 2.0 for s in SHAPES for c in LEVELS}, errors=1), SLO)
    assert failed.decision == "loses" and "failed request" in failed.reason
    broken = judge(base, Measurement(X, [], 1, 1, error="exited 1"), SLO)
    assert broken.decision == "loses" and "exited 1" in broken.reason
    partial = Measurement(X, [level for level in engine.run(X).levels if level["traffic"] == "512/128"], 1, 1)
    assert judge(base, partial, SLO).decision == "loses"  # measured without the second shape: not comparable


def test_a_clear_loss_loses_and_the_reason_names_the_point_and_its_bands():
    engine = Engine(4)
    verdict = judge([engine.run(PLAN), engine.run(AGAIN)], engine.run(X, {("8192/256", 64): 0.5}), SLO)
    assert verdict.decision == "loses"
    assert "at concurrency 64 of 8192/256 (goodput" in verdict.reason and "against the baseline's" in verdict.reason


def test_bringing_requests_into_an_slo_the_baseline_met_with_none_wins():
    engine = Engine(5)
    strict = bench.Slo(tpot=0.01)  # no request of the plan's within it
    base = [engine.run(PLAN), engine.run(AGAIN)]
    verdict = judge(base, engine.run(X, {("512/128", 64): 5.0}), strict)
    point = next(p for p in verdict.points if p.point == ("512/128", 64))
    assert point.baseline.value == 0 and point.candidate.value > 0 and verdict.wins


class Bench:
    """Stands for the engine in the search: each candidate's true effects by name; counts the starts."""

    def __init__(self, effects: dict[str, dict], cost: float = 30.0, seed: int = 0):
        self.effects, self.cost, self.started, self.now = effects, cost, [], 0.0
        self.engine = Engine(seed)

    def measure(self, candidate: Candidate) -> Measurement:
        self.started.append(candidate.name)
        self.now += self.cost
        return replace(self.engine.run(candidate, self.effects.get(candidate.name, {})), total_s=self.cost)


def everywhere(by: float) -> dict:
    return {(s, c): by for s in SHAPES for c in LEVELS}


SINGLES = [Candidate("seqs", ("--max-num-seqs", "64"), ""), Candidate("cap", ("--max-num-seqs", "8"), ""),
           Candidate("async", ("--async-scheduling",), "")]
EFFECTS = {"seqs": {("8192/256", 64): 1.6}, "cap": {("512/128", 16): 1.6, ("512/128", 64): 0.4},
           "async": {("512/128", 64): 1.5}, "seqs + async": {("8192/256", 64): 1.6, ("512/128", 64): 1.6}}


def quiet(_: str) -> None:
    pass


def test_search_measures_the_plan_twice_around_the_singles_then_the_winners_together(tmp_path: Path):
    engine = Bench(EFFECTS)
    outcome = search(SINGLES, engine.measure, Store(tmp_path, "k"), 3600, SLO, log=quiet, clock=lambda: engine.now)
    assert engine.started == ["plan", "vllm defaults", "seqs", "cap", "async", "plan (again)", "seqs + async"]
    assert outcome.winner.candidate.flags == ("--max-num-seqs", "64", "--async-scheduling")
    document = tuned_document(outcome, "k", Workload(slo=SLO))
    assert document["flags"] == ["--max-num-seqs", "64", "--async-scheduling"] and document["gain_held"] is None
    assert set(document["reasons"]) == {"--max-num-seqs", "--async-scheduling"}
    assert document["baseline"]["runs"] == 2 and len(document["baseline"]["points"]) == 4
    cap = next(c for c in document["candidates"] if c["name"] == "cap")
    assert cap["decision"] == "loses" and "concurrency 64 of 512/128" in cap["reason"]
    assert all(p["low"] <= p["goodput"] <= p["high"] for p in cap["points"])
    table = format_table(outcome, SLO)
    assert "[" in table.splitlines()[2] and "baseline (goodput pooled over its 2 runs)" in table
    assert "WINS:" in table and "LOSES:" in table and "run-to-run noise" in table


def test_a_winning_value_is_followed_by_the_next_while_it_keeps_winning(tmp_path: Path):
    singles = [Candidate("max-num-seqs 128", ("--max-num-seqs", "128"), "", step=2)]
    engine = Bench({"max-num-seqs 128": everywhere(1.4), "max-num-seqs 256": everywhere(1.8),
                    "max-num-seqs 512": everywhere(1.0)})
    outcome = search(singles, engine.measure, Store(tmp_path, "k"), 3600, SLO, log=quiet, clock=lambda: engine.now)
    assert engine.started == ["plan", "vllm defaults", "max-num-seqs 128", "plan (again)", "max-num-seqs 256",
                              "max-num-seqs 512"]
    assert outcome.winner.candidate.flags == ("--max-num-seqs", "256")


def test_nothing_is_applied_when_nothing_won(tmp_path: Path):
    engine = Bench({"seqs": {("8192/256", 64): 0.8}})
    outcome = search(SINGLES, engine.measure, Store(tmp_path, "k"), 3600, SLO, log=quiet, clock=lambda: engine.now)
    assert outcome.winner is outcome.baseline
    document = tuned_document(outcome, "k", Workload(slo=SLO))
    assert document["flags"] == [] and {c["decision"] for c in document["candidates"]} <= {"same", "loses"}


def test_the_budget_keeps_room_for_the_plans_second_run_and_a_rerun_resumes(tmp_path: Path):
    engine = Bench(EFFECTS, cost=30.0)
    first = search(SINGLES, engine.measure, Store(tmp_path, "k"), 100, SLO, log=quiet, clock=lambda: engine.now)
    # 30 s spent; one more start (30 s, vLLM's defaults) and the plan again (30 s) fit in 100 s; a single
    # would not.
    assert engine.started == ["plan", "vllm defaults", "plan (again)"]
    assert [c.name for c, _ in first.skipped] == ["seqs", "cap", "async"] and "budget" in first.skipped[0][1]
    again = Bench(EFFECTS, cost=30.0)
    second = search(SINGLES, again.measure, Store(tmp_path, "k"), 3600, SLO, log=quiet, clock=lambda: again.now)
    assert again.started == ["seqs", "cap", "async", "seqs + async"]  # the plan's runs and the defaults read back
    assert second.reused == 3 and second.winner.candidate.name == "seqs + async"


def test_verification_measures_the_flags_between_two_fresh_runs_of_the_plan():
    held = Bench({"applied (verify)": everywhere(1.5)})
    result = verify(["--max-num-seqs", "64"], held.measure, SLO, log=quiet)
    assert held.started == ["plan (verify, before)", "applied (verify)", "plan (verify, after)"]
    assert result.held and "the gain held" in result.reason
    gone = Bench({}, seed=7)
    result = verify(["--max-num-seqs", "64"], gone.measure, SLO, log=quiet)
    assert not result.held and "did not hold" in result.reason


def test_looking_at_the_store_creates_nothing(tmp_path: Path):
    store = Store(tmp_path / "tune", "k")
    assert store.load(SINGLES[0]) is None and not (tmp_path / "tune").exists()


def test_a_plan_that_does_not_serve_stops_the_search(tmp_path: Path):
    def broken(candidate: Candidate) -> Measurement:
        return Measurement(candidate, [], 1, 1, error="the engine exited with 1")

    with pytest.raises(KimiError, match="nothing to compare"):
        search(SINGLES, broken, Store(tmp_path, "k"), 3600, SLO, log=quiet)


def test_trial_candidates_follow_the_workload_and_the_gpu():
    plan = {"argv": ["vllm", "serve", "m", "--max-model-len", "8192"], "workload": "latency", "engine": "cuda",
            "kv_cache_dtype": "auto", "kv_cache_tokens": 20_000, "pipeline_parallel_size": 1}
    draft = catalog.get("meta-llama/Llama-3.1-8B-Instruct").speculative
    found = {c.name: c.flags for c in trial_candidates(plan, Workload(), gpu_fp8=True, draft=draft,
                                                       draft_dir=Path("/models/draft"))}
    assert found["max-num-seqs"] == ("--max-num-seqs", "32")
    assert found["max-num-batched-tokens"] == ("--max-num-batched-tokens", "4096")
    assert found["max-num-seqs-at-load"] == ("--max-num-seqs", "64")
    assert found["cuda-graphs-to-load"] == ("--max-cudagraph-capture-size", "64")
    assert found["fp8-kv-cache"] == ("--kv-cache-dtype", "fp8")
    assert json.loads(found["speculative"][1])["model"] == "/models/draft"
    cpu = {c.name for c in trial_candidates({**plan, "engine": "cpu", "argv": [*plan["argv"], "--max-num-seqs", "4"]},
                                            Workload(), gpu_fp8=True, draft=draft, draft_dir=None)}
    # Nothing the plan (or operator) already sets, no GPU-only flag on the CPU engine, no draft not on the host.
    assert cpu == {"max-num-batched-tokens"}


def test_operator_candidates_are_checked_like_extra_args():
    assert operator_candidates(["--max-num-seqs 64"])[0].flags == ("--max-num-seqs", "64")
    for bad in ["--port 9000", "max-num-seqs 64", ""]:
        with pytest.raises(UsageError):
            operator_candidates([bad])


def test_durations():
    assert [parse_duration(t) for t in ("20m", "1h", "90s", "45")] == [1200, 3600, 90, 45]
    for bad in ("0", "soon", "-5m"):
        with pytest.raises(UsageError):
            parse_duration(bad)


def _config(tmp_path: Path, extra_args: list[str] | None = None, workload: str = "chat"):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    return parse_config({"model": {"path": str(model), "served_name": "m"},
                         "plan": {"workload": workload, "extra_args": extra_args or []},
                         "paths": {"state_dir": str(tmp_path / "s"), "tmp_dir": "/tmp/kimi-tune-test"}})


def test_serve_applies_a_winner_only_where_it_was_measured(tmp_path: Path):
    plan = {"vllm_version": "0.21.0", "hardware": "H100:1"}
    config, traffic = _config(tmp_path), Workload()
    tuned = {"key": configuration_key(config, traffic, **plan), "workload": json.loads(json.dumps(
        {**traffic.__dict__, "slo": traffic.slo.__dict__})), "winner": "seqs",
        "flags": ["--max-num-seqs", "64", "--async-scheduling"], "gain_held": True}
    assert tuned_flags(tuned, config, **plan) == (["--max-num-seqs", "64", "--async-scheduling"], None)
    # A gain not measured again, or one that did not hold when it was, is not applied.
    for held in (None, False):
        flags, why = tuned_flags({**tuned, "gain_held": held}, config, **plan)
        assert flags == [] and "kimi-service tune --verify" in why
    # The operator's own flag wins over the measured one.
    operator = _config(tmp_path, ["--max-num-seqs", "16"])
    tuned_for_operator = {**tuned, "key": configuration_key(operator, traffic, **plan)}
    assert tuned_flags(tuned_for_operator, operator, **plan) == (["--async-scheduling"], None)
    for changed_plan, changed_config in (({**plan, "vllm_version": "0.22.0"}, config),
                                         ({**plan, "hardware": "H200:1"}, config),
                                         (plan, _config(tmp_path, workload="latency"))):
        flags, why = tuned_flags(tuned, changed_config, **changed_plan)
        assert flags == [] and "run kimi-service tune again" in why
    assert tuned_flags({"flags": []}, config, **plan)[1] is not None


def test_the_slo_round_trips_through_tuned_json():
    traffic = Workload(concurrency=(1, 4), slo=bench.Slo(ttft=2.0, itl=0.05))
    document = {**traffic.__dict__, "slo": traffic.slo.__dict__, "concurrency": list(traffic.concurrency)}
    assert Workload.from_json(json.loads(json.dumps(document))) == traffic


def test_request_shapes_parse_and_enter_the_key(tmp_path: Path):
    assert Shape.parse("8192/256") == Shape(8192, 256, 0) and Shape.parse(" 512/128+2000 ").label == "512/128+2000"
    for bad in ("8192", "0/5", "5/0", "a/b", "1/2+"):
        with pytest.raises(ValueError, match="IN/OUT"):
            Shape.parse(bad)
    config, plan = _config(tmp_path), {"vllm_version": "0.21.0", "hardware": "H100:1"}
    alone, mixed = Workload(), Workload(more_shapes=(Shape(8192, 256),))
    assert configuration_key(config, alone, **plan) != configuration_key(config, mixed, **plan)
    document = json.loads(json.dumps(asdict(mixed)))
    assert Workload.from_json(document) == mixed
    assert "512 tokens in, 128 out; 8192 tokens in, 256 out" in mixed.describe()
    # A long shape in the mix brings the long-prompt candidate.
    plan_doc = {"argv": ["vllm", "serve", "m"], "workload": "chat", "engine": "cuda"}
    assert "long-prefill-chunks" not in {c.name for c in trial_candidates(plan_doc, alone)}
    assert "long-prefill-chunks" in {c.name for c in trial_candidates(plan_doc, mixed)}


def test_long_prompts_under_an_itl_objective_bring_short_prefill_chunks_first():
    plan_doc = {"argv": ["vllm", "serve", "m"], "workload": "chat", "engine": "cuda", "vllm_version": "0.21.0"}
    mixed = Workload(more_shapes=(Shape(8192, 256),))
    names = [c.name for c in trial_candidates(plan_doc, mixed)]
    assert names[0] == "short-prefill-chunks" and "long-prefill-chunks" in names
    short = next(c for c in trial_candidates(plan_doc, mixed) if c.name == "short-prefill-chunks")
    assert short.flags == ("--max-num-batched-tokens", "2048") and "TPOT <= 0.1 s" in short.why
    itl = next(c for c in trial_candidates(plan_doc, replace(mixed, slo=bench.Slo(itl=0.05)))
               if c.name == "short-prefill-chunks")
    assert "ITL <= 0.05 s" in itl.why
    # Not without an ITL or TPOT objective, nor for one client (no other request's prefill to wait behind), nor when
    # every prompt fits one short chunk.
    for workload in (replace(mixed, slo=bench.Slo(ttft=1.0)), replace(mixed, concurrency=(1,)), Workload()):
        assert "short-prefill-chunks" not in {c.name for c in trial_candidates(plan_doc, workload)}


def test_async_scheduling_is_tried_only_where_the_engine_does_not_default_to_it():
    plan_doc = {"argv": ["vllm", "serve", "m"], "workload": "chat", "engine": "cuda"}
    for version, tried in (("0.21.0", False), ("0.22.1", False), ("0.20.2", True), ("0.9.2", True)):
        names = {c.name for c in trial_candidates({**plan_doc, "vllm_version": version}, Workload())}
        assert ("async-scheduling" in names) is tried, version


def test_the_cli_refuses_a_malformed_shape_before_anything_starts(tmp_path: Path):
    result = subprocess.run([sys.executable, "-m", "kimi_service", "tune", "--config", str(tmp_path / "none.yaml"),
                             "--also-shape", "8192:256"], capture_output=True, text=True, timeout=60, check=False,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2 and "--also-shape" in result.stderr and "IN/OUT" in result.stderr, result.stderr


def _listed_tasks(*args: str) -> list[str]:
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "inventory/local.yml",
                             "site.yml", "--list-tasks", *args], cwd=root, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("tune : ")]


def test_site_runs_the_tune_stage_only_when_asked_for():
    plain = _listed_tasks()
    assert all("Validating arguments" in task for task in plain), plain
    asked = _listed_tasks("--tags", "tune")
    assert any(task.startswith("tune : Run kimi-service tune") for task in asked), asked


def test_progress_clock_rounds_once_so_seconds_never_read_60():
    assert [clock_label(t) for t in (0, 59.4, 59.6, 119.6, 754.2)] == ["00:00", "00:59", "01:00", "02:00", "12:34"]


GPU_PLAN = {"argv": ["vllm", "serve", "m", "--max-model-len", "8192", "--gpu-memory-utilization", "0.90"],
            "workload": "chat", "engine": "cuda", "vllm_version": "0.21.0", "pipeline_parallel_size": 1,
            "kv_cache_tokens": 4_000_000, "gpu_memory_utilization": 0.90, "overrides": [],
            "budget": {"total_bytes": 80 * 2**30, "kv_cache_bytes": 40 * 2**30}}


def _listed(plan: dict, workload: Workload, **options) -> dict[str, Candidate]:
    return {c.name: c for c in trial_candidates(plan, workload, **options)}


def test_a_batch_above_vllms_default_is_tried_only_where_clients_and_the_kv_cache_exceed_it():
    many = Workload(concurrency=(256, 2048))  # 640 tokens a request: the cache holds 6,250 of them
    found = _listed(GPU_PLAN, many, vllm_max_num_seqs=1024)["max-num-seqs-above-default"]
    assert found.flags == ("--max-num-seqs", "2048") and "vLLM's default admits 1024" in found.why
    # Capped at what the cache holds at the workload's lengths.
    small_cache = {**GPU_PLAN, "kv_cache_tokens": 640 * 1500}
    assert _listed(small_cache, many, vllm_max_num_seqs=1024)["max-num-seqs-above-default"].flags[1] == "1500"
    for plan, workload, default in ((GPU_PLAN, Workload(concurrency=(1, 16, 1024)), 1024),  # no more clients
                                    ({**GPU_PLAN, "kv_cache_tokens": 640 * 1024}, many, 1024),  # cache full
                                    (GPU_PLAN, many, None),  # vLLM's default unknown (the CPU engine)
                                    ({**GPU_PLAN, "argv": [*GPU_PLAN["argv"], "--max-num-seqs", "8"]}, many, 1024)):
        assert "max-num-seqs-above-default" not in _listed(plan, workload, vllm_max_num_seqs=default)


def test_more_gpu_memory_is_tried_where_the_plan_kept_vllms_share_and_the_operator_set_none():
    found = _listed(GPU_PLAN, Workload())["gpu-memory-utilization"]
    # The plan sets the flag to vLLM's value itself; the candidate replaces it.
    assert found.flags == ("--gpu-memory-utilization", "0.95")
    assert "the GPU's one user" in found.why and "vLLM refuses to start" in found.why
    assert "about 400,000 tokens" in found.why  # 5% of 80 GiB over a 40 GiB cache
    for plan in ({**GPU_PLAN, "gpu_memory_utilization": 0.85},  # a reduced or hand-set share
                 {**GPU_PLAN, "overrides": ["--gpu-memory-utilization", "0.90"]},  # the operator's
                 {**GPU_PLAN, "engine": "cpu", "gpu_memory_utilization": None, "budget": None}):
        assert "gpu-memory-utilization" not in _listed(plan, Workload())


def test_ngram_speculation_is_tried_at_low_concurrency_and_applied_only_when_allowed():
    found = _listed(GPU_PLAN, Workload(concurrency=(1, 16)))["ngram-speculative"]
    assert json.loads(found.flags[1]) == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    assert "random weights" in found.why and "--allow-speculative" in found.held_back
    allowed = _listed(GPU_PLAN, Workload(concurrency=(1, 16)), allow_speculative=True)["ngram-speculative"]
    assert allowed.held_back is None
    for plan, workload in ((GPU_PLAN, Workload(concurrency=(16, 64))),  # no low level
                           ({**GPU_PLAN, "pipeline_parallel_size": 2}, Workload()),
                           ({**GPU_PLAN, "engine": "cpu"}, Workload()),
                           ({**GPU_PLAN, "argv": [*GPU_PLAN["argv"], "--speculative-config", "{}"]}, Workload())):
        assert "ngram-speculative" not in _listed(plan, workload)
    assert operator_candidates(["--speculative-config {}"])[0].held_back is not None
    assert operator_candidates(["--speculative-config {}"], allow_speculative=True)[0].held_back is None


def test_a_speculative_winner_is_reported_but_applied_only_when_allowed(tmp_path: Path):
    held = Candidate("ngram", ("--speculative-config", "{}"), "", held_back="not allowed")
    engine = Bench({"ngram": everywhere(1.6)})
    outcome = search([held], engine.measure, Store(tmp_path / "a", "k"), 3600, SLO, log=quiet,
                     clock=lambda: engine.now)
    verdicts = {m.candidate.name: v.decision for m, v in outcome.measured}
    assert verdicts["ngram"] == "wins" and outcome.winner is outcome.baseline
    assert "not applied (not allowed); WINS" in format_table(outcome, SLO)
    engine = Bench({"ngram": everywhere(1.6)})
    outcome = search([replace(held, held_back=None)], engine.measure, Store(tmp_path / "b", "k"), 3600, SLO,
                     log=quiet, clock=lambda: engine.now)
    assert outcome.winner.candidate.name == "ngram"


def test_vllms_defaults_are_measured_once_reported_and_never_applied(tmp_path: Path):
    engine = Bench({"vllm defaults": everywhere(1.6), "seqs": everywhere(1.3)})
    outcome = search(SINGLES, engine.measure, Store(tmp_path, "k"), 3600, SLO, log=quiet, clock=lambda: engine.now)
    assert engine.started.count("vllm defaults") == 1 and engine.started[:2] == ["plan", "vllm defaults"]
    assert outcome.winner.candidate.name == "seqs"
    document = tuned_document(outcome, "k", Workload(slo=SLO))
    defaults = next(c for c in document["candidates"] if c["name"] == "vllm defaults")
    assert defaults["decision"] == "wins" and defaults["held_back"] and defaults["points"]
    assert "--max-num-seqs" in document["flags"] and "vllm defaults" not in document["winner"]
    row = next(line for line in format_table(outcome, SLO).splitlines() if line.startswith("vllm defaults"))
    assert "not applied" in row and "WINS" in row and "[" in row
    assert DEFAULTS.key != PLAN.key  # stored apart from the plan's own run


def test_the_defaults_run_keeps_only_what_memory_and_correctness_need(tmp_path: Path, monkeypatch):
    from kimi_service import launcher
    from kimi_service.tune import EngineRun

    argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "m",
            "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "8192", "--max-num-seqs", "4",
            "--enable-prefix-caching", "--kv-cache-memory-bytes=1073741824", "--dtype", "bfloat16",
            "--speculative-config", '{"method":"ngram"}', "--trust-remote-code", "--max-num-batched-tokens",
            "2048", "--shutdown-timeout", "30", "--enable-server-load-tracking", "--middleware", "gate.Gate"]
    assert defaults_argv(argv) == [
        "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--served-model-name", "m",
        "--host", "0.0.0.0", "--port", "8000", "--max-model-len", "8192", "--kv-cache-memory-bytes=1073741824",
        "--dtype", "bfloat16", "--trust-remote-code", "--shutdown-timeout", "30", "--enable-server-load-tracking",
        "--middleware", "gate.Gate"]
    assert "--max-num-seqs" not in DEFAULTS_KEEP and "--max-model-len" in DEFAULTS_KEEP
    monkeypatch.setattr(launcher, "prepare", lambda config, apply_tuned: launcher.Launch(argv, {}, {}))
    config = _config(tmp_path)
    assert EngineRun(config, DEFAULTS, tmp_path / "log").launch.argv == defaults_argv(argv)
    assert EngineRun(config, PLAN, tmp_path / "log").launch.argv == argv
