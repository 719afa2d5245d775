"""When a model does not fit: how much memory it needs, what is there, and what would fit instead."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from kimi_service import catalog
from kimi_service.hardware import inventory_of, known_gpu
from kimi_service.model import spec_from_catalog
from kimi_service.planner.budget import memory_budget
from kimi_service.planner.fit import (
    LONG_PREFILL_TOKENS,
    DoesNotFit,
    Problem,
    candidates,
    floor_len,
    knobs_for,
    layout_label,
    long_prefill,
    sequence_bytes,
)
from kimi_service.planner.layout import choose
from kimi_service.planner.overrides import Overrides
from kimi_service.planner.render import gib, size

LARGER_GPUS = ("H200", "B200")


def _layout_if_fits(problem: Problem) -> str | None:
    """The layout (`TP 8 x PP 2`, `DP 8 x EP 8`) the planner would plan without overrides, else None."""
    found = choose(replace(problem, overrides=Overrides()))
    return layout_label(problem.model, found) if found else None


def _flag_changes(problem: Problem) -> Iterator[str]:
    """Flags that make it fit on the same hardware, cheapest first: FP8 KV where the GPU has FP8 (half
    the cache per token), no CUDA graphs (their memory back, some decode speed lost), both."""
    knobs = knobs_for(problem)
    options: list[tuple[tuple[tuple[str, str | None], ...], str]] = []
    if problem.gpus.fp8 and knobs.kv_dtype == "auto":
        options.append(((("--kv-cache-dtype", "fp8"),), f"FP8 KV halves the cache per token ({problem.gpus.name} "
                        "has FP8)"))
    if not knobs.enforce_eager:
        options.append(((("--enforce-eager", None),), "no CUDA graphs: their memory goes to the KV cache, at some "
                        "decode speed"))
    if len(options) == 2:
        options.append((options[0][0] + options[1][0], f"{options[0][1]}; {options[1][1]}"))
    for pairs, why in options:
        fit = choose(replace(problem, overrides=Overrides(problem.overrides.pairs + pairs)))
        if fit is not None:
            flags = " ".join(flag if value is None else f"{flag} {value}" for flag, value in pairs)
            yield (
                f"{flags} on this hardware ({layout_label(problem.model, fit)}, {fit.max_model_len:,}-token context, "
                f"{fit.max_concurrency} sequence(s)): {why}"
            )
            return


def _more_gpus(problem: Problem) -> Iterator[str]:
    gpus = problem.gpus
    for count in (2, 4, 8):
        if count > gpus.count and (layout := _layout_if_fits(replace(problem, gpus=gpus.with_count(count), nodes=1))):
            yield f"{count} x {gpus.name} ({layout})"
            return


def _more_nodes(problem: Problem) -> Iterator[str]:
    per_node = max(problem.gpus.count, 8)
    node = problem.gpus.with_count(per_node)
    for more in range(max(problem.nodes, 1) + 1, 5):
        if layout := _layout_if_fits(replace(problem, gpus=node, nodes=more)):
            yield f"{more} nodes x {per_node} x {problem.gpus.name} ({layout})"
            return


def _larger_gpus(problem: Problem) -> Iterator[str]:
    for name in LARGER_GPUS:
        table = known_gpu(name)
        if table is None or table.name == problem.gpus.name:
            continue
        for count in (1, 2, 4, 8):
            if layout := _layout_if_fits(replace(problem, gpus=inventory_of(table, count), nodes=1)):
                yield f"{count} x {table.name} ({layout})"
                return


def _other_models(problem: Problem, found: list[str]) -> list[str]:
    """A quantized variant of the same family, and the largest smaller catalog model not named yet, that fit."""
    model, family = problem.model, problem.entry
    smaller = sorted(
        (e for e in catalog.ENTRIES if e.repo_id != model.catalog_name and e.weight_bytes < model.weight_bytes),
        key=lambda e: -e.weight_bytes,
    )

    def fits(entry: catalog.CatalogEntry) -> bool:
        other = replace(problem, model=spec_from_catalog(entry), entry=entry, requested_len=None)
        return _layout_if_fits(other) is not None

    result: list[str] = []
    for entry in smaller:
        if family and entry.family == family.family and spec_from_catalog(entry).quantization and fits(entry):
            result.append(f"{entry.repo_id} on this hardware (a quantized variant, {size(entry.weight_bytes)})")
            break
    for entry in smaller:
        if fits(entry) and not any(entry.repo_id in s for s in [*found, *result]):
            result.append(f"{entry.repo_id} on this hardware (a smaller catalog model, {size(entry.weight_bytes)})")
            break
    return result


def suggestions(problem: Problem) -> list[str]:
    """Configurations that would serve this model (or a catalog alternative that fits this hardware)."""
    result = list(_flag_changes(problem))
    result.extend(list(_more_gpus(problem)) or _more_nodes(problem))
    result.extend(_larger_gpus(problem))
    result.extend(_other_models(problem, found=result))
    return result


def does_not_fit(problem: Problem) -> DoesNotFit:
    """The error for a model no candidate group serves, sized at the largest group that was tried."""
    model, gpus, nodes = problem.model, problem.gpus, problem.nodes
    knobs = knobs_for(problem)
    groups = candidates(problem)
    if not groups:
        return DoesNotFit(
            f"no tensor-parallel size up to {gpus.count} divides {model.name}'s {model.num_attention_heads} attention "
            f"heads and {model.num_kv_heads} KV heads",
            needed_bytes=0,
            available_bytes=gpus.total_memory_bytes * nodes,
            suggestions=suggestions(problem),
        )
    largest = max(groups, key=lambda group: group.gpus)
    length = problem.requested_len or floor_len(model)
    if model.dual_chunk_attention and length > LONG_PREFILL_TOKENS:
        knobs = long_prefill(knobs, problem.overrides)
    budget = memory_budget(model, gpus, largest, knobs)
    least = max(problem.profile.min_concurrency, 1)
    kv_needed = sequence_bytes(model, largest, knobs, length) * least
    per_gpu = budget.weights_bytes + budget.reserve_bytes + kv_needed
    needed = math.ceil(per_gpu * largest.gpus / knobs.utilization)
    available = gpus.memory_bytes * largest.gpus
    sequences = "one" if least == 1 else f"{least} (the {problem.profile.name} workload's minimum)"
    message = (
        f"{model.name} does not fit on {problem.hardware}: it needs about {size(needed)} of GPU memory "
        f"(weights {size(model.weight_bytes)} + per-GPU reserve {gib(budget.reserve_bytes)} + KV cache for "
        f"{sequences} {length:,}-token sequence(s), at --gpu-memory-utilization {knobs.utilization:.2f}, "
        f"{largest.describe()}), but the {largest.gpus} GPU(s) have {size(available)}."
    )
    return DoesNotFit(message, needed_bytes=needed, available_bytes=available, suggestions=suggestions(problem))
