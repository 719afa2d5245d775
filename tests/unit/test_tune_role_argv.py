"""The tune role's command line, parsed by kimi-service's own parser: the role's defaults leave the
objectives and the request floor to tune (one source: kimi_service/tuned.py), and each role variable
reaches the flag it names."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import pytest
import yaml
from ansible.plugins.filter.core import to_bool

from kimi_service.cli import build_parser
from kimi_service.tuned import DEFAULT_SLO

ROLE = Path(__file__).resolve().parents[2] / "roles" / "tune"
CONFIG_DIR = "/etc/kimi-service"


def run_argv(**operator) -> list[str]:
    """The argv of the role's 'Run kimi-service tune' task, its variables resolved as Ansible resolves them
    (defaults < operator values, then the role's vars templated)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["regex_replace"] = lambda value, pattern, repl: re.sub(pattern, repl, value)
    env.filters["bool"] = to_bool
    context = {**yaml.safe_load((ROLE / "defaults/main.yml").read_text()), **operator,
               "kimi_config_dir": CONFIG_DIR, "kimi_install_dir": "/opt/kimi-service", "kimi_user": "kimi"}
    role_vars = yaml.safe_load((ROLE / "vars/main.yml").read_text())
    context["_tune_traffic"] = env.compile_expression(role_vars["_tune_traffic"].strip()[2:-2])(context)
    task = next(t for t in yaml.safe_load((ROLE / "tasks/main.yml").read_text()) if "block" in t)
    run = next(t for t in task["block"] if t["name"].startswith("Run kimi-service tune"))
    argv = env.compile_expression(run["ansible.builtin.command"]["argv"].strip()[2:-2])(context)
    assert argv[1] == "tune"
    return argv[2:]


def parsed(**operator):
    return build_parser().parse_args(["tune", *run_argv(**operator)])


def test_the_defaults_leave_the_objectives_and_the_floor_to_tune() -> None:
    args = parsed()
    assert args.slo == DEFAULT_SLO
    assert args.prompts == 64
    assert not args.allow_speculative
    assert args.config == Path(CONFIG_DIR) / "config.yaml"


@pytest.mark.parametrize("spelling", [True, "true", "yes", 1])
def test_each_variable_reaches_its_flag(spelling) -> None:
    args = parsed(kimi_tune_slo="ttft=2,itl=0.2", kimi_tune_allow_speculative=spelling, kimi_tune_prompts="128",
                  kimi_tune_more_shapes=["8192/256"], kimi_tune_candidates=["--max-num-seqs 64"])
    assert args.slo == "ttft=2,itl=0.2"
    assert args.allow_speculative
    assert args.prompts == 128
    assert [(s.input_len, s.output_len) for s in args.also_shape] == [(8192, 256)]
    assert args.candidate == ["--max-num-seqs 64"]


@pytest.mark.parametrize("spelling", [False, "false", "no", 0])
def test_speculative_stays_off_in_every_false_spelling(spelling) -> None:
    assert not parsed(kimi_tune_allow_speculative=spelling).allow_speculative
