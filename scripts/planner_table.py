#!/usr/bin/env python3
"""Write docs/planner-verdicts.md: the planner's verdict for the article's setup and common rentals.

Run from the repository root: `PYTHONPATH=. .venv/bin/python scripts/planner_table.py` (or `--check` to
fail when the committed table is out of date). PYTHONPATH=. makes it plan with this checkout's
kimi_service, whichever checkout the virtual environment was installed from.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kimi_service import catalog
from kimi_service.hardware import parse_gpu_spec
from kimi_service.model import ModelSpec, inspect_model, spec_from_catalog, spec_from_config
from kimi_service.planner import DoesNotFit, Plan, plan
from kimi_service.planner.budget import Parallelism

RENTALS = (
    ("4 x A100-80GB (the article)", "A100-SXM4-80GB:4", 1),
    ("1 x A100-80GB", "A100-SXM4-80GB:1", 1),
    ("8 x A100-80GB", "A100-SXM4-80GB:8", 1),
    ("8 x H200", "8xH200", 1),
    ("2 nodes x 8 x A100-80GB", "A100-SXM4-80GB:8", 2),
)
# Published checkpoints planned from their config.json (tests/fixtures/models), on the rentals they fit.
CHECKPOINTS = (
    "openai/gpt-oss-20b",
    "openai/gpt-oss-120b",
    "nvidia/Llama-3.3-70B-Instruct-FP8",
    "nvidia/Llama-3.3-70B-Instruct-FP4",
    "Qwen/Qwen2.5-7B-Instruct+yarn4",
    "Qwen/Qwen2.5-7B-Instruct-1M",
    "google/gemma-3-27b-it",
)
# Published configs without a fixture directory: the fields the planner reads, from
# tests/fixtures/published_configs.json (each with its config.json's URL).
PUBLISHED_CONFIGS = Path("tests/fixtures/published_configs.json")
PUBLISHED = (
    "Qwen/Qwen3-8B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "Qwen/Qwen3-235B-A22B-Instruct-2507-FP8",
    "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "zai-org/GLM-4.5-Air",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
)
CHECKPOINT_RENTALS = (
    ("1 x RTX 4090 (24 GB)", "RTX-4090:1", None),
    ("1 x H100-80GB", "H100-SXM:1", None),
    ("2 x H100-80GB", "H100-SXM:2", None),
    ("1 x H200", "H200:1", None),
    ("2 x H100-80GB, full context", "H100-SXM:2", "native"),
)
# Kimi K2.5 at scale: each layout the planner can give it on the rentals that hold it.
SCALE_MODEL = "moonshotai/Kimi-K2.5"
SCALE_RENTALS = (
    ("8 x H200", "8xH200", 1),
    ("2 nodes x 8 x H100-80GB", "H100-SXM:8", 2),
    ("2 nodes x 8 x A100-80GB", "A100-SXM4-80GB:8", 2),
)
FIXTURES = Path("tests/fixtures/models")
OUTPUT = Path("docs/planner-verdicts.md")


def verdict(repo_id: str, gpus_spec: str, nodes: int) -> str:
    return _cell(spec_from_catalog(catalog.get(repo_id)), gpus_spec, nodes=nodes)


def _cell(spec: ModelSpec, gpus_spec: str, *, nodes: int = 1, length: int | None = None) -> str:
    try:
        result = plan(spec, parse_gpu_spec(gpus_spec), nodes=nodes, max_model_len=length)
    except DoesNotFit as error:
        return (
            f"no: needs ~{error.needed_bytes / 2**30:,.0f} GiB, has {error.available_bytes / 2**30:,.0f} GiB"
        )
    layout = result.parallelism
    if result.kv_cache_dtype != "auto":
        layout += f", {result.kv_cache_dtype} KV"
    return f"yes: {layout}, {result.max_model_len // 1024}K ctx, {result.max_concurrency} seqs"


def _layouts(gpus: str, nodes: int) -> tuple[list[str], list[str]]:
    """TP x PP as the planner splits it over the nodes, and DP+EP over every GPU (operator flags)."""
    count = parse_gpu_spec(gpus).count
    tp = ["--tensor-parallel-size", str(count)] + (["--pipeline-parallel-size", str(nodes)] if nodes > 1 else [])
    return tp, ["--data-parallel-size", str(count * nodes)]


def _scale_rows() -> list[str]:
    spec = spec_from_catalog(catalog.get(SCALE_MODEL))
    rows = []
    for label, gpus, nodes in SCALE_RENTALS:
        chosen = plan(spec, parse_gpu_spec(gpus), nodes=nodes)
        dtypes = ("auto", "fp8") if parse_gpu_spec(gpus).fp8 else ("auto",)
        for flags in _layouts(gpus, nodes):
            for dtype in dtypes:
                rows.append(_scale_row(spec, label, gpus, nodes, [*flags, "--kv-cache-dtype", dtype], chosen))
    return rows


def _scale_row(spec: ModelSpec, label: str, gpus: str, nodes: int, flags: list[str], chosen: Plan) -> str:
    try:
        result = plan(spec, parse_gpu_spec(gpus), nodes=nodes, overrides=flags)
    except DoesNotFit as error:
        return _refused_scale_row(label, flags, str(error))
    assert result.budget is not None
    picked = (result.parallelism, result.kv_cache_dtype) == (chosen.parallelism, chosen.kv_cache_dtype)
    return (
        f"| {label} | {result.parallelism} | {'bf16' if result.kv_cache_dtype == 'auto' else result.kv_cache_dtype} | "
        f"{result.weights_bytes_per_gpu / 2**30:,.1f} GiB | {result.budget.kv_cache_bytes / 2**30:,.1f} GiB | "
        f"{result.kv_cache_tokens:,} | {result.max_model_len // 1024}K | {result.max_concurrency} | "
        f"{'yes' if picked else ''} |"
    )


def _refused_scale_row(label: str, flags: list[str], message: str) -> str:
    """The row of a layout that does not fit: its weights per GPU and the KV space left, from the refusal."""
    ranks = int(flags[flags.index("--data-parallel-size") + 1])
    dtype = "bf16" if flags[-1] == "auto" else flags[-1]
    found = re.search(r"needs ([\d.,]+ GiB) of weights per rank.*?leaves ([\d.,]+ GiB) of the ([\d.,]+ GiB)",
                      message)
    layout = f"| {label} | {Parallelism(tensor=1, pipeline=1, data=ranks).describe()} | {dtype} |"
    if not found:
        return f"{layout} does not fit: {message.splitlines()[0][:120]} | | | | | |"
    weights, left, usable = found.groups()
    return f"{layout} {weights} | does not fit: {left} of {usable} left after the reserve | - | - | - | |"


def _head(leading: tuple[str, ...], rentals: tuple[tuple[str, str, object], ...]) -> list[str]:
    """A markdown table's header and alignment rows: the leading columns right-aligned, one per rental."""
    names = [*leading, *(label for label, _, _ in rentals)]
    aligns = ["---", *(["---:"] * (len(leading) - 1)), *(["---"] * len(rentals))]
    return ["| " + " | ".join(names) + " |", "| " + " | ".join(aligns) + " |"]


