"""The workloads a deployment is tuned for, and what each changes in the plan (config and planner share them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    target_concurrency: int  # sequences at max_model_len the KV cache should hold
    # Fewest sequences at max_model_len a plan may hold; below it the planner refuses (a cache for one
    # sequence serves chat one user at a time, and the reserve estimate's error can take it away).
    min_concurrency: int = 1
    prefix_caching: bool = False
    fp8_kv: bool = False
    expert_parallel: bool = False
    why: str
    # Speed flags that win on some hosts and lose on others (the H200 run of docs/benchmarks.md: a
    # --max-num-seqs cap halved throughput at 64 users, an n-gram draft accepted nothing). No plan sets them
    # unmeasured: `kimi-service tune` tries these first for this workload and keeps what measured a win.
    trial_max_num_seqs: int | None = None
    trial_batched_tokens: int | None = None
    trial_speculative: bool = False


PROFILES: dict[str, Workload] = {
    profile.name: profile
    for profile in (
        Workload(
            name="chat", target_concurrency=8, min_concurrency=2, why="interactive chat: vLLM defaults batch well"
        ),
        Workload(
            name="shared-prefix",
            target_concurrency=8,
            min_concurrency=2,
            trial_batched_tokens=16384,
            prefix_caching=True,
            why="many requests share a long system prompt or documents: cache and reuse their KV",
        ),
        Workload(
            name="long-context",
            target_concurrency=1,
            trial_max_num_seqs=16,
            fp8_kv=True,
            why="few very long sequences: the whole native context, KV cache as large as possible",
        ),
        Workload(
            name="latency",
            target_concurrency=2,
            trial_max_num_seqs=32,
            trial_batched_tokens=4096,
            trial_speculative=True,
            why="lowest time per token for few users: small batches, speculative decoding when a draft exists",
        ),
        Workload(
            name="throughput",
            target_concurrency=32,
            min_concurrency=4,
            trial_max_num_seqs=512,
            trial_batched_tokens=16384,
            fp8_kv=True,
            expert_parallel=True,
            why="many concurrent requests: large batches, as many sequences as the KV cache holds",
        ),
    )
}
# The names config.yaml's plan.workload and `plan --workload` accept, in the order help text lists them.
WORKLOADS: tuple[str, ...] = tuple(PROFILES)
