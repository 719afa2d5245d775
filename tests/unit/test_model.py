"""config.json (real published values) -> ModelSpec: geometry, KV bytes per token, weight bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service import catalog
from kimi_service.errors import UsageError
from kimi_service.model import estimate_parameters, inspect_model, spec_from_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def fixture(repo_id: str) -> Path:
    return FIXTURES / repo_id.replace("/", "--")


def test_kimi_k25_reads_the_language_model_under_text_config():
    spec = inspect_model(str(fixture("moonshotai/Kimi-K2.5")))
    assert spec.architecture == "KimiK25ForConditionalGeneration"
    assert spec.multimodal and spec.trust_remote_code and spec.is_moe
    assert (spec.attention, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.num_layers) == ("mla", 512, 64, 61)
    assert spec.native_max_len == 262144
    assert spec.quantization == "compressed-tensors int4"
    # MLA: 61 layers x (512 + 64) x 2 bytes, and TP does not divide it (every rank keeps the latent).
    assert spec.kv_bytes_per_token() == 61 * 576 * 2 == 70272
    assert spec.kv_bytes_per_token(tensor_parallel=8) == 70272
    assert spec.kv_bytes_per_token(pipeline_parallel=2) == 31 * 576 * 2
    assert spec.kv_bytes_per_token(kv_dtype_bytes=1) == 61 * 576


def test_llama_gqa_kv_splits_across_tp_and_replicates_below_one_head():
    spec = inspect_model(str(fixture("meta-llama/Llama-3.1-8B-Instruct")))
    assert (spec.attention, spec.num_kv_heads, spec.head_dim) == ("gqa", 8, 128)
    assert spec.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert spec.kv_bytes_per_token(tensor_parallel=8) == 131072 // 8
    # 16 ranks, 8 KV heads: each rank still holds one whole head.
    assert spec.kv_bytes_per_token(tensor_parallel=16) == 131072 // 8


def test_weight_bytes_come_from_the_safetensors_index():
    spec = inspect_model(str(fixture("meta-llama/Llama-3.1-70B-Instruct")))
    assert spec.weight_bytes == 141_107_412_992
    assert spec.weight_bytes_source == "safetensors index"
    assert not spec.weights_estimated


def test_weight_bytes_from_safetensors_files_when_no_index(tmp_path):
    config = json.loads((fixture("Qwen/Qwen2.5-7B-Instruct") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 24)
    spec = inspect_model(str(tmp_path))
    assert (spec.weight_bytes, spec.weight_bytes_source) == (1024, "safetensors files")


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.repo_id)
def test_estimate_from_config_is_close_to_the_published_size(entry):
    config = json.loads((fixture(entry.repo_id) / "config.json").read_text())
    spec = spec_from_config(config, name="x", weight_bytes=None, weight_bytes_source="", source="test")
    assert spec.weights_estimated
    assert spec.weight_bytes == pytest.approx(entry.weight_bytes, rel=0.15)


def test_parameter_estimate_of_llama_8b():
    config = json.loads((fixture("meta-llama/Llama-3.1-8B-Instruct") / "config.json").read_text())
    assert estimate_parameters(config) == pytest.approx(8.03e9, rel=0.01)


@pytest.mark.parametrize(
    ("repo_id", "quantization"),
    [
        ("moonshotai/Kimi-K2-Instruct", "fp8"),
        ("deepseek-ai/DeepSeek-V3", "fp8"),
        ("MiniMaxAI/MiniMax-M2", "fp8"),
        ("Qwen/Qwen2.5-72B-Instruct-AWQ", "awq int4"),
        ("Qwen/Qwen2.5-7B-Instruct", None),
    ],
)
def test_quantization_method_is_kept(repo_id, quantization):
    assert inspect_model(str(fixture(repo_id))).quantization == quantization


def test_minimax_uses_explicit_head_dim_and_local_experts():
    spec = inspect_model(str(fixture("MiniMaxAI/MiniMax-M2")))
    assert (spec.head_dim, spec.num_kv_heads, spec.num_experts, spec.experts_per_token) == (128, 8, 256, 8)
    assert spec.moe_intermediate_size is None and spec.intermediate_size == 1536


def test_catalog_name_plans_without_files():
    spec = inspect_model("moonshotai/kimi-k2.5")
    assert spec.catalog_name == "moonshotai/Kimi-K2.5"
    assert spec.weight_bytes_source == "catalog"


def test_unknown_name_lists_the_catalog():
    with pytest.raises(UsageError, match=r"moonshotai/Kimi-K2\.5"):
        inspect_model("nobody/no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(UsageError, match=r"no config\.json"):
        inspect_model(str(tmp_path))


def test_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        inspect_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "hidden_size": 768}))
    with pytest.raises(UsageError, match="num_hidden_layers"):
        inspect_model(str(tmp_path))
