"""`kimi-service serve --check`: the gate the service role puts in front of a new config.yaml."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service import launcher
from kimi_service.cli import main
from kimi_service.config import load_config


@pytest.fixture
def tmp_path(short_tmp_path: Path) -> Path:
    """The config's state_dir is tmp_path: short enough for vLLM's IPC socket paths."""
    return short_tmp_path


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


def _config(tmp_path: Path, model: Path, engine: str = "cpu", plan_extra: str = "") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"model:\n  path: {model}\nplan:\n  engine: {engine}\n{plan_extra}"
                    f"paths:\n  state_dir: {tmp_path}\n")
    return path


def test_check_plans_and_prints_the_command_without_starting(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    assert main(["serve", "--check", "--config", str(_config(tmp_path, model))]) == 0
    out = capsys.readouterr().out
    assert "valid; engine cpu" in out
    assert "would run: " in out and "--model " + str(model) in out


def test_check_runs_beside_a_running_serve_it_takes_no_lock(tmp_path, capsys):
    from kimi_service.launcher.process import serve_lock

    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    with serve_lock(tmp_path):  # what the running serve holds on the same state dir
        assert main(["serve", "--check", "--config", str(_config(tmp_path, model))]) == 0
    assert "valid; engine cpu" in capsys.readouterr().out


def test_extra_env_names_are_shown_and_recorded_and_the_values_reach_the_engine(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = _config(tmp_path, model, plan_extra="  extra_env:\n    VLLM_CPU_OMP_THREADS_BIND: '1'\n"
                                                  "    WANDB_API_KEY: wandb-s3cret\n")
    assert main(["serve", "--check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "with plan.extra_env: VLLM_CPU_OMP_THREADS_BIND, WANDB_API_KEY" in out
    launch = launcher.prepare(load_config(config))
    # plan.json is world-readable: the names, never the values.
    assert launch.plan_document["extra_env"] == ["VLLM_CPU_OMP_THREADS_BIND", "WANDB_API_KEY"]
    assert "wandb-s3cret" not in out + json.dumps(launch.plan_document)
    assert (launch.env["VLLM_CPU_OMP_THREADS_BIND"], launch.env["WANDB_API_KEY"]) == ("1", "wandb-s3cret")


def test_check_refuses_a_bad_value_with_exit_2(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    assert main(["serve", "--check", "--config", str(_config(tmp_path, model, engine="gpu"))]) == 2
    assert "plan.engine" in capsys.readouterr().err


def test_check_refuses_a_model_that_does_not_fit_with_exit_3(tmp_path, capsys):
    model = FIXTURES / "meta-llama--Llama-3.1-70B-Instruct"
    assert main(["serve", "--check", "--config", str(_config(tmp_path, model))]) == 3
    assert "does not fit" in capsys.readouterr().err
