"""The tuner's rules without an engine: who wins, what is never applied, the budget, resume, the key serve
checks. tests/engine/test_tune.py runs the same search against the real CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kimi_service import bench, catalog
from kimi_service.config import parse_config
from kimi_service.errors import KimiError, UsageError
from kimi_service.tune import (
    Candidate,
    Measurement,
    Store,
    clock_label,
    format_table,
    judge,
    operator_candidates,
    parse_duration,
    search,
    trial_candidates,
    tuned_document,
)
from kimi_service.tuned import Shape, Workload, configuration_key, tuned_flags

BASELINE = {1: (100.0, 1.0), 16: (1000.0, 8.0), 64: (2000.0, 10.0)}  # concurrency: (tokens/s, goodput)


def levels(points: dict[int, tuple[float, float]], errors: int = 0) -> list[dict]:
    """Each level 1,000 output tokens long, as bench's levels of one request shape are."""
    return [{"concurrency": c, "output_tokens_per_s": tok, "goodput_requests_per_s": good, "errors": errors,
             "duration_s": 1000 / tok, "requests": 32} for c, (tok, good) in points.items()]


def measured(name: str, points: dict[int, tuple[float, float]], flags: tuple[str, ...] = (), **kw) -> Measurement:
    return Measurement(Candidate(name, flags or (f"--{name}",), "test"), levels(points), 10.0, 30.0, **kw)


def scaled(by: dict[int, float]) -> dict[int, tuple[float, float]]:
    return {c: (tok * by.get(c, 1.0), good * by.get(c, 1.0)) for c, (tok, good) in BASELINE.items()}


BASE = measured("plan", BASELINE, flags=("",))


def test_a_candidate_that_loses_anywhere_never_wins_however_much_it_gains_elsewhere():
    verdict = judge(BASE, measured("cap", scaled({1: 1.6, 16: 1.5, 64: 0.5})))
    assert not verdict.wins and "0.50x the baseline at concurrency 64" in verdict.reason
    slightly = judge(BASE, measured("near", scaled({1: 1.5, 64: 0.97})))
    assert not slightly.wins and "concurrency 64" in slightly.reason
    assert judge(BASE, measured("ok", scaled({1: 1.5, 64: 0.985}))).wins


def test_failed_requests_or_a_failed_start_lose():
    assert not judge(BASE, Measurement(Candidate("x", ("--x",), ""), levels(scaled({1: 2}), errors=1), 1, 1)).wins
    broken = judge(BASE, Measurement(Candidate("x", ("--x",), ""), [], 1, 1, error="exited 1"))
    assert not broken.wins and "exited 1" in broken.reason


def test_within_noise_is_not_a_win_and_the_reason_names_the_gain():
    assert not judge(BASE, measured("same", scaled({16: 1.01}))).wins
    verdict = judge(BASE, measured("better", scaled({16: 1.5})))
    # Goodput at 16 clients: 8 req/s over 1 s (8 requests in the SLO); 12 over 1/1.5 s (8 too), each given
    # half a request more.
    at_16 = (12 + 0.5 * 1.5) / (8 + 0.5)
    assert verdict.wins and verdict.score == pytest.approx(at_16 ** (1 / 3))
    assert f"{at_16:.2f}x at concurrency 16" in verdict.reason


def test_without_any_request_in_the_slo_throughput_decides():
    base = measured("plan", {1: (100.0, 0.0), 16: (1000.0, 0.0)})
    verdict = judge(base, measured("x", {1: (150.0, 0.0), 16: (1000.0, 0.0)}))
    assert verdict.wins and verdict.score == pytest.approx(1.5 ** (1 / 2))
    assert "1.50x at concurrency 1 (0 of 32 requests in the SLO -> 0 of 32" in verdict.reason


def test_bringing_requests_into_an_slo_the_baseline_met_with_none_wins():
    # Long prompts at 16 clients: the baseline's prefill chunks stall every decode past the ITL bound.
    base = measured("plan", {1: (100.0, 1.0), 16: (1000.0, 0.0)})
    verdict = judge(base, measured("short-chunks", {1: (99.0, 0.99), 16: (990.0, 5.0)}))
    assert verdict.wins and "at concurrency 16 (0 of 32 requests in the SLO -> 5 of 32" in verdict.reason
    assert not judge(base, measured("same", {1: (99.0, 0.99), 16: (990.0, 0.0)})).wins


