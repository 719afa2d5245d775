"""`kimi-service plan`: exit 0 fits, 3 does not fit, 2 bad input; JSON contract; no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_service import cli
from kimi_service.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"
CONTRACT = {
    "fits",
    "argv",
    "env",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "weights_bytes_per_gpu",
    "kv_cache_tokens",
    "warnings",
    "reasons",
    "data_parallel_size",
    "expert_parallel",
    "parallelism",
}


def test_fits_json_contract(capsys):
    code = main(["plan", "--model", str(FIXTURES / "moonshotai--Kimi-K2.5"), "--gpus", "8xH200", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= CONTRACT
    assert data["fits"] is True and data["argv"][:2] == ["vllm", "serve"]
    # Chat on 8 x H200: attention data-parallel over the 8 GPUs, experts sharded (DP 8 x EP 8).
    assert (data["tensor_parallel_size"], data["data_parallel_size"]) == (1, 8) and isinstance(data["warnings"], list)
    assert data["kv_cache_tokens"] == 8 * data["kv_cache_tokens_per_rank"] and data["parallelism"] == "DP 8 x EP 8"
    assert data["expert_parallel"] is True
    assert "--tensor-parallel-size" in data["reasons"] and "--data-parallel-size" in data["reasons"]


def test_human_table(capsys):
    assert (
        main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpus", "L4:1", "--workload", "throughput"])
        == 0
    )
    out = capsys.readouterr().out
    for heading in ("command:", "memory per GPU:", "KV cache tokens", "why:"):
        assert heading in out


def test_does_not_fit_exits_3_with_needed_available_and_alternatives(capsys):
    code = main(["plan", "--model", "moonshotai/Kimi-K2.5", "--gpus", "A100-SXM4-80GB:4"])
    assert code == 3
    err = capsys.readouterr().err
    assert "needs about" in err and "320.0 GiB" in err and "Would fit:" in err and "8 x H200" in err
    assert "Traceback" not in err


def test_does_not_fit_json(capsys):
    assert main(["plan", "--model", "moonshotai/Kimi-K2.5", "--gpus", "A100-SXM4-80GB:4", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["needed_bytes"] > data["available_bytes"] == 4 * 80 * 2**30
    assert data["suggestions"]


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "moonshotai/Kimi-K2.5", "--gpus", "A100:lots"],
        ["--model", "nobody/nothing", "--gpus", "8xH200"],
        ["--model", "moonshotai/Kimi-K2.5", "--gpus", "8xH200", "--workload", "fast"],
        ["--model", "moonshotai/Kimi-K2.5", "--gpus", "8xH200", "--nodes", "0"],
        ["--model", "moonshotai/Kimi-K2.5", "--gpus", "8xH200", "--max-model-len", "-5"],
    ],
)
def test_bad_input_exits_2_without_traceback(capsys, args):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimi-service: error:") and "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--gpus", "8xH200"])
    assert info.value.code == 2


def test_installed_console_script():
    script = Path(sys.executable).with_name("kimi-service")
    result = subprocess.run(
        [str(script), "plan", "--model", "moonshotai/Kimi-K2.5", "--gpus", "A100-SXM4-80GB:4"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 3, result.stderr
    assert "Would fit" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("output", [[], ["--json"]], ids=["table", "json"])
def test_a_reader_that_left_gets_no_traceback(output):
    """`kimi-service plan ... | head -c 10`: the reader has its bytes and is gone when the plan is written
    (its end of the pipe is closed before the command starts, so the write always meets a closed pipe)."""
    script = Path(sys.executable).with_name("kimi-service")
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [str(script), "plan", "--model", "moonshotai/Kimi-K2.5", "--gpus", "8xH200", *output],
            stdout=write_end, stderr=subprocess.PIPE, text=True, check=False, timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert result.returncode == cli.SIGPIPE_EXIT_STATUS == 141


def test_only_a_stdout_nobody_reads_counts_as_a_reader_that_left(monkeypatch):
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert not cli._stdout_reader_gone()
        os.close(read_end)
        assert cli._stdout_reader_gone()
