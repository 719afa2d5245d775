"""Resolve the wheels the H200 machine lacks for vLLM and pin them, with hashes, in wheels.lock.

Runs on a networked machine, under Python 3.12 with pip >= 22.2. pip resolves the runtime venv's whole
dependency tree (vLLM, this project's requirements, supervisor) for CPython 3.12 on manylinux x86_64, held
to the versions the device image already has (device-freeze.txt, `pip list --format=freeze` of the image's
torch venv). The lock is every resolved package the image lacks or holds at another version: what a
wheelhouse must carry so that `pip install` there (the runtime stage, on top of the image's torch through
kimi_runtime_site_packages) resolves without an index. Usage: lock_wheels.py [--vllm VERSION] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTHON_VERSION = "3.12"
# Ubuntu 24.04 ships glibc 2.39; pip matches manylinux_2_N tags exactly, so list every N.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
]
DEVICE_FREEZE = HERE / "device-freeze.txt"
# Image packages vLLM 0.21.0 cannot use at the image's version (measured: pip's conflicts): the venv gets
# its own, which shadow the image's for the engine. numba 0.65 pins llvmlite and wants numpy < 2.5;
# vLLM wants setuptools < 81; cuda-python 13.3 wants cuda-core 1.0.
NOT_HELD = {"numba", "llvmlite", "numpy", "setuptools", "cuda_core"}
SUPERVISOR = "supervisor==4.3.0"  # roles/vllm_runtime: kimi_supervisor_version


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def image_versions() -> dict[str, str]:
    pins = (line.strip().split("==", 1) for line in DEVICE_FREEZE.read_text().splitlines() if "==" in line)
    return {normalize(name): version for name, version in pins}


def resolve(vllm_version: str, work: Path, image: dict[str, str]) -> list[dict]:
    constraints = work / "device-pins.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in image.items() if name not in NOT_HELD))
    report = work / "report.json"
    argv = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
        "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
        "--target", str(work / "unused"), "--report", str(report),
        "--constraint", str(constraints), f"vllm=={vllm_version}", SUPERVISOR, str(ROOT),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"pip could not resolve vllm=={vllm_version} for the device (a package the image holds at a "
                 f"version vLLM cannot use belongs in NOT_HELD):\n{result.stderr[-3000:]}")
    return json.loads(report.read_text())["install"]


def main() -> None:
    if sys.version_info[:2] != tuple(map(int, PYTHON_VERSION.split("."))):
        # pip evaluates environment markers (vLLM's `setuptools<81; python_version > "3.11"`) with the
        # interpreter that runs it, whatever --python-version says.
        sys.exit(f"run lock_wheels.py with Python {PYTHON_VERSION}, the device's (this is {sys.version.split()[0]})")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", default="0.21.0", help="vLLM version (default 0.21.0)")
    parser.add_argument("--out", type=Path, default=HERE / "wheels.lock")
    args = parser.parse_args()
    image = image_versions()
    with tempfile.TemporaryDirectory() as tmp:
        items = resolve(args.vllm, Path(tmp), image)
    lines = []
    for item in items:
        meta, info = item["metadata"], item["download_info"]
        name = normalize(meta["name"])
        if name == "kimi_service" or image.get(name) == meta["version"]:
            continue
        digest = info["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={meta['version']} --hash=sha256:{digest}")
    lines.sort()
    header = (
        f"# vLLM {args.vllm}, this project's requirements and supervisor: the wheels the H200 image lacks or\n"
        f"# holds at another version, for CPython {PYTHON_VERSION} manylinux x86_64.\n"
        "# Written by lock_wheels.py; prepare_wheels.sh downloads exactly these.\n"
    )
    args.out.write_text(header + "\n".join(lines) + "\n")
    print(f"{len(lines)} wheels pinned in {args.out}")


if __name__ == "__main__":
    main()
