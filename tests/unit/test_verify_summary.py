"""The verify role's closing summary, rendered with jinja2 as Ansible would, from a real plan's JSON."""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml

from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import inspect_model
from kimi_service.planner import plan

TASKS = Path(__file__).resolve().parents[2] / "roles" / "verify" / "tasks" / "main.yml"


def _plan_summary(plan_json: dict) -> str:
    task = next(t for t in yaml.safe_load(TASKS.read_text()) if "_verify_plan_summary" in t.get("vars", {}))
    return jinja2.Environment().from_string(task["vars"]["_verify_plan_summary"]).render(_verify_plan=plan_json)


def test_the_summary_shows_a_data_parallel_plan_as_it_runs():
    planned = plan(inspect_model("moonshotai/Kimi-K2.5"), parse_gpu_spec("8xH200"))
    summary = _plan_summary(planned.to_json())
    assert summary.startswith(f"engine cuda, {planned.parallelism}, max_model_len {planned.max_model_len}")
    assert "DP 8 x EP 8" in summary and "TP 1" not in summary
