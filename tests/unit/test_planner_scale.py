"""Plans at scale: DP+EP for MoE models (flags, memory per rank, KV per rank, refusal), the multi-node DP
launch, and FP8 KV when the KV cache bounds the plan (chosen, not chosen, and why)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from kimi_service import launcher
from kimi_service.config import parse_config
from kimi_service.errors import UsageError
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import inspect_model
from kimi_service.planner import DoesNotFit, check_spans_nodes, plan, render

KIMI = inspect_model("moonshotai/Kimi-K2.5")
LLAMA_70B_FP8 = inspect_model("tests/fixtures/models/nvidia--Llama-3.3-70B-Instruct-FP8")
QWEN_7B = inspect_model("Qwen/Qwen2.5-7B-Instruct")


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_kimi_chat_on_8_h200_is_data_parallel_attention_with_experts_sharded():
    result = plan(KIMI, parse_gpu_spec("8xH200"))
    argv = result.argv
    assert (flag(argv, "--data-parallel-size"), flag(argv, "--data-parallel-size-local")) == ("8", "8")
    assert flag(argv, "--tensor-parallel-size") == "1" and "--enable-expert-parallel" in argv
    assert "--pipeline-parallel-size" not in argv
    assert (result.data_parallel_size, result.tensor_parallel_size, result.parallelism) == (8, 1, "DP 8 x EP 8")
    # Every rank holds the attention, dense layers and embeddings whole, and an eighth of the routed experts.
    assert KIMI.expert_bytes > 0.9 * KIMI.weight_bytes
    replicated = KIMI.weight_bytes - KIMI.expert_bytes
    assert result.weights_bytes_per_gpu == replicated + math.ceil(KIMI.expert_bytes / 8)
    # Each rank has a KV cache of its own: capacity is 8 caches, and sequences are counted over all ranks.
    per_token = KIMI.kv_bytes_per_token()
    assert result.kv_cache_tokens_per_rank == result.budget.kv_cache_bytes // (per_token * 16) * 16
    assert result.kv_cache_tokens == 8 * result.kv_cache_tokens_per_rank
    assert result.max_concurrency == 8 * (result.kv_cache_tokens_per_rank // result.max_model_len)
    assert all(f in result.reasons for f in argv if f.startswith("--"))
    assert "each DP rank keeps a KV cache of its own" in result.reasons["--data-parallel-size"]


def test_dp_ep_buys_more_kv_than_tp_because_mla_latent_kv_is_replicated_under_tp():
    bf16 = ["--kv-cache-dtype", "auto"]
    dp = plan(KIMI, parse_gpu_spec("8xH200"), overrides=bf16)
    tp = plan(KIMI, parse_gpu_spec("8xH200"), overrides=["--tensor-parallel-size", "8", *bf16])
    assert tp.data_parallel_size == 1 and tp.tensor_parallel_size == 8 and dp.data_parallel_size == 8
    # TP 8 keeps less weight per GPU than DP 8 (attention split 8 ways), yet its one cache is 8 copies.
    assert tp.weights_bytes_per_gpu < dp.weights_bytes_per_gpu
    assert tp.budget.kv_cache_bytes > dp.budget.kv_cache_bytes
    assert dp.kv_cache_tokens > 3 * tp.kv_cache_tokens
    assert dp.max_model_len >= tp.max_model_len


def test_latency_keeps_the_smallest_tensor_parallel_group():
    result = plan(KIMI, parse_gpu_spec("8xH200"), workload="latency")
    assert result.tensor_parallel_size == 8 and result.data_parallel_size == 1
    assert "--data-parallel-size" not in result.argv


def test_a_model_that_leaves_gpus_free_is_not_spread_over_them():
    # MiniMax-M2 serves chat on 2 of 8 H200s: the other 6 are for replicas, not for DP ranks.
    result = plan(inspect_model("MiniMaxAI/MiniMax-M2"), parse_gpu_spec("8xH200"))
    assert result.data_parallel_size == 1 and result.tensor_parallel_size < 8


DP16_OVER_TWO_H200_NODES = {"nodes": 2, "overrides": ["--data-parallel-size", "16"]}


def test_kimi_dp16_over_two_h200_nodes_has_eight_ranks_per_node_and_each_node_launches_its_share():
    result = plan(KIMI, parse_gpu_spec("H200:8"), **DP16_OVER_TWO_H200_NODES)
    assert (result.data_parallel_size, result.data_parallel_size_local) == (16, 8)
    assert (flag(result.argv, "--data-parallel-size"), flag(result.argv, "--data-parallel-size-local")) == ("16", "8")
    check_spans_nodes(result)
    config = {"model": {"path": "/m/kimi"}, "paths": {"state_dir": "/srv/kimi"},
              "cluster": {"addresses": ["10.0.0.1", "10.0.0.2"], "master_port": 29550}}
    leader = launcher.engine_argv(result.argv, "py", 30, parse_config({**config, "cluster": {
        **config["cluster"], "node_rank": 0}}).cluster, data_parallel_local=8)
    follower = launcher.engine_argv(result.argv, "py", 30, parse_config({**config, "cluster": {
        **config["cluster"], "node_rank": 1}}).cluster, data_parallel_local=8)
    rendezvous = ["--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "29550"]
    assert leader[-4:] == rendezvous and "--data-parallel-start-rank" not in leader
    assert follower[-7:] == [*rendezvous, "--data-parallel-start-rank", "8", "--headless"]
    assert follower[:4] == ["py", "-m", "kimi_service.vllm_cli", "serve"]
    assert not {"--nnodes", "--node-rank", "--master-addr"} & set(leader + follower)


def test_a_dp_plan_whose_ranks_do_not_split_evenly_over_the_nodes_is_refused():
    result = plan(KIMI, parse_gpu_spec("H200:8"), **DP16_OVER_TWO_H200_NODES)
    result.data_parallel_size_local = 6
    with pytest.raises(UsageError, match="does not spread evenly over the 2 nodes"):
        check_spans_nodes(result)


def test_dp_ep_that_does_not_fit_is_refused_with_the_weights_per_rank():
    # 8 x A100-80GB: 22 GiB replicated on every rank + 532 GiB of experts / 8 = 88 GiB > 80 GiB.
    with pytest.raises(DoesNotFit) as info:
        plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:8"), overrides=["--data-parallel-size", "8"])
    text = str(info.value)
    assert "does not fit as DP 8 x EP 8 on 8 x A100-SXM4-80GB" in text
    assert "of weights per rank" in text and "split 8 ways" in text
    assert info.value.exit_code == 3
    assert info.value.needed_bytes > info.value.available_bytes == 8 * 80 * 2**30


def test_an_operator_dp_size_is_planned_and_checked():
    result = plan(KIMI, parse_gpu_spec("8xH200"), workload="latency", overrides=["-dp", "8"])
    assert result.data_parallel_size == 8 and "--enable-expert-parallel" in result.argv
    assert result.reasons["--data-parallel-size"].startswith("operator override")
    with pytest.raises(UsageError, match="needs 16 GPUs"):
        plan(KIMI, parse_gpu_spec("8xH200"), overrides=["--data-parallel-size", "16"])
    with pytest.raises(UsageError, match="no experts to shard"):
        plan(QWEN_7B, parse_gpu_spec("H200:2"), overrides=["--data-parallel-size", "2"])


def test_automatic_dp_ep_that_holds_less_stays_tensor_parallel_and_says_why():
    # MiniMax-M2 on 4 x H100: its GQA cache splits over TP ranks, so four DP copies of it hold less.
    result = plan(inspect_model("MiniMaxAI/MiniMax-M2"), parse_gpu_spec("H100-SXM:4"))
    assert result.data_parallel_size == 1 and result.tensor_parallel_size == 4
    assert result.reasons["data-parallel"].startswith("off: DP 4 x EP 4 would hold")


def test_kimi_over_two_h100_nodes_is_tp8_pp2_because_dp_ranks_leave_no_kv():
    # 22 GiB replicated + 532 GiB of experts / 16 = 55 GiB per rank, and the engine's reserve takes the rest.
    result = plan(KIMI, parse_gpu_spec("H100-SXM:8"), nodes=2)
    assert (result.tensor_parallel_size, result.pipeline_parallel_size, result.data_parallel_size) == (8, 2, 1)
    assert result.reasons["data-parallel"].startswith("off: DP 16 x EP 16 needs 55.1 GiB of weights per rank")


def test_the_plan_for_people_shows_parallelism_memory_per_rank_and_kv_per_rank():
    text = render(plan(KIMI, parse_gpu_spec("8xH200")))
    assert "\nparallelism: DP 8 x EP 8\n" in text
    assert "memory per GPU (every DP rank):" in text and "KV cache tokens per rank" in text


def test_fp8_kv_when_the_cache_bounds_the_plan_on_a_gpu_with_fp8():
    # 131,072 tokens of a 70B model on 2 x H100: BF16 KV does not hold the chat minimum, FP8 KV does.
    result = plan(LLAMA_70B_FP8, parse_gpu_spec("H100-SXM:2"), max_model_len=131072)
    assert flag(result.argv, "--kv-cache-dtype") == "fp8" and result.kv_cache_dtype == "fp8"
    why = result.reasons["--kv-cache-dtype"]
    assert why.startswith("KV-bound: with BF16 KV the plan does not fit") and "compute capability 9.0" in why


def test_fp8_kv_when_it_buys_context_on_the_same_group():
    # Kimi K2.5 at TP 8 on 8 x H200: BF16 KV holds chat's 8 sequences only at 65,536 of 262,144 tokens.
    tp8 = ["--tensor-parallel-size", "8"]
    bf16 = plan(KIMI, parse_gpu_spec("8xH200"), overrides=[*tp8, "--kv-cache-dtype", "auto"])
    chat = plan(KIMI, parse_gpu_spec("8xH200"), overrides=tp8)
    assert chat.kv_cache_dtype == "fp8" and chat.tensor_parallel_size == 8
    assert chat.max_model_len > bf16.max_model_len
    assert "KV-bound: with BF16 KV the plan holds" in chat.reasons["--kv-cache-dtype"]


def test_no_fp8_kv_on_ampere_and_the_plan_says_why():
    result = plan(KIMI, parse_gpu_spec("A100-SXM4-80GB:8"), nodes=2)
    assert "--kv-cache-dtype" not in result.argv and result.kv_cache_dtype == "auto"
    assert "A100-SXM4-80GB (compute capability 8.0) has no FP8" in result.reasons["kv-cache-dtype"]


def test_no_fp8_kv_when_the_cache_is_not_the_bound():
    result = plan(QWEN_7B, parse_gpu_spec("H200:1"))
    assert result.max_model_len == QWEN_7B.native_max_len and result.max_concurrency >= 8
    assert "--kv-cache-dtype" not in result.argv and "kv-cache-dtype" not in result.reasons
    assert "--kv-cache-dtype" not in plan(LLAMA_70B_FP8, parse_gpu_spec("H100-SXM:2"), workload="latency").argv


def test_the_operators_kv_dtype_wins():
    result = plan(LLAMA_70B_FP8, parse_gpu_spec("H100-SXM:2"), max_model_len=32768,
                  overrides=["--kv-cache-dtype", "auto"])
    assert result.kv_cache_dtype == "auto" and flag(result.argv, "--kv-cache-dtype") == "auto"
    assert result.argv.count("--kv-cache-dtype") == 1
    assert result.reasons["--kv-cache-dtype"] == "operator override"


def test_a_shortened_context_and_a_plan_over_hosts_are_warnings_not_only_reasons() -> None:
    """Issue: `plan --model moonshotai/Kimi-K2.5 --gpus A100-SXM4-80GB:8 --nodes 2` shortened the context
    and spanned two hosts with `warnings` empty."""
    from kimi_service.cli import main as cli_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["plan", "--model", "moonshotai/Kimi-K2.5", "--gpus", "A100-SXM4-80GB:8", "--nodes", "2",
                         "--json"]) == 0
    warnings = json.loads(out.getvalue())["warnings"]
    shortened = [w for w in warnings if w.startswith("context shortened from the model's 262,144 tokens")]
    assert shortened and "fp8" not in shortened[0], warnings  # A100 has no FP8: not offered
    assert any("over 2 hosts: speed depends on the network" in w for w in warnings), warnings