class Bench:
    """Stands for the engine: each candidate's levels by name; counts the starts."""

    def __init__(self, results: dict[str, dict[int, tuple[float, float]]], cost: float = 30.0):
        self.results, self.cost, self.started, self.now = results, cost, [], 0.0

    def measure(self, candidate: Candidate) -> Measurement:
        self.started.append(candidate.name)
        self.now += self.cost
        return Measurement(candidate, levels(self.results[candidate.name]), 10.0, self.cost)


SINGLES = [Candidate("seqs", ("--max-num-seqs", "64"), ""), Candidate("cap", ("--max-num-seqs", "8"), ""),
           Candidate("async", ("--async-scheduling",), "")]
RESULTS = {"plan": BASELINE, "seqs": scaled({64: 1.2}), "cap": scaled({1: 1.3, 64: 0.4}),
           "async": scaled({16: 1.1}), "seqs + async": scaled({16: 1.1, 64: 1.25})}


def test_search_measures_each_then_the_winners_together_and_applies_the_best(tmp_path: Path):
    engine = Bench(RESULTS)
    outcome = search(SINGLES, engine.measure, Store(tmp_path, "k"), 3600, log=lambda _: None,
                     clock=lambda: engine.now)
    assert engine.started == ["plan", "seqs", "cap", "async", "seqs + async"]
    assert outcome.winner.candidate.flags == ("--max-num-seqs", "64", "--async-scheduling")
    document = tuned_document(outcome, "k", Workload())
    assert document["flags"] == ["--max-num-seqs", "64", "--async-scheduling"]
    assert set(document["reasons"]) == {"--max-num-seqs", "--async-scheduling"}
    assert "measured by kimi-service tune" in document["reasons"]["--max-num-seqs"]
    cap = next(c for c in document["candidates"] if c["name"] == "cap")
    assert not cap["wins"] and "concurrency 64" in cap["reason"]


def test_nothing_that_lost_is_applied_when_nothing_won(tmp_path: Path):
    engine = Bench({**RESULTS, "seqs": scaled({64: 0.9}), "async": scaled({16: 1.0})})
    outcome = search(SINGLES, engine.measure, Store(tmp_path, "k"), 3600, log=lambda _: None,
                     clock=lambda: engine.now)
    assert outcome.winner is outcome.baseline
    assert tuned_document(outcome, "k", Workload())["flags"] == []


def test_the_budget_stops_before_a_candidate_that_would_overrun_and_a_rerun_resumes(tmp_path: Path):
    engine = Bench(RESULTS, cost=30.0)
    first = search(SINGLES, engine.measure, Store(tmp_path, "k"), 70, log=lambda _: None, clock=lambda: engine.now)
    assert engine.started == ["plan", "seqs"]  # 60 s spent; a third 30 s candidate would pass 70 s
    assert [c.name for c, _ in first.skipped] == ["cap", "async"] and "budget" in first.skipped[0][1]
    again = Bench(RESULTS, cost=30.0)
    second = search(SINGLES, again.measure, Store(tmp_path, "k"), 3600, log=lambda _: None, clock=lambda: again.now)
    assert again.started == ["cap", "async", "seqs + async"]  # plan and seqs read back, not measured again
    assert second.reused == 2 and second.winner.candidate.name == "seqs + async"


def test_looking_at_the_store_creates_nothing(tmp_path: Path):
    store = Store(tmp_path / "tune", "k")
    assert store.load(SINGLES[0]) is None and not (tmp_path / "tune").exists()


def test_a_plan_that_does_not_serve_stops_the_search(tmp_path: Path):
    def broken(candidate: Candidate) -> Measurement:
        return Measurement(candidate, [], 1, 1, error="the engine exited with 1")

    with pytest.raises(KimiError, match="nothing to compare"):
        search(SINGLES, broken, Store(tmp_path, "k"), 3600, log=lambda _: None)


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
        "flags": ["--max-num-seqs", "64", "--async-scheduling"]}
    assert tuned_flags(tuned, config, **plan) == (["--max-num-seqs", "64", "--async-scheduling"], None)
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


