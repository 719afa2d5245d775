"""What `kimi-service tune` measures besides the plan: vLLM's defaults as a reference, and the single speed
changes worth trying for this plan, GPU and workload, likeliest first (the budget may end the list)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kimi_service import catalog
from kimi_service.engine_flags import option_name
from kimi_service.planner.budget import DEFAULT_BATCHED_TOKENS, GPU_MEMORY_UTILIZATION
from kimi_service.tune_stats import Candidate
from kimi_service.tuned import Workload
from kimi_service.workloads import PROFILES

SHORT_PREFILL_TOKENS = 2048  # prefill chunks that keep decode steps short; prompts longer than this are long
LONG_PREFILL_TOKENS = 16384  # and chunks that prefill them in fewer, larger steps
# vLLM 0.21 logs "Asynchronous scheduling is enabled" with no flag given: the candidate would be the
# baseline measured again.
ASYNC_SCHEDULING_DEFAULT_SINCE = (0, 21)
HIGHER_GPU_MEMORY_UTILIZATION = 0.95
# Speculative decoding spends spare compute on guesses: it can pay only while the batch leaves some spare.
SPECULATIVE_MAX_CONCURRENCY = 4
# vLLM 0.21's n-gram proposer (docs.vllm.ai, features/speculative_decoding/n_gram): `method`,
# `num_speculative_tokens` and `prompt_lookup_max` (the longest n-gram matched in the prompt), its example's values.
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
SPECULATIVE_OPTION = "--speculative-config"
HELD_BACK_SPECULATIVE = (
    "speculative decoding: how many guesses are accepted depends on the model's weights and the text, and "
    "tune's prompts are synthetic (a model made with random weights cannot judge it at all); applied only "
    "with kimi-service tune --allow-speculative")
# What `vllm serve MODEL` needs to serve this model here as the plan does: which weights and how they are
# split over the GPUs, how long a context, how much memory, the name, address and key clients use, the
# parsers that shape answers, the MoE kernels that start within the start window (planner/gpu.py), and
# serve's own plumbing. Every other flag is a speed choice, where vLLM's default stands in the reference row.
DEFAULTS_KEEP = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--trust-remote-code", "--tokenizer", "--revision",
    "--chat-template", "--dtype", "--quantization", "--max-model-len", "--gpu-memory-utilization",
    "--kv-cache-memory-bytes", "--kv-cache-dtype", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--data-parallel-size", "--data-parallel-size-local", "--decode-context-parallel-size",
    "--enable-expert-parallel", "--moe-backend", "--tool-call-parser", "--enable-auto-tool-choice",
    "--reasoning-parser", "--shutdown-timeout", "--enable-server-load-tracking", "--middleware",
})
DEFAULTS = Candidate("vllm defaults", (), "vLLM's own speed defaults: the plan's memory and correctness flags "
                     "alone, a reference row", replaces_plan=True, held_back="vLLM's defaults: a reference, "
                     "never applied")


def defaults_argv(argv: Sequence[str], first_flag: int = 3) -> list[str]:
    """The engine's command line (`python -m MODULE --model M FLAGS`) with only the flags in DEFAULTS_KEEP."""
    kept, index = list(argv[:first_flag]), first_flag
    while index < len(argv):
        token = argv[index]
        takes_value = "=" not in token and index + 1 < len(argv) and not argv[index + 1].startswith("--")
        item = list(argv[index:index + 1 + takes_value])
        if option_name(token) in DEFAULTS_KEEP:
            kept += item
        index += len(item)
    return kept


def _version(text: str | None) -> tuple[int, ...]:
    """`0.21.0` -> (0, 21): major and minor; unknown or unparsable reads as the newest."""
    found = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else (10**6,)


