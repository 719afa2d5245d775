"""The planner against published checkpoints people rent GPUs for (issue 24), one test group per class:
quantization widths, context rules, served names, the choice when no group meets the target, refusals.

Fixtures are the published config.json files (tests/fixtures/models/README.md says where each field
comes from); expected sizes are the published checkpoint sizes quoted in each test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service.hardware import GIB, parse_gpu_spec
from kimi_service.model import inspect_model, spec_from_config
from kimi_service.planner import DoesNotFit, plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "models"


def model(repo_id: str):
    return inspect_model(str(FIXTURES / repo_id.replace("/", "--")))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def config_with(quantization_config: dict) -> dict:
    config = json.loads((FIXTURES / "meta-llama--Llama-3.1-70B-Instruct" / "config.json").read_text())
    return {**config, "quantization_config": quantization_config}


def estimate(config: dict):
    return spec_from_config(config, name="x", weight_bytes=None, weight_bytes_source="", source="test")


# --- 1. quantization ---------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("repo_id", "label", "published_gb"),
    [
        # huggingface.co/openai/gpt-oss-120b and -20b file listings: about 65 GB and 13.8 GB of safetensors
        # (MXFP4 experts; attention, router, embeddings and LM head in BF16, per modules_to_not_convert).
        ("openai/gpt-oss-120b", "mxfp4", 65.0),
        ("openai/gpt-oss-20b", "mxfp4", 13.8),
        # Llama 3.3 70B (70.6 B parameters): FP8 linear layers and a BF16 embedding + LM head (2.1 GB each).
        ("nvidia/Llama-3.3-70B-Instruct-FP8", "modelopt fp8", 72.7),
        # NVFP4: 4-bit values and an FP8 scale per 16 (0.5625 bytes per weight), BF16 embedding + LM head.
        ("nvidia/Llama-3.3-70B-Instruct-FP4", "modelopt nvfp4", 42.8),
        # Kimi K2.5 keeps attention, shared experts and the dense layer in BF16 (its `ignore` list): 595 GB.
        ("moonshotai/Kimi-K2.5", "compressed-tensors int4", 595.0),
    ],
)
def test_quantized_checkpoints_are_sized_from_their_formats(repo_id, label, published_gb):
    spec = model(repo_id)
    assert spec.quantization == label and spec.weights_estimated and not spec.notes
    assert spec.weight_bytes / 1e9 == pytest.approx(published_gb, rel=0.03)


def test_every_quant_method_vllm_loads_has_a_width():
    widths = {
        "w8a8 int8": {"quant_method": "compressed-tensors",
                      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}},
        "w4a16": {"quant_method": "compressed-tensors", "ignore": ["lm_head"],
                  "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 128}}}},
        "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                  "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}},
        "fp8": {"quant_method": "fp8", "weight_block_size": [128, 128]},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
        "gptq_marlin": {"quant_method": "gptq_marlin", "bits": 4, "group_size": 128},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
        "bnb nf4": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        "bnb int8": {"quant_method": "bitsandbytes", "load_in_8bit": True},
        "modelopt_fp4": {"quant_method": "modelopt_fp4"},
    }
    bf16 = estimate(config_with({})).weight_bytes  # an empty quantization_config: compressed-tensors, 16-bit
    for name, quant in widths.items():
        spec = estimate(config_with(quant))
        assert spec.quantization and not spec.notes, name
        # 70 B: 8-bit formats near 72 GB, 4-bit ones near 40 GB (plus the BF16 embedding and LM head).
        assert 0.25 * bf16 < spec.weight_bytes < 0.55 * bf16, name


def test_unknown_quant_method_is_a_warning_not_a_silent_bf16():
    spec = estimate(config_with({"quant_method": "newfangled"}))
    assert spec.notes and "newfangled" in spec.notes[0] and "16-bit" in spec.notes[0]
    result = plan(spec, parse_gpu_spec("H200:4"))
    assert any("newfangled" in w for w in result.warnings)


def test_ignore_lists_keep_layers_wide():
    narrow = estimate(config_with({"quant_method": "fp8"})).weight_bytes
    attention_wide = estimate(config_with({"quant_method": "fp8", "ignored_layers": ["re:.*self_attn.*"]}))
    one_layer = estimate(config_with({"quant_method": "fp8", "ignore": ["model.layers.0.mlp.down_proj"]}))
    assert attention_wide.weight_bytes > one_layer.weight_bytes > narrow


def test_gpt_oss_plans_on_one_gpu_of_its_class():
    # OpenAI: gpt-oss-120b runs on a single 80 GB GPU, gpt-oss-20b within 16 GB of memory.
    big = plan(model("openai/gpt-oss-120b"), parse_gpu_spec("H100-SXM:1"))
    assert big.tensor_parallel_size == 1
    assert plan(model("openai/gpt-oss-20b"), parse_gpu_spec("RTX-4090:1")).tensor_parallel_size == 1


# --- 2. context ---------------------------------------------------------------------------------------

def test_yarn_extends_the_context_and_a_request_for_it_is_served():
    # Qwen2.5-7B-Instruct's model card: add rope_scaling {type: yarn, factor 4, original 32768} for 131,072.
    spec = model("Qwen/Qwen2.5-7B-Instruct+yarn4")
    assert spec.native_max_len == 131072 and "yarn" in spec.context_why
    result = plan(spec, parse_gpu_spec("H100-SXM:1"), max_model_len=131072)
    assert result.max_model_len == 131072 and not any("native context" in w for w in result.warnings)


def test_llama3_rope_and_published_yarn_configs_keep_their_lengths():
    assert model("meta-llama/Llama-3.1-8B-Instruct").native_max_len == 131072  # llama3 type: not extended
    assert model("deepseek-ai/DeepSeek-V3").native_max_len == 163840  # 4,096 x 40
    assert model("openai/gpt-oss-120b").native_max_len == 131072  # 4,096 x 32


def test_gemma3_nested_text_config_gets_transformers_defaults():
    spec = model("google/gemma-3-27b-it")
    # vocab_size and max_position_embeddings are absent from Google's config: Gemma3TextConfig's defaults.
    assert (spec.vocab_size, spec.native_max_len, spec.num_layers, spec.head_dim) == (262208, 131072, 62, 128)
    assert spec.multimodal and (spec.sliding_window, spec.sliding_window_layers) == (1024, 52)
    # 27.4 B parameters in BF16 (54.9 GB published, the vision tower's 0.4 B left out here).
    assert spec.weight_bytes / 1e9 == pytest.approx(54.9, rel=0.03)


def test_sliding_window_layers_hold_only_the_window():
    spec = model("google/gemma-3-27b-it")
    full = spec.kv_bytes_per_token() * 131072
    per_sequence = spec.kv_bytes_per_sequence(131072, window_slack=8192)
    assert per_sequence == pytest.approx(full * (10 + 52 * (1024 + 8192) / 131072) / 62, rel=0.001)
    result = plan(spec, parse_gpu_spec("H200:1"))
    uniform = result.kv_cache_tokens // result.max_model_len
    assert result.max_concurrency > uniform  # the window frees most of the cache


def test_a_million_tokens_needs_what_the_vendor_says():
    # Qwen2.5-7B-Instruct-1M model card: at least 120 GB of GPU memory in total for 1M-token sequences,
    # served with --max-num-batched-tokens 131072 --enforce-eager.
    spec = model("Qwen/Qwen2.5-7B-Instruct-1M")
    assert spec.native_max_len == 1010000 and spec.dual_chunk_attention
    bf16_kv = ["--kv-cache-dtype", "auto"]  # the card's figure is for the default KV dtype
    with pytest.raises(DoesNotFit):
        plan(spec, parse_gpu_spec("H100-SXM:1"), max_model_len=1010000, workload="long-context", overrides=bf16_kv)
    result = plan(spec, parse_gpu_spec("H100-SXM:2"), max_model_len=1010000, workload="long-context",
                  overrides=bf16_kv)
    assert flag(result.argv, "--max-num-batched-tokens") == "131072" and "--enforce-eager" in result.argv
    # Without a request, one 80 GB GPU is planned at the length it can prefill with default chunks.
    assert plan(spec, parse_gpu_spec("H100-SXM:1")).max_model_len <= 131072


# --- 3. served name -----------------------------------------------------------------------------------

def test_a_directory_keeps_its_own_name_and_borrows_only_flags(tmp_path):
    directory = tmp_path / "Llama-3.3-70B-Instruct"
    directory.mkdir()
    config = json.loads((FIXTURES / "meta-llama--Llama-3.1-70B-Instruct" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    spec = inspect_model(str(directory))
    assert spec.catalog_name == "meta-llama/Llama-3.1-70B-Instruct" and spec.matched_by_shape
    result = plan(spec, parse_gpu_spec("H200:2"), model_path=str(directory))
    assert flag(result.argv, "--served-model-name") == "Llama-3.3-70B-Instruct"
    # The parser comes from the model's own model_type, not from the catalog entry it matches.
    assert flag(result.argv, "--tool-call-parser") == "llama3_json"
    assert "model_type llama" in result.reasons["--tool-call-parser"]
    named = plan(spec, parse_gpu_spec("H200:2"), served_model_name="llama")
    assert flag(named.argv, "--served-model-name") == "llama"


# --- 4. no group meets the target ---------------------------------------------------------------------

def test_without_a_group_meeting_the_target_the_most_kv_wins():
    # 131,072 tokens of Llama 3.1 8B on 2 x A100-80GB: TP 1 holds 3 sequences, TP 2 holds 7; chat wants 8.
    spec = model("meta-llama/Llama-3.1-8B-Instruct")
    result = plan(spec, parse_gpu_spec("A100-SXM4-80GB:2"), max_model_len=131072)
    assert result.tensor_parallel_size == 2 and result.max_concurrency < 8
    assert "most KV" in result.reasons["--tensor-parallel-size"]


# --- 5. refusals --------------------------------------------------------------------------------------

def test_refusal_tries_flags_on_the_same_hardware_first():
    # A 70B FP8 checkpoint asked for 131,072 tokens on 2 x H100: two BF16-KV sequences do not fit, FP8 KV does.
    # The planner picks FP8 KV itself (test_planner_scale.py); with BF16 KV pinned, the refusal names it first.
    spec = model("nvidia/Llama-3.3-70B-Instruct-FP8")
    with pytest.raises(DoesNotFit) as info:
        plan(spec, parse_gpu_spec("H100-SXM:2"), max_model_len=131072, overrides=["--kv-cache-dtype", "auto"])
    first = info.value.suggestions[0]
    assert first.startswith("--kv-cache-dtype fp8 on this hardware (TP 2")
    assert any("4 x H100-SXM" in s for s in info.value.suggestions[1:])
    assert plan(spec, parse_gpu_spec("H100-SXM:2"), max_model_len=131072, overrides=["--kv-cache-dtype", "fp8"])


def test_fragile_plans_warn_and_the_workload_minimum_refuses():
    spec = model("nvidia/Llama-3.3-70B-Instruct-FP8")
    # One 4,096-token sequence in 0.7 GiB of KV: planned for long-context (minimum 1) when the operator caps
    # the batch (vLLM's default of 1,024 sequences reserves more logits memory than is left), with a warning.
    result = plan(spec, parse_gpu_spec("H100-SXM:1"), workload="long-context", overrides=["--max-num-seqs", "16"])
    assert result.max_concurrency == 1 and result.budget.kv_cache_bytes < 2 * GIB
    assert any(w.startswith("fragile") for w in result.warnings)
    # Chat needs two: with vLLM's default batch pinned by the operator there is no reduced plan to fall back on.
    defaults = ["--max-num-seqs", "1024", "--max-num-batched-tokens", "8192", "--enforce-eager"]
    with pytest.raises(DoesNotFit, match="minimum"):
        plan(spec, parse_gpu_spec("H100-SXM:1"), overrides=defaults)


# --- 6. GPUs the plan leaves idle ----------------------------------------------------------------------
def test_a_model_far_smaller_than_the_host_is_advised_as_replicas():
    spec = model("meta-llama/Llama-3.1-8B-Instruct")
    alone = plan(spec, parse_gpu_spec("H100-SXM:1"))
    result = plan(spec, parse_gpu_spec("8xH100"))
    assert result.tensor_parallel_size == 1  # the smallest group that serves chat: one GPU
    [idle] = [w for w in result.warnings if "idle" in w]
    assert idle.startswith("the plan uses 1 of the 8 GPUs (TP 1), leaving 7 idle: 8 replicas of this plan")
    assert f"would hold {8 * result.max_concurrency} sequences of {result.max_model_len:,} tokens" in idle
    assert "Replicas behind one endpoint" in idle and "kimi_replicas" in idle
    assert not any("idle" in w for w in alone.warnings)
    # A group that does not divide the host: the spare GPUs are named, no replica count is made up.
    uneven = plan(spec, parse_gpu_spec("3xH100"), overrides=["--tensor-parallel-size", "2"])
    assert "the plan uses 2 of the 3 GPUs (TP 2), leaving 1 idle" in uneven.warnings