def render() -> str:
    lines = [
        "# Will it fit? The planner's verdicts",
        "",
        "Generated by `scripts/planner_table.py` from the catalog (workload `chat`); do not edit by hand.",
        "Each cell: tensor x pipeline parallel sizes (or data parallel x expert parallel sizes), the KV dtype",
        "when not the model's, the context length planned, and how many sequences of that length the KV",
        "cache(s) hold at once; or the GPU memory needed and available.",
        "",
        *_head(("model", "weights"), RENTALS),
    ]
    for entry in catalog.ENTRIES:
        cells = [verdict(entry.repo_id, spec, nodes) for _, spec, nodes in RENTALS]
        lines.append(
            f"| `{entry.repo_id}` | {entry.weight_bytes / 1e9:,.0f} GB | " + " | ".join(cells) + " |"
        )
    lines.extend([
        "",
        "## Kimi K2.5 at scale: tensor x pipeline parallel vs data parallel attention with expert parallelism",
        "",
        "The chat plan of each layout (asked for with --tensor-parallel-size / --pipeline-parallel-size or",
        "--data-parallel-size). Under TP every GPU keeps the whole MLA latent KV of every sequence; under DP+EP",
        "each rank keeps the attention and dense layers whole, 1/N of the routed experts, and a KV cache of its",
        "own, so the KV tokens (all ranks) grow with N. Each layout at BF16 KV and, where the GPU has FP8, FP8",
        "KV. Max concurrency: sequences of the planned context held at once. `chat picks`: the layout and KV",
        "dtype the planner chooses by itself for workload chat.",
        "",
        "| rental | layout | KV dtype | weights per GPU | KV cache per GPU | KV tokens (all ranks) | context | "
        "max concurrency | chat picks |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        *_scale_rows(),
        "",
        "## Published checkpoints, planned from their config.json",
        "",
        "Each row reads the checkpoint's own config.json (tests/fixtures/models): its quantization format and",
        "the tensors it keeps in BF16, its context (RoPE scaling, sliding windows, dual chunk attention). Weights",
        "are estimated from the config (no safetensors index in the fixtures). The last rows read only the fields",
        "the planner reads of further published configs (tests/fixtures/published_configs.json). The last column",
        "asks for the model's whole context.",
        "",
        *_head(("checkpoint", "weights (est.)", "context"), CHECKPOINT_RENTALS),
    ])
    published = {entry["repo_id"]: entry["config"] for entry in json.loads(PUBLISHED_CONFIGS.read_text())}
    specs = [inspect_model(str(FIXTURES / repo_id.replace("/", "--"))) for repo_id in CHECKPOINTS] + [
        spec_from_config(published[repo_id], name=repo_id, weight_bytes=None, weight_bytes_source="",
                         source=str(PUBLISHED_CONFIGS))
        for repo_id in PUBLISHED
    ]
    for repo_id, spec in zip((*CHECKPOINTS, *PUBLISHED), specs, strict=True):
        cells = [
            _cell(spec, gpus, length=spec.native_max_len if length == "native" else None)
            for _, gpus, length in CHECKPOINT_RENTALS
        ]
        lines.append(
            f"| `{repo_id}` ({spec.quantization or spec.dtype}) | {spec.weight_bytes / 1e9:,.0f} GB | "
            f"{spec.native_max_len // 1024:,}K | " + " | ".join(cells) + " |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed table differs")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run scripts/planner_table.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
