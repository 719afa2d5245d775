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


def _tools_line(plan_json: dict) -> str:
    task = next(t for t in yaml.safe_load(TASKS.read_text()) if "_verify_tools" in t.get("vars", {}))
    return jinja2.Environment().from_string(task["vars"]["_verify_tools"]).render(_verify_plan=plan_json).strip()


def test_the_summary_names_the_parsers_or_why_tools_are_off(tmp_path):
    kimi = plan(inspect_model("moonshotai/Kimi-K2.5"), parse_gpu_spec("8xH200"))
    assert _tools_line(kimi.to_json()) == "on (--tool-call-parser kimi_k2, --reasoning-parser kimi_k2)"
    config = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "google--gemma-3-27b-it" / "config.json"
    (tmp_path / "config.json").write_text(config.read_text())
    gemma = plan(inspect_model(str(tmp_path)), parse_gpu_spec("H200:1"))
    assert _tools_line(gemma.to_json()).startswith("tool calling is off: no tool-call parser is known for "
                                                   "model_type gemma3")


def test_the_closing_example_request_bounds_its_answer():
    task = next(t for t in yaml.safe_load(TASKS.read_text()) if "_verify_tools" in t.get("vars", {}))
    example = next(line for line in task["ansible.builtin.debug"]["msg"] if line.startswith("try it:"))
    assert '"max_tokens": 64' in example
