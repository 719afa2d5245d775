"""Resolve the wheels the H200 machine lacks for vLLM and pin them, with hashes, in wheels.lock.

Runs on a networked machine (any Python with pip >= 22.2). pip resolves vLLM's whole dependency tree
for CPython 3.12 on manylinux x86_64, held to the torch/transformers builds already on the device;
only the packages that image does not have go into the lock, because `pip install --no-deps` there
must not replace its CUDA-matched torch stack. Usage: lock_wheels.py [--vllm VERSION] [--out FILE]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON_VERSION = "3.12"
# Ubuntu 24.04 ships glibc 2.39; pip matches manylinux_2_N tags exactly, so list every N.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
]
# Versions read on the device image: vLLM must resolve against these, not newer ones.
DEVICE_PINS = (
    "torch==2.11.0", "torchaudio==2.11.0", "torchvision==0.26.0",
    "transformers==5.17.0", "tokenizers==0.23.2", "huggingface_hub==1.33.0",
)
# What vLLM needs at run time for a Llama-class model that the image lacks (`pip show` there).
# flashinfer-cubin, tilelang, nvidia-cutlass-dsl and tokenspeed-triton are left out: 400+ MB that
# a Llama on Hopper does not load (FlashAttention 3 ships inside the vLLM wheel).
MISSING_ON_DEVICE = (
    "vllm", "annotated_types", "anthropic", "apache_tvm_ffi", "astor", "blake3", "cachetools", "cbor2",
    "compressed_tensors", "depyf", "dill", "diskcache", "dnspython", "docstring_parser", "email_validator",
    "fastapi", "fastsafetensors", "flashinfer_python", "gguf", "googleapis_common_protos", "httpcore2",
    "httptools", "httpx2", "ijson", "interegular", "jiter", "jmespath", "jsonschema",
    "jsonschema_specifications", "lark", "llguidance", "lm_format_enforcer", "loguru", "mcp", "mcp_types",
    "mistral_common", "model_hosting_container_standards", "msgspec", "nvidia_cudnn_frontend", "openai",
    "openai_harmony", "opentelemetry_*", "outlines_core", "partial_json_parser",
    "prometheus_fastapi_instrumentator", "pybase64", "pycountry", "pydantic", "pydantic_core",
    "pydantic_extra_types", "pydantic_settings", "pyjwt", "python_dotenv", "python_json_logger",
    "python_multipart", "pyzmq", "quack_kernels", "referencing", "rpds_py", "setproctitle", "sniffio",
    "sse_starlette", "starlette", "supervisor", "tokenspeed_mla", "torch_c_dlpack_ext", "truststore",
    "typing_inspection", "uvicorn", "watchfiles", "websockets", "xgrammar"
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wanted(name: str) -> bool:
    return any(fnmatch.fnmatch(normalize(name), pattern) for pattern in MISSING_ON_DEVICE)


def resolve(vllm_version: str, work: Path) -> list[dict]:
    constraints = work / "device-pins.txt"
    constraints.write_text("\n".join(DEVICE_PINS) + "\n")
    report = work / "report.json"
    argv = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
        "--target", str(work / "unused"), "--report", str(report),
        "--constraint", str(constraints), f"vllm=={vllm_version}",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"pip could not resolve vllm=={vllm_version} for the device:\n{result.stderr[-3000:]}")
    return json.loads(report.read_text())["install"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="0.21.0", help="vLLM version (default 0.21.0)")
    parser.add_argument("--out", type=Path, default=HERE / "wheels.lock")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        items = resolve(args.vllm, Path(tmp))
    lines = []
    for item in items:
        meta, info = item["metadata"], item["download_info"]
        if not wanted(meta["name"]):
            continue
        digest = info["archive_info"]["hashes"]["sha256"]
        lines.append(f"{normalize(meta['name'])}=={meta['version']} --hash=sha256:{digest}")
    lines.sort()
    header = (
        f"# vLLM {args.vllm} and the run-time wheels the H200 image lacks, for CPython {PYTHON_VERSION}"
        " manylinux x86_64.\n# Written by lock_wheels.py; prepare_wheels.sh downloads exactly these.\n"
    )
    args.out.write_text(header + "\n".join(lines) + "\n")
    print(f"{len(lines)} wheels pinned in {args.out}")


if __name__ == "__main__":
    main()
