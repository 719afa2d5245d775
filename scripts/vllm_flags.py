#!/usr/bin/env python3
"""Write the long options `vllm serve` takes, read from a vLLM wheel's source, one a line (sorted).

Usage: `python3 scripts/vllm_flags.py WHEEL [OUT]`, e.g. with the wheel bench/gpu/prepare_wheels.sh
downloads: `python3 scripts/vllm_flags.py .device/wheels/vllm-0.21.0-*.whl
kimi_service/data/vllm-0.21.0-serve-flags.txt`. tests/unit/test_vllm_flags.py holds every flag the planner
and the launcher emit against that file.

Read without importing vLLM (no torch, no GPU needed): the engine's options are the `add_argument("--…")`
calls of vllm/engine/arg_utils.py, the OpenAI server's are the same calls in
vllm/entrypoints/openai/cli_args.py plus one `--field-name` per field of its *FrontendArgs dataclasses
(the parser is generated from them). argparse's `--no-…` negations are left out.
"""

from __future__ import annotations

import ast
import sys
import zipfile
from pathlib import Path

SOURCES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py")


def flags_in(source: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found.update(arg.value for arg in node.args
                         if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"))
        if isinstance(node, ast.ClassDef) and node.name.endswith("FrontendArgs"):
            found.update("--" + item.target.id.replace("_", "-") for item in node.body
                         if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
    return found


def main() -> int:
    wheel = Path(sys.argv[1])
    with zipfile.ZipFile(wheel) as archive:
        flags = set().union(*(flags_in(archive.read(name).decode()) for name in SOURCES))
    text = f"# long options of `vllm serve`, read from {wheel.name} by scripts/vllm_flags.py\n" + "\n".join(
        sorted(flags)) + "\n"
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
