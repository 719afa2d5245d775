"""The planner against published model configs (tests/fixtures/published_configs.json: each entry the fields
the planner reads from huggingface.co/<repo id>/blob/main/config.json, its URL, and the total parameter count
its model card or Hugging Face page publishes), and against published deployments: which GPUs a model's
maker or vLLM serves it on. One group per class: MoE layers, hybrid attention, small and unknown GPUs,
quantization formats as published."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_service import geometry
from kimi_service.errors import UsageError
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import (
    estimate_parameters,
    inspect_model,
    moe_layer_count,
    parameter_groups,
    spec_from_config,
)
from kimi_service.planner import DoesNotFit, plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PUBLISHED = {entry["repo_id"]: entry for entry in json.loads((FIXTURES / "published_configs.json").read_text())}


def spec(repo_id: str, **changes):
    config = {**PUBLISHED[repo_id]["config"], **changes}
    return spec_from_config(config, name=repo_id, weight_bytes=None, weight_bytes_source="", source="test")


def fits(repo_id: str, gpus: str, **kwargs) -> bool:
    try:
        plan(spec(repo_id), parse_gpu_spec(gpus), **kwargs)
    except DoesNotFit:
        return False
    return True


def test_the_table_holds_thirty_published_configs_with_their_sources():
    assert len(PUBLISHED) >= 30
    for repo_id, entry in PUBLISHED.items():
        assert entry["source"] == f"https://huggingface.co/{repo_id}/blob/main/config.json"
        assert entry["parameters_source"]


@pytest.mark.parametrize("repo_id", sorted(PUBLISHED))
def test_parameter_count_is_the_published_one(repo_id):
    entry = PUBLISHED[repo_id]
    counted = estimate_parameters(geometry.language_config(entry["config"]))
    assert counted == pytest.approx(entry["parameters"], rel=0.025), entry["parameters_source"]


# --- 1. interleaved and partial MoE ---------------------------------------------------------------------

@pytest.mark.parametrize(("repo_id", "moe_layers"), [
    ("meta-llama/Llama-4-Maverick-17B-128E-Instruct", 24),  # interleave_moe_layer_step 2: every other layer
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", 48),
    ("deepseek-ai/DeepSeek-V3.1", 58),  # first_k_dense_replace 3
    ("zai-org/GLM-4.5", 89),  # first_k_dense_replace 3
    ("zai-org/GLM-4.5-Air", 45),  # first_k_dense_replace 1
    ("Qwen/Qwen3-30B-A3B", 48),  # decoder_sparse_step 1, no mlp_only_layers
    ("Qwen/Qwen3-Next-80B-A3B-Instruct", 48),
])
def test_only_the_layers_that_hold_experts_are_costed_as_moe(repo_id, moe_layers):
    text = geometry.language_config(PUBLISHED[repo_id]["config"])
    assert moe_layer_count(text, int(text["num_hidden_layers"])) == moe_layers


def test_mlp_only_layers_and_sparse_step_make_dense_layers():
    base = geometry.language_config(PUBLISHED["Qwen/Qwen3-30B-A3B"]["config"])
    assert moe_layer_count({**base, "mlp_only_layers": [0, 47]}, 48) == 46
    assert moe_layer_count({**base, "decoder_sparse_step": 2}, 48) == 24  # layers 1, 3, ...
    # Each dense layer trades 128 experts of 768 for one MLP of 6,144: fewer parameters.
    assert estimate_parameters({**base, "mlp_only_layers": [0, 47]}) < estimate_parameters(base)
    assert not spec("Qwen/Qwen3-30B-A3B", mlp_only_layers=list(range(48))).is_moe


def test_a_bad_mlp_only_layers_is_refused_by_name():
    with pytest.raises(UsageError, match="mlp_only_layers"):
        spec("Qwen/Qwen3-30B-A3B", mlp_only_layers="all")


def test_llama4_shared_expert_and_wide_dense_layers_are_counted():
    # Maverick: 24 MoE layers (128 routed + 1 shared expert of 8,192) and 24 dense layers of 16,384.
    maverick = PUBLISHED["meta-llama/Llama-4-Maverick-17B-128E-Instruct"]["config"]
    groups = parameter_groups(geometry.language_config(maverick))
    assert groups["experts"] == 24 * 128 * 8192 * 3 * 5120
    assert groups["shared_experts"] == 24 * 8192 * 3 * 5120
    assert groups["mlp"] == 24 * 16384 * 3 * 5120


# --- 2. hybrid attention ----------------------------------------------------------------------------------

def test_linear_attention_layers_keep_a_state_not_a_kv_cache():
    # Qwen3-Next: full attention every 4th layer (12 of 48); 36 Gated DeltaNet layers hold a fixed state.
    model = spec("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert (model.linear_attention_layers, model.cached_layers) == (36, 12)
    assert model.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    # conv state over q, k, v (2 x 16 x 128 + 32 x 128) x 3 taps, and 32 value heads of 128 x 128, in BF16.
    state = 36 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2
    assert model.linear_state_bytes() == state
    assert model.kv_bytes_per_sequence(1) - model.kv_bytes_per_token() == state
    assert model.kv_bytes_per_sequence(100_000) == 100_000 * model.kv_bytes_per_token() + state
    assert model.linear_state_bytes(tensor_parallel=4) == state // 4


def test_layer_types_name_linear_layers_too():
    config = {**PUBLISHED["Qwen/Qwen3-Next-80B-A3B-Instruct"]["config"]}
    del config["full_attention_interval"]
    config["layer_types"] = ["linear_attention", "full_attention"] * 24
    assert spec_from_config(config, name="x", weight_bytes=None, weight_bytes_source="",
                            source="test").linear_attention_layers == 24


@pytest.mark.parametrize(("repo_id", "sliding"), [
    ("google/gemma-3-12b-it", 40),  # sliding_window_pattern 6 (transformers' default): 8 global layers of 48
    ("google/gemma-2-27b-it", 23),  # Gemma 2 alternates local and global
])
def test_sliding_window_layers_cache_only_their_window(repo_id, sliding):
    assert spec(repo_id).sliding_window_layers == sliding


# --- 3. published deployments -------------------------------------------------------------------------------

def test_qwen3_next_is_served_at_tp4_on_h100s():
    # Model card (huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct): vllm serve ... --tensor-parallel-size 4.
    # The TP x PP search (latency) gives that group; 80B of BF16 does not fit two H100s.
    assert plan(spec("Qwen/Qwen3-Next-80B-A3B-Instruct"), parse_gpu_spec("H100-SXM:4"),
                workload="latency").parallelism == "TP 4"
    assert not fits("Qwen/Qwen3-Next-80B-A3B-Instruct", "H100-SXM:2")


def test_qwen3_235b_fp8_is_served_at_tp4_on_h100s():
    # docs.gpustack.ai performance lab, Qwen3-235B-A22B on H100: vllm serve
    # Qwen/Qwen3-235B-A22B-Instruct-2507-FP8 -tp 4.
    repo_id = "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8"
    assert spec(repo_id).weight_bytes / 1e9 == pytest.approx(235, rel=0.03)  # FP8: one byte a weight
    assert plan(spec(repo_id), parse_gpu_spec("H100-SXM:4"), workload="latency").parallelism == "TP 4"
    assert not fits(repo_id, "H100-SXM:2")


def test_llama4_scout_contexts_of_the_vllm_blog():
    # blog.vllm.ai/2025/04/05/llama4.html: Scout (BF16) at TP 8 with --max-model-len 1000000 on 8 x H100 and
    # 3600000 on 8 x H200. Meta's model card: one H100 only with int4 quantization, so BF16 does not fit one.
    repo_id = "meta-llama/Llama-4-Scout-17B-16E-Instruct"
    assert plan(spec(repo_id), parse_gpu_spec("H100-SXM:8"), max_model_len=1_000_000).max_model_len == 1_000_000
    assert plan(spec(repo_id), parse_gpu_spec("H200:8"), max_model_len=3_600_000).max_model_len == 3_600_000
    assert not fits(repo_id, "H100-SXM:1")


@pytest.mark.parametrize(("repo_id", "gpus", "nodes", "length", "expected"), [
    # github.com/zai-org/GLM-4.5 README, Inference: BF16 GLM-4.5 on H100 x 16 / H200 x 8, GLM-4.5-Air on
    # H100 x 4 / H200 x 2; the full 128K context for Air on H100 x 8.
    ("zai-org/GLM-4.5", "H200:8", 1, None, True),
    ("zai-org/GLM-4.5", "H100-SXM:8", 2, None, True),
    ("zai-org/GLM-4.5", "H100-SXM:8", 1, None, False),
    ("zai-org/GLM-4.5-Air", "H100-SXM:4", 1, None, True),
    ("zai-org/GLM-4.5-Air", "H200:2", 1, None, True),
    ("zai-org/GLM-4.5-Air", "H100-SXM:8", 1, 131072, True),
    ("zai-org/GLM-4.5-Air", "H100-SXM:2", 1, None, False),
    # huggingface.co/blog/mixtral: Mixtral 8x7B needs about 90 GB in half precision (2 x A100 80GB).
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "A100-SXM4-80GB:2", 1, None, True),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "A100-SXM4-80GB:1", 1, None, False),
])
def test_fit_verdicts_on_published_deployments(repo_id, gpus, nodes, length, expected):
    assert fits(repo_id, gpus, nodes=nodes, max_model_len=length) is expected


def test_gpt_oss_20b_fits_a_24_gb_card():
    # huggingface.co/openai/gpt-oss-20b: runs within 16 GB of memory.
    model = inspect_model(str(FIXTURES / "models" / "openai--gpt-oss-20b"))
    for gpus in ("L4:1", "RTX-4090:1", "RTX-3090:1"):
        assert plan(model, parse_gpu_spec(gpus)).tensor_parallel_size == 1


# --- 4. small cards and one 80 GB card for a 70B FP8 checkpoint ----------------------------------------------

def test_a_70b_fp8_checkpoint_gets_a_reduced_plan_on_one_80_gb_card():
    model = inspect_model(str(FIXTURES / "models" / "nvidia--Llama-3.3-70B-Instruct-FP8"))
    result = plan(model, parse_gpu_spec("H100-SXM:1"))
    argv = result.argv
    assert argv[argv.index("--max-num-seqs") + 1] == "64" and argv[argv.index("--max-num-batched-tokens") + 1] == "2048"
    assert result.kv_cache_dtype == "fp8" and result.max_concurrency >= 2  # the chat minimum
    assert result.max_model_len < model.native_max_len
    assert any(w.startswith("reduced plan") for w in result.warnings)
    assert "reduced plan" in result.reasons["--max-num-seqs"]
    # The operator's own batch flags are kept as given, never replaced.
    pinned = plan(model, parse_gpu_spec("H100-SXM:1"), overrides=["--max-num-seqs", "32"])
    assert pinned.argv.count("--max-num-seqs") == 1 and pinned.argv[pinned.argv.index("--max-num-seqs") + 1] == "32"


@pytest.mark.parametrize(("gpus", "kv_dtype"), [("L4:1", "fp8"), ("RTX-4090:1", "fp8"), ("A10:1", "auto"),
                                                ("RTX-3090:1", "auto")])
def test_an_8b_model_on_24_gb_cards_gets_a_shorter_context(gpus, kv_dtype):
    result = plan(spec("Qwen/Qwen3-8B"), parse_gpu_spec(gpus))
    assert result.max_model_len < 40960 and result.max_concurrency >= 2 and result.kv_cache_dtype == kv_dtype
    assert any(w.startswith("context shortened") for w in result.warnings)


def test_rtx_3090_is_in_the_gpu_table():
    gpus = parse_gpu_spec("RTX-3090:2")
    assert (gpus.memory_bytes, gpus.compute_capability, gpus.fp8, gpus.assumed) == (24576 * 2**20, (8, 6), False,
                                                                                     None)


# --- 5. GPUs outside the table --------------------------------------------------------------------------------

def test_an_unknown_gpu_is_planned_without_claims_and_says_what_was_assumed():
    model = inspect_model(str(FIXTURES / "models" / "nvidia--Llama-3.3-70B-Instruct-FP8"))
    result = plan(model, parse_gpu_spec("RTX-A6000:2:48GiB"))
    assert result.kv_cache_dtype == "auto"
    assert any("not in the GPU table" in w and "48.0 GiB" in w for w in result.warnings)
    text = " ".join([*result.warnings, *result.reasons.values()])
    assert "Marlin" not in text and "compute capability 8.0" not in text


# --- 6. quantization formats as their checkpoints publish them ----------------------------------------------

@pytest.mark.parametrize(("quantization_config", "label", "bytes_per_weight"), [
    # huggingface.co/Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4/blob/main/config.json
    ({"bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128, "quant_method": "gptq", "sym": True,
      "true_sequential": True}, "gptq int4", 0.5 + 2.5 / 128),
    # huggingface.co/Qwen/Qwen2.5-7B-Instruct-AWQ/blob/main/config.json
    ({"bits": 4, "group_size": 128, "modules_to_not_convert": None, "quant_method": "awq", "version": "gemm",
      "zero_point": True}, "awq int4", 0.5 + 2.5 / 128),
    # huggingface.co/RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16/blob/main/config.json
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
          "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
     "compressed-tensors int4", 0.5 + 2 / 128),
    # huggingface.co/RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic/blob/main/config.json
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"group_0": {"targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                                          "strategy": "token"}}}},
     "compressed-tensors fp8", 1.0),
    # huggingface.co/unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit/blob/main/config.json
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "llm_int8_skip_modules": None},
     "bitsandbytes nf4", 0.5 + (1 + 4 / 256) / 64),
])
def test_published_quantization_configs_are_costed_as_stored(quantization_config, label, bytes_per_weight):
    dense = spec("meta-llama/Llama-3.3-70B-Instruct")
    quantized = spec("meta-llama/Llama-3.3-70B-Instruct", quantization_config=quantization_config)
    assert quantized.quantization == label and not quantized.notes
    # The embedding and LM head stay at BF16; every linear layer of the body is stored at the format's width.
    body = (dense.weight_bytes - 2 * dense.embedding_bytes) / 2
    assert quantized.weight_bytes == pytest.approx(2 * dense.embedding_bytes + body * bytes_per_weight, rel=1e-6)