def mix(points: dict[str, dict[int, tuple[float, float]]]) -> list[dict]:
    return [{**level, "traffic": shape} for shape, by in points.items() for level in levels(by)]


def test_in_a_mix_a_loss_on_one_shape_loses_and_the_reason_names_the_shape():
    base = Measurement(Candidate("plan", (), ""), mix({"512/128": BASELINE, "8192/256": BASELINE}), 10, 30)
    long_loses = Measurement(Candidate("c", ("--c",), ""),
                             mix({"512/128": scaled({1: 1.5, 16: 1.5, 64: 1.5}), "8192/256": scaled({16: 0.9})}), 1, 1)
    verdict = judge(base, long_loses)
    assert not verdict.wins and "0.90x the baseline at concurrency 16 of 8192/256" in verdict.reason
    long_wins = Measurement(Candidate("c", ("--c",), ""),
                            mix({"512/128": BASELINE, "8192/256": scaled({64: 1.8})}), 1, 1)
    verdict = judge(base, long_wins)
    assert verdict.wins and "1.80x at concurrency 64 of 8192/256" in verdict.reason
    # A candidate measured without the second shape is not comparable.
    assert not judge(base, Measurement(Candidate("c", ("--c",), ""), mix({"512/128": BASELINE}), 1, 1)).wins


def test_the_table_has_a_row_per_shape_under_each_candidate(tmp_path: Path):
    base = Measurement(Candidate("plan", (), ""), mix({"512/128": BASELINE, "8192/256+2000": BASELINE}), 10, 30)
    outcome = search([Candidate("c", ("--c",), "")], lambda c: Measurement(c, base.levels, 1, 1),
                     Store(tmp_path, "k"), 3600, log=lambda _: None)
    lines = format_table(outcome).splitlines()
    assert lines[0].split()[:2] == ["candidate", "traffic"]
    assert lines[2].split()[:2] == ["plan", "512/128"] and lines[3].split()[0] == "8192/256+2000"
    assert lines[4].split()[:2] == ["c", "512/128"] and "loses" in lines[4]


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
    assert short.flags == ("--max-num-batched-tokens", "2048") and "ITL <= 0.1 s" in short.why
    # Not without an ITL objective, nor for one client (no other request's prefill to wait behind), nor when
    # every prompt fits one short chunk.
    for workload in (replace(mixed, slo=bench.Slo(ttft=1.0)), replace(mixed, concurrency=(1,)), Workload()):
        assert "short-prefill-chunks" not in {c.name for c in trial_candidates(plan_doc, workload)}


def test_async_scheduling_is_tried_only_where_the_engine_does_not_default_to_it():
    plan_doc = {"argv": ["vllm", "serve", "m"], "workload": "chat", "engine": "cuda"}
    for version, tried in (("0.21.0", False), ("0.22.1", False), ("0.20.2", True), ("0.9.2", True)):
        names = {c.name for c in trial_candidates({**plan_doc, "vllm_version": version}, Workload())}
        assert ("async-scheduling" in names) is tried, version


def test_winners_setting_one_flag_to_two_values_combine_with_the_better_value(tmp_path: Path):
    singles = [Candidate("short", ("--max-num-batched-tokens", "2048"), ""),
               Candidate("long", ("--max-num-batched-tokens", "16384"), ""),
               Candidate("graphs", ("--max-cudagraph-capture-size", "64"), "")]
    results = {"plan": BASELINE, "short": scaled({16: 1.1}), "long": scaled({16: 1.3}), "graphs": scaled({64: 1.1}),
               "long + graphs": scaled({16: 1.3, 64: 1.1})}
    engine = Bench(results)
    outcome = search(singles, engine.measure, Store(tmp_path, "k"), 3600, log=lambda _: None,
                     clock=lambda: engine.now)
    assert engine.started[-1] == "long + graphs"
    assert outcome.winner.candidate.flags == ("--max-num-batched-tokens", "16384", "--max-cudagraph-capture-size", "64")


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
