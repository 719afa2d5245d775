"""`kimi-service tune` against the real vLLM CPU server: each candidate's engine started as serve starts it,
swept by bench, stopped; a candidate that loses is never applied; the budget; resume; serve applying a
winner only where it was measured.

Four engine starts in all (the plan, vLLM's defaults, a candidate whose context is shorter than every
prompt, the plan again); later runs read the measurements back. Speeds on two shared cores are noise: even
a batch cap of one, serving four clients one at a time, measured ahead of the plan in one run (batching
buys little on a CPU), so no test depends on a speed difference. The losing candidate starts, serves, and
has every request refused.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from kimi_service.tune_stats import Candidate
from tests.engine.serving import write_config
from tests.support.engine import REPO_ROOT
from tests.support.ports import free_port

pytestmark = pytest.mark.slow

# A mix of two request shapes: every engine start is swept with both. One concurrency level: tune measures
# at least 64 requests a level, so each level is most of an engine's time here.
TRAFFIC = ["--concurrency", "4", "--prompts", "8", "--input-len", "32", "--output-len", "8",
           "--also-shape", "16/8+32", "--slo", "ttft=60,itl=60"]
# 32 prompt tokens plus the chat template are longer than this context: vLLM refuses every request (400).
LOSER = "--max-model-len 32"


class Tuner:
    def __init__(self, directory: Path, engine_venv: Path, model: Path):
        # vLLM's IPC sockets live in the state dir's tmp/, whose path must stay short.
        self.state_dir = Path(tempfile.mkdtemp(prefix="kimi-tune-", dir="/tmp"))
        self.config = write_config(directory, model, free_port(), self.state_dir)
        self.engine_venv = engine_venv
        self.env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "VLLM_API_KEY": "sk-tune-" + secrets.token_hex(8)}

    def run(self, command: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.engine_venv / "bin" / "kimi-service"), command, "--config", str(self.config),
                               *args], capture_output=True, text=True, timeout=timeout, env=self.env, check=False)

    def tune(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("tune", *TRAFFIC, *args)

    @property
    def tuned(self) -> dict:
        return json.loads((self.state_dir / "tuned.json").read_text())


@pytest.fixture(scope="module")
def tuner(tmp_path_factory: pytest.TempPathFactory, engine_venv: Path, tiny_model: Path) -> Tuner:
    return Tuner(tmp_path_factory.mktemp("tune"), engine_venv, tiny_model)


@pytest.fixture(scope="module")
def first(tuner: Tuner) -> subprocess.CompletedProcess[str]:
    before = tuner.tune("--status")
    assert before.returncode == 3 and "none yet" in before.stdout, before.stdout + before.stderr
    result = tuner.tune("--budget", "10m", "--candidate", LOSER)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result


def test_a_candidate_that_loses_is_measured_and_never_applied(tuner: Tuner, first) -> None:
    tuned = tuner.tuned
    assert tuned["winner"] == "plan" and tuned["flags"] == [] and tuned["reasons"] == {}
    defaults, loser = tuned["candidates"]
    # vLLM's defaults: the plan's memory and correctness flags alone, judged and reported, never applied.
    assert defaults["name"] == "vllm defaults" and defaults["held_back"] and defaults["points"], defaults
    assert "starting the engine with the plan's memory and correctness flags alone" in first.stderr
    assert loser["flags"] == LOSER.split() and loser["decision"] == "loses"
    assert "HTTP 400" in loser["reason"], loser
    assert "starting the engine with --max-model-len 32" in first.stderr
    rows = [line for line in first.stdout.splitlines() if line.startswith(("plan", LOSER))]
    assert "<- applied: baseline" in rows[0] and "LOSES" in rows[1], first.stdout
    table = first.stdout.splitlines()
    plan_row = next(i for i, line in enumerate(table) if line.startswith("plan"))
    assert "32/8" in table[plan_row] and "16/8+32" in table[plan_row + 1], first.stdout
    assert tuned["workload"]["more_shapes"] == [{"input_len": 16, "output_len": 8, "shared_prefix_len": 32}]
    plan_file = tuner.state_dir / "tune" / tuned["key"] / f"{Candidate('plan', (), '').key}.json"
    baseline = json.loads(plan_file.read_text())
    assert [(level["traffic"], level["concurrency"]) for level in baseline["levels"]] == [
        ("32/8", 4), ("16/8+32", 4)]
    assert all(level["errors"] == 0 and level["output_tokens_per_s"] > 0 for level in baseline["levels"])
    assert "applied: the plan alone (nothing beat it)" in first.stdout
    report = tuner.state_dir / "tune" / tuned["key"]
    assert (report / "report.txt").read_text().strip() in first.stdout
    # One engine log per start: the plan, vLLM's defaults, the candidate, the plan again.
    assert len(list(report.glob("*.log"))) == 4
    assert tuner.tune("--status").returncode == 0


def test_a_rerun_resumes_and_the_budget_skips_what_would_overrun_it(tuner: Tuner, first) -> None:
    again = tuner.tune("--budget", "10m", "--candidate", LOSER)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting the engine" not in again.stderr
    assert again.stderr.count("measured earlier") == 4
    tight = tuner.tune("--budget", "1s", "--candidate", "--max-num-seqs 2")
    assert tight.returncode == 0, tight.stderr[-3000:]
    assert "starting the engine" not in tight.stderr  # the plan is read back, the new candidate is not run
    assert "--max-num-seqs 2" in tight.stdout and "skipped: budget" in tight.stdout
    assert tuner.tuned["skipped"][0]["flags"] == ["--max-num-seqs", "2"]


def test_serve_runs_a_measured_winner_and_ignores_one_measured_elsewhere(tuner: Tuner, first) -> None:
    # As a win would leave it: the file tune wrote, with a winner's flags and reason.
    tuned = {**tuner.tuned, "winner": "max-num-seqs 3", "flags": ["--max-num-seqs", "3"], "gain_held": True,
             "reasons": {"--max-num-seqs": "measured by kimi-service tune on this host: 1.30x"}}
    (tuner.state_dir / "tuned.json").write_text(json.dumps(tuned))
    check = tuner.run("serve", "--check")
    assert check.returncode == 0, check.stderr
    assert "--max-num-seqs 3" in check.stdout
    plan_argv = check.stdout.split("would run: ", 1)[1]
    assert plan_argv.count("--max-num-seqs") == 1
    data = yaml.safe_load(tuner.config.read_text())
    data["plan"]["workload"] = "latency"
    tuner.config.write_text(yaml.safe_dump(data))
    elsewhere = tuner.run("serve", "--check")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "--max-num-seqs 3" not in elsewhere.stdout.split("would run: ", 1)[1]
    assert "measured for another model" in elsewhere.stdout and "run kimi-service tune again" in elsewhere.stdout