def trial_candidates(
    plan: dict[str, Any], workload: Workload, *, gpu_fp8: bool = False, draft: catalog.Speculative | None = None,
    draft_dir: Path | None = None, vllm_max_num_seqs: int | None = None, allow_speculative: bool = False,
) -> list[Candidate]:
    """The single changes worth measuring for this plan and workload; none that the plan already sets.
    `draft` is the catalog's draft model for this model, `draft_dir` where its weights are on this host;
    `vllm_max_num_seqs` vLLM's own default on this GPU (planner.budget.default_max_num_seqs). A speculative
    candidate is measured and reported, and applied only with `allow_speculative`."""
    argv = plan.get("argv") or []
    has = {option_name(token) for token in argv if token.startswith("-")}
    operator = {option_name(token) for token in plan.get("overrides") or [] if token.startswith("-")}
    profile = PROFILES.get(plan.get("workload") or "chat", PROFILES["chat"])
    top = max(workload.concurrency)
    longest_prompt = max(shape.input_len + shape.shared_prefix_len for shape in workload.shapes)
    longest = max(shape.input_len + shape.shared_prefix_len + shape.output_len for shape in workload.shapes)
    cuda = plan.get("engine") == "cuda"
    speculative_held_back = None if allow_speculative else HELD_BACK_SPECULATIVE
    found: list[Candidate] = []

    def add(name: str, flags: tuple[str, ...], why: str, held_back: str | None = None,
            replaces: bool = False) -> None:
        # `replaces`: a flag the plan sets from vLLM's default value, which a candidate may change
        # (never one the operator set).
        blocked = operator if replaces else has
        if option_name(flags[0]) not in blocked and all(c.flags != flags for c in found):
            found.append(Candidate(name, flags, why, held_back=held_back))

    if profile.trial_max_num_seqs:
        add("max-num-seqs", ("--max-num-seqs", str(profile.trial_max_num_seqs)),
            f"the {profile.name} workload's batch size ({profile.why})")
    if profile.trial_batched_tokens:
        add("max-num-batched-tokens", ("--max-num-batched-tokens", str(profile.trial_batched_tokens)),
            f"the {profile.name} workload's prefill chunk ({profile.why})")
    step_bound = ("ITL", workload.slo.itl) if workload.slo.itl else ("TPOT", workload.slo.tpot)
    if step_bound[1] and top > 1 and longest_prompt > SHORT_PREFILL_TOKENS:
        # A decode step that shares its batch with a full default chunk of someone's prompt takes as long
        # as that prefill; with many clients and long prompts that is most steps, and each can break an ITL
        # or TPOT objective. Smaller chunks keep steps short at some cost in time to first token.
        add("short-prefill-chunks", ("--max-num-batched-tokens", str(SHORT_PREFILL_TOKENS)),
            f"prompts of up to {longest_prompt:,} tokens prefilled {SHORT_PREFILL_TOKENS:,} at a time (vLLM's "
            f"default chunk is {DEFAULT_BATCHED_TOKENS:,}): decode steps that share a batch with a prefill stay "
            f"short, for the SLO's {step_bound[0]} <= {step_bound[1]} s")
    held = plan.get("kv_cache_tokens", 0) // longest
    if vllm_max_num_seqs and min(top, held) > vllm_max_num_seqs:
        # A closed loop of no more clients than the default batch admits them all already.
        add("max-num-seqs-above-default", ("--max-num-seqs", str(min(top, held))),
            f"{top} clients, and the KV cache holds {held:,} sequences of {longest:,} tokens: a batch of "
            f"{min(top, held)} where vLLM's default admits {vllm_max_num_seqs} and queues the rest")
    if cuda and top < 512:
        add("cuda-graphs-to-load", ("--max-cudagraph-capture-size", str(max(top, 8))),
            f"CUDA graphs captured only up to the {top} clients: a faster start, more KV cache")
    add("max-num-seqs-at-load", ("--max-num-seqs", str(max(top, 8))),
        f"batches no larger than the {top} clients: smaller activation reserve, more KV cache")
    if longest_prompt >= SHORT_PREFILL_TOKENS:
        add("long-prefill-chunks", ("--max-num-batched-tokens", str(LONG_PREFILL_TOKENS)),
            "long prompts: fewer, larger prefill chunks")
    if cuda:
        if _version(plan.get("vllm_version")) < ASYNC_SCHEDULING_DEFAULT_SINCE:
            add("async-scheduling", ("--async-scheduling",), "schedules the next step while the GPU runs this one")
        if gpu_fp8 and plan.get("kv_cache_dtype") in (None, "auto") and \
                plan.get("kv_cache_tokens", 0) < top * longest * 2:
            add("fp8-kv-cache", ("--kv-cache-dtype", "fp8"),
                "the KV cache bounds this workload: FP8 halves its bytes per token")
    single_gpu_stages = plan.get("pipeline_parallel_size", 1) == 1
    if draft and draft_dir is not None and single_gpu_stages:
        config = {"model": str(draft_dir), "method": draft.method,
                  "num_speculative_tokens": draft.num_speculative_tokens}
        add("speculative", (SPECULATIVE_OPTION, json.dumps(config, separators=(",", ":"))),
            f"{draft.method} draft {draft.model} ({draft.source})", speculative_held_back)
    if cuda and single_gpu_stages and min(workload.concurrency) <= SPECULATIVE_MAX_CONCURRENCY:
        add("ngram-speculative", (SPECULATIVE_OPTION, json.dumps(NGRAM_CONFIG, separators=(",", ":"))),
            f"at {min(workload.concurrency)} client(s) a decode step leaves the GPU spare compute: up to "
            f"{NGRAM_CONFIG['num_speculative_tokens']} tokens guessed from n-grams of the prompt, checked in one step "
            "(no draft model; a model made with random weights cannot judge how many are accepted)",
            speculative_held_back)
    if cuda and (why := _more_gpu_memory_why(plan)):
        add("gpu-memory-utilization", ("--gpu-memory-utilization", f"{HIGHER_GPU_MEMORY_UTILIZATION:.2f}"), why,
            replaces=True)
    return found


def _more_gpu_memory_why(plan: dict[str, Any]) -> str | None:
    """What a larger share of each GPU buys, where the plan kept vLLM's share (None elsewhere)."""
    budget = plan.get("budget") or {}
    if plan.get("gpu_memory_utilization") != GPU_MEMORY_UTILIZATION or not budget.get("kv_cache_bytes"):
        return None
    more = HIGHER_GPU_MEMORY_UTILIZATION - GPU_MEMORY_UTILIZATION
    tokens = round(plan.get("kv_cache_tokens", 0) * more * budget["total_bytes"] / budget["kv_cache_bytes"])
    return (f"{more:.0%} more of each GPU for the KV cache (about {tokens:,} tokens) than vLLM's default "
            f"{GPU_MEMORY_UTILIZATION:.2f}: tune runs with the service stopped, so the engine is the GPU's one "
            "user; on a GPU another process holds memory on, vLLM refuses to start with it and it loses")
