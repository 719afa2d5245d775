"""plan(): memory budget, parallelism, context length, workloads, overrides, DoesNotFit."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimi_service import catalog
from kimi_service.errors import UsageError
from kimi_service.hardware import GIB, KNOWN_GPUS, GpuInventory, inventory_of, parse_gpu_spec
from kimi_service.model import inspect_model, spec_from_catalog, spec_from_config
from kimi_service.planner import DoesNotFit, plan, valid_tensor_parallel
from kimi_service.planner.budget import DRAFT_BYTES, MLA_RESERVE_BYTES
from kimi_service.workloads import PROFILES, WORKLOADS

KIMI = inspect_model("moonshotai/Kimi-K2.5")
LLAMA_8B = inspect_model("meta-llama/Llama-3.1-8B-Instruct")
LLAMA_70B = inspect_model("meta-llama/Llama-3.1-70B-Instruct")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_articles_setup_does_not_fit_and_says_what_would():
    with pytest.raises(DoesNotFit) as info:
        plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:4"))
    error = info.value
    assert error.exit_code == 3
    assert error.available_bytes == 4 * 80 * GIB
    assert error.needed_bytes > KIMI.weight_bytes > error.available_bytes
    text = str(error)
    assert "320.0 GiB" in text and "595 GB" in text
    assert "2 nodes x 8 x A100-SXM4-80GB (TP 8 x PP 2)" in error.suggestions
    # The layout the advice names is the one the planner then plans there (DP 8 x EP 8 for chat).
    assert f"8 x H200 ({plan(KIMI, parse_gpu_spec('8xH200')).parallelism})" in error.suggestions


def test_kimi_on_8_h200_follows_the_recipe():
    # The recipe's TP 8 is the latency plan; chat and throughput go DP+EP (tests/unit/test_planner_scale.py).
    result = plan(KIMI, parse_gpu_spec("8xH200"), workload="latency", model_path="/var/lib/kimi-service/models/k25")
    argv = result.argv
    assert argv[:3] == ["vllm", "serve", "/var/lib/kimi-service/models/k25"]
    assert flag(argv, "--tensor-parallel-size") == "8" and "--data-parallel-size" not in argv
    assert flag(argv, "--tool-call-parser") == "kimi_k2" and flag(argv, "--reasoning-parser") == "kimi_k2"
    assert "--trust-remote-code" in argv and "--enable-auto-tool-choice" in argv
    assert flag(argv, "--served-model-name") == "moonshotai/Kimi-K2.5"
    assert result.max_model_len <= KIMI.native_max_len
    assert result.max_concurrency >= 2
    assert result.kv_cache_tokens == result.budget.kv_cache_bytes // (70272 * 16) * 16
    assert all(f in result.reasons for f in argv if f.startswith("--"))


def test_kv_capacity_matches_what_vllm_reported_on_the_h200():
    # The tiny Llama of the H200 run: 2,048 bytes of KV per token, --gpu-memory-utilization 0.5;
    # vLLM reported 69.36 GiB available and 36,363,872 tokens.
    tiny = spec_from_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 2048,
            "max_position_embeddings": 2048,
            "torch_dtype": "bfloat16",
        },
        name="tiny",
        weight_bytes=None,
        weight_bytes_source="",
        source="test",
    )
    assert tiny.kv_bytes_per_token() == 2048
    result = plan(tiny, parse_gpu_spec("H200:1"), overrides=["--gpu-memory-utilization", "0.5"])
    assert result.kv_cache_tokens == pytest.approx(36_363_872, rel=0.01)
    # Never more optimistic than vLLM: the plan must not promise tokens that are not there.
    assert result.kv_cache_tokens <= 36_363_872
    assert flag(result.argv, "--gpu-memory-utilization") == "0.5"


# The MLA + MoE shape of bench/gpu/mla_model.py (DeepSeek-V3 widths, 8 layers, 32 routed experts), which
# vLLM 0.21.0 served on the H200 with random weights (bench/gpu/mla_kv.sh).
MLA_MOE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
    "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 8, "first_k_dense_replace": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 32,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "vocab_size": 129280,
    "max_position_embeddings": 163840,
}
MLA_MOE = spec_from_config(MLA_MOE_CONFIG, name="mla-moe", weight_bytes=None, weight_bytes_source="", source="test")
# vLLM's `GPU KV cache size` for that model on one GPU, started with each plan's argv (bench/gpu/mla_kv.sh;
# the H100's logs are in docs/gpu-validation/h100-2026-12-05-mla-kv/).
BIG_BATCH = ("--max-num-batched-tokens", "16384", "--max-num-seqs", "512")
MEASURED_MLA_KV_TOKENS = {
    ("H200:1", ()): 10_340_336,
    ("H200:1", ("--enforce-eager",)): 10_812_288,
    ("H200:1", BIG_BATCH): 10_049_872,
    ("H100-SXM:1", ()): 3_983_664,
    ("H100-SXM:1", ("--enforce-eager",)): 4_455_616,
    ("H100-SXM:1", BIG_BATCH): 3_693_184,
}


@pytest.mark.parametrize(("gpu", "overrides"), list(MEASURED_MLA_KV_TOKENS),
                         ids=[f"{gpu}-{'-'.join(o)[2:13] or 'chat'}" for gpu, o in MEASURED_MLA_KV_TOKENS])
def test_mla_kv_prediction_is_within_two_percent_below_what_vllm_allocated(gpu, overrides):
    assert MLA_MOE.kv_bytes_per_token() == 8 * (512 + 64) * 2
    predicted = plan(MLA_MOE, parse_gpu_spec(gpu), max_model_len=32768, overrides=list(overrides)).kv_cache_tokens
    assert -0.02 <= predicted / MEASURED_MLA_KV_TOKENS[gpu, overrides] - 1 <= 0


# The same model at 4 and 16 layers on the H100 (docs/gpu-validation/h100-2026-12-06-mla-layers/): the fixed
# terms (graphs, reserve) do not grow with depth, so the planner stays the same few hundred MiB under vLLM.
MEASURED_MLA_KV_TOKENS_BY_DEPTH = {
    (4, ()): 10_805_392,
    (4, ("--enforce-eager",)): 11_760_656,
    (16, ()): 563_936,
    (16, ("--enforce-eager",)): 803_088,
}


@pytest.mark.parametrize(("layers", "overrides"), list(MEASURED_MLA_KV_TOKENS_BY_DEPTH),
                         ids=[f"{n}l-{'-'.join(o)[2:] or 'chat'}" for n, o in MEASURED_MLA_KV_TOKENS_BY_DEPTH])
def test_mla_kv_prediction_holds_from_4_to_16_layers_within_half_a_gib_below_vllm(layers, overrides):
    config = {**MLA_MOE_CONFIG, "num_hidden_layers": layers}
    spec = spec_from_config(config, name=f"mla-moe-{layers}l", weight_bytes=None, weight_bytes_source="",
                            source="test")
    predicted = plan(spec, parse_gpu_spec("H100-SXM:1"), max_model_len=32768, overrides=list(overrides))
    under_bytes = (MEASURED_MLA_KV_TOKENS_BY_DEPTH[layers, overrides] - predicted.kv_cache_tokens) \
        * spec.kv_bytes_per_token()
    assert 0 <= under_bytes <= 0.5 * 2**30


def test_mla_models_reserve_the_mla_engine_memory():
    result = plan(MLA_MOE, parse_gpu_spec("H200:1"), max_model_len=32768)
    budget = result.budget
    assert budget.extra_bytes == MLA_RESERVE_BYTES and "MLA" in result.reasons["--gpu-memory-utilization"]
    assert budget.kv_cache_bytes == budget.usable_bytes - budget.weights_bytes - budget.reserve_bytes
    assert plan(LLAMA_8B, parse_gpu_spec("H200:1")).budget.extra_bytes == 0


def test_tp_never_splits_heads_unevenly():
    # Llama 8B has 32 heads, 8 KV heads: on 6 GPUs TP is 1, 2 or 4, never 3 or 6.
    assert [t for t in range(1, 9) if valid_tensor_parallel(LLAMA_8B, t)] == [1, 2, 4, 8]
    forced = plan(LLAMA_70B, parse_gpu_spec("L40S:6"))
    assert forced.tensor_parallel_size in (1, 2, 4)


def test_smallest_tp_with_a_useful_batch():
    assert plan(LLAMA_70B, parse_gpu_spec("A100-SXM4-80GB:4")).tensor_parallel_size == 4
    assert plan(LLAMA_8B, parse_gpu_spec("A100-SXM4-80GB:8")).tensor_parallel_size == 1


def test_pipeline_parallel_spans_nodes():
    result = plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2, workload="latency")
    assert (result.tensor_parallel_size, result.pipeline_parallel_size) == (8, 2)
    assert flag(result.argv, "--pipeline-parallel-size") == "2"


def test_fp8_kv_cache_only_where_the_gpu_has_fp8():
    hopper = plan(LLAMA_8B, parse_gpu_spec("H100-SXM:1"), workload="long-context")
    ampere = plan(LLAMA_8B, parse_gpu_spec("A100-SXM4-80GB:1"), workload="long-context")
    assert flag(hopper.argv, "--kv-cache-dtype") == "fp8"
    assert "--kv-cache-dtype" not in ampere.argv
    assert hopper.max_model_len == LLAMA_8B.native_max_len


def test_fp8_weights_on_a100_warn_about_weight_only_kernels():
    minimax = inspect_model("MiniMaxAI/MiniMax-M2")
    result = plan(minimax, parse_gpu_spec("A100-SXM4-80GB:4"))
    assert any("Marlin" in w for w in result.warnings)
    assert not any("Marlin" in w for w in plan(minimax, parse_gpu_spec("H200:4")).warnings)


def test_fp8_block_experts_that_tp_cannot_split_get_expert_parallel():
    minimax = inspect_model("MiniMaxAI/MiniMax-M2")
    result = plan(minimax, parse_gpu_spec("A100-SXM4-40GB:8"))
    assert result.tensor_parallel_size == 8
    assert "--enable-expert-parallel" in result.argv
    assert result.expert_parallel and result.parallelism == "TP 8 with EP 8"


def test_expert_parallel_needs_tp_or_dp_ranks_to_spread_experts_over():
    # Throughput asks for whole experts per GPU, but TP 1 x PP 2 has one rank per stage: vLLM's EP size is
    # TP x DP = 1 there (docs.vllm.ai, Expert Parallel Deployment), so the flag would do nothing.
    minimax = inspect_model("MiniMaxAI/MiniMax-M2")
    result = plan(minimax, parse_gpu_spec("B200:1"), nodes=2, workload="throughput")
    assert (result.tensor_parallel_size, result.pipeline_parallel_size) == (1, 2)
    assert "--enable-expert-parallel" not in result.argv and result.parallelism == "TP 1 x PP 2"
    assert result.reasons["expert-parallel"].startswith("off: TP 1 has no ranks")


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_no_workload_sets_a_speed_flag_that_can_lose_until_measured(workload):
    result = plan(LLAMA_8B, parse_gpu_spec("H100-SXM:1"), workload=workload)
    for losing in ("--max-num-seqs", "--max-num-batched-tokens", "--speculative-config"):
        assert losing not in result.argv
    profile = PROFILES[workload]
    for name, value in (("max-num-seqs", profile.trial_max_num_seqs),
                        ("max-num-batched-tokens", profile.trial_batched_tokens)):
        assert (value is None) == (name not in result.reasons)
        if value:
            assert f"{value}" in result.reasons[name] and "kimi-service tune" in result.reasons[name]
    assert ("--enable-prefix-caching" in result.argv) == profile.prefix_caching


def test_latency_names_the_draft_the_tuner_tries_and_an_operators_draft_gets_its_memory():
    h100 = parse_gpu_spec("H100-SXM:1")
    latency = plan(LLAMA_8B, h100, workload="latency")
    draft = catalog.get(LLAMA_8B.name).speculative
    assert draft.method == "eagle3" and draft.model in latency.reasons["speculative"]
    spanning = plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2, workload="latency")
    assert spanning.pipeline_parallel_size == 2 and "pipeline" in spanning.reasons["speculative"]
    config = json.dumps({"model": draft.model, "method": draft.method, "num_speculative_tokens": 3})
    asked = plan(LLAMA_8B, h100, workload="latency", overrides=["--speculative-config", config])
    assert asked.argv[-2:] == ["--speculative-config", config] and "speculative" not in asked.reasons
    assert asked.budget.extra_bytes - latency.budget.extra_bytes == DRAFT_BYTES
    assert asked.kv_cache_tokens < latency.kv_cache_tokens


def test_unknown_workload_is_a_usage_error():
    with pytest.raises(UsageError, match="long-context"):
        plan(LLAMA_8B, parse_gpu_spec("H200:1"), workload="fast")


def test_requested_context_is_honoured_or_refused():
    result = plan(LLAMA_8B, parse_gpu_spec("L4:1"), max_model_len=8192)
    assert result.max_model_len == 8192
    above = plan(LLAMA_8B, parse_gpu_spec("H200:1"), max_model_len=10**6)
    assert above.max_model_len == LLAMA_8B.native_max_len and any(
        "native context" in w for w in above.warnings
    )
    with pytest.raises(DoesNotFit):
        plan(LLAMA_70B, parse_gpu_spec("A100-SXM4-80GB:2"), max_model_len=131072)


def test_overrides_beat_tuned_values_and_are_reported():
    result = plan(
        LLAMA_8B,
        parse_gpu_spec("H200:2"),
        overrides=["--max-model-len=16384", "--enforce-eager", "--tensor-parallel-size", "2"],
    )
    assert result.argv.count("--max-model-len") == 1 and flag(result.argv, "--max-model-len") == "16384"
    assert result.argv[-5:] == ["--max-model-len", "16384", "--enforce-eager", "--tensor-parallel-size", "2"]
    assert result.tensor_parallel_size == 2 and result.max_model_len == 16384
    assert result.reasons["--max-model-len"].startswith("operator override")
    assert result.budget.cuda_graph_bytes == 0


def test_secrets_never_reach_argv():
    with pytest.raises(UsageError, match="0600"):
        plan(LLAMA_8B, parse_gpu_spec("H200:1"), overrides=["--api-key", "sk-secret"])


def test_cpu_engine_plan():
    result = plan(spec_from_catalog(catalog.get("Qwen/Qwen2.5-7B-Instruct")), GpuInventory.cpu(64 * GIB))
    assert result.engine == "cpu" and result.gpu_memory_utilization is None
    assert "--tensor-parallel-size" not in result.argv and flag(result.argv, "--dtype") == "bfloat16"
    space = int(result.env["VLLM_CPU_KVCACHE_SPACE"])
    assert 1 <= space <= 32
    assert result.max_model_len <= 4096
    with pytest.raises(DoesNotFit, match="RAM"):
        plan(LLAMA_70B, GpuInventory.cpu(24 * GIB))


def test_cpu_kv_cache_stays_within_what_the_engine_accepts():
    # vLLM's CPU engine refused 8 GiB of KV on a NUMA node of 16.96 GiB: it accepts about half the node.
    node = 64 * GIB
    result = plan(spec_from_catalog(catalog.get("Qwen/Qwen2.5-7B-Instruct")), GpuInventory.cpu(node))
    kv = int(result.env["VLLM_CPU_KVCACHE_SPACE"]) * GIB
    assert 1 * GIB <= kv <= 0.5 * node - result.weights_bytes_per_gpu


def test_cpu_kv_cache_override_drives_the_prediction_and_drops_the_variable():
    tiny = spec_from_catalog(catalog.get("Qwen/Qwen2.5-7B-Instruct"))
    result = plan(tiny, GpuInventory.cpu(64 * GIB), overrides=["--kv-cache-memory-bytes", "256M"])
    assert "VLLM_CPU_KVCACHE_SPACE" not in result.env
    assert result.kv_cache_tokens == 256 * 2**20 // tiny.kv_bytes_per_token()
    with pytest.raises(UsageError, match="byte count"):
        plan(tiny, GpuInventory.cpu(64 * GIB), overrides=["--kv-cache-memory-bytes", "lots"])


RENTALS = ["A100-SXM4-80GB:1", "A100-SXM4-80GB:4", "A100-SXM4-80GB:8", "H200:8"]


@pytest.mark.parametrize("entry", catalog.ENTRIES, ids=lambda e: e.repo_id)
def test_every_catalog_model_has_a_plan_on_some_rental(entry):
    spec = spec_from_catalog(entry)
    for rental in RENTALS:
        try:
            result = plan(spec, parse_gpu_spec(rental))
        except DoesNotFit:
            continue
        assert result.fits and result.kv_cache_tokens >= result.max_model_len
        break
    else:
        result = plan(spec, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2)
        assert result.pipeline_parallel_size == 2


SPECS = [spec_from_catalog(e) for e in catalog.ENTRIES]


@settings(max_examples=150, deadline=None)
@given(
    model=st.sampled_from(SPECS),
    gpu=st.sampled_from(KNOWN_GPUS),
    count=st.sampled_from([1, 2, 3, 4, 6, 8]),
    nodes=st.integers(min_value=1, max_value=3),
    workload=st.sampled_from(["chat", "shared-prefix", "long-context", "latency", "throughput"]),
)
def test_plans_never_exceed_the_memory_they_claim(model, gpu, count, nodes, workload):
    gpus = inventory_of(gpu, count)
    try:
        result = plan(model, gpus, nodes=nodes, workload=workload)
    except DoesNotFit as error:
        assert error.needed_bytes > 0 and error.available_bytes > 0
        return
    budget = result.budget
    assert budget.used_bytes <= budget.usable_bytes <= budget.total_bytes == gpus.memory_bytes
    assert model.num_attention_heads % result.tensor_parallel_size == 0
    if model.attention == "gqa":
        kv, tp = model.num_kv_heads, result.tensor_parallel_size
        assert kv % tp == 0 if kv >= tp else tp % kv == 0
    assert result.tensor_parallel_size <= count and result.pipeline_parallel_size <= nodes
    if result.kv_cache_dtype == "fp8":
        assert gpus.fp8
    per_token = model.kv_bytes_per_token(
        result.tensor_parallel_size, result.pipeline_parallel_size, 1 if result.kv_cache_dtype == "fp8" else 0
    )
    assert result.kv_cache_tokens_per_rank * per_token <= budget.kv_cache_bytes
    assert result.kv_cache_tokens == result.kv_cache_tokens_per_rank * result.data_parallel_size
    assert result.max_model_len <= min(model.native_max_len, result.kv_cache_tokens_per_rank)
    if result.data_parallel_size > 1:
        assert model.is_moe and "--enable-expert-parallel" in result.argv and result.pipeline_parallel_size == 1
        assert result.data_parallel_size * result.tensor_parallel_size <= count * nodes


@settings(max_examples=60, deadline=None)
@given(
    heads=st.sampled_from([8, 12, 28, 32, 40, 48, 64, 96]),
    kv=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(min_value=1, max_value=8),
)
def test_tp_divides_heads_for_any_shape(heads, kv, count):
    model = spec_from_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": heads * 64,
            "intermediate_size": heads * 128,
            "num_hidden_layers": 8,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": 32000,
            "max_position_embeddings": 8192,
        },
        name="shape",
        weight_bytes=None,
        weight_bytes_source="",
        source="test",
    )
    try:
        result = plan(model, inventory_of(KNOWN_GPUS[0], count))
    except DoesNotFit:
        return
    tp = result.tensor_parallel_size
    assert heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)


def test_unquantized_experts_run_on_triton_and_quantized_ones_are_left_to_vllm():
    h100 = parse_gpu_spec("H100:1")
    result = plan(MLA_MOE, h100)
    assert MLA_MOE.quantization is None and flag(result.argv, "--moe-backend") == "triton"
    assert "CUTLASS" in result.reasons["--moe-backend"]
    fp8_quantization = catalog.get("deepseek-ai/DeepSeek-V3").config["quantization_config"]
    fp8_config = {**MLA_MOE_CONFIG, "quantization_config": fp8_quantization}
    fp8 = spec_from_config(fp8_config, name="mla-moe-fp8", weight_bytes=None, weight_bytes_source="", source="test")
    assert fp8.quantization == "fp8" and "--moe-backend" not in plan(fp8, h100).argv
    assert "--moe-backend" not in plan(LLAMA_8B, h100).argv
    overridden = plan(MLA_MOE, h100, overrides=["--moe-backend", "flashinfer_cutlass"])
    assert overridden.argv[-2:] == ["--moe-backend", "flashinfer_cutlass"]
    assert overridden.argv.count("--moe-backend") == 1
