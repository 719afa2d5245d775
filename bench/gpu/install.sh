#!/usr/bin/env bash
# Runs on the device machine: joins the wheel parts carried by earlier calls (.device/parts/p*),
# checks them against the manifest, installs them into $KIMI_SITE with pip (no index, no deps) and
# proves `import vllm, kimi_service` works. Skips the install when the same parts are already in.
# Usage: bench/gpu/install.sh [--check | --wheelhouse DIR]
#   --check: only report which parts are present
#   --wheelhouse DIR: join and unpack the wheels into DIR (a wheelhouse for site.yml's runtime stage), no install
set -euo pipefail
# shellcheck source=bench/gpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

PARTS="$KIMI_REPO/.device/parts"
manifest=$(find "$PARTS" -name MANIFEST 2>/dev/null | head -1)
if [[ -z $manifest ]]; then
    echo "error: no wheel parts under $PARTS; run bench/gpu/prepare_wheels.sh where pip works and" \
        "carry .device/parts/p1 ... one per call" >&2
    exit 1
fi
if (($(find "$PARTS" -name MANIFEST -exec sha256sum {} + | cut -d' ' -f1 | sort -u | wc -l) > 1)); then
    echo "error: $PARTS holds parts of two prepare_wheels.sh runs; carry every part of the latest run again" >&2
    exit 1
fi
read -r _ tar_sha total < <(grep '^tar ' "$manifest")
stamp="$KIMI_SITE/.kimi-wheels-$tar_sha"

present=0
missing=()
while read -r _ sha name; do
    file=$(find "$PARTS" -name "$name" | head -1)
    if [[ -n $file ]] && [[ $(sha256sum "$file" | cut -d' ' -f1) == "$sha" ]]; then
        present=$((present + 1))
    else
        missing+=("$name")
    fi
done < <(grep '^part ' "$manifest")
echo "wheel parts present: $present of $total${missing[*]:+ (missing: ${missing[*]})}"

if [[ ${1:-} == --check ]]; then
    exit 0
fi

join_parts() {  # $1: directory to unpack the carried wheels into
    if ((${#missing[@]})); then
        echo "error: carry the missing parts first (one .device/parts/pN per call)" >&2
        exit 1
    fi
    local joined
    joined=$(mktemp -d)
    while read -r _ _ name; do cat "$(find "$PARTS" -name "$name" | head -1)"; done \
        < <(grep '^part ' "$manifest") > "$joined/wheels.tar"
    if [[ $(sha256sum "$joined/wheels.tar" | cut -d' ' -f1) != "$tar_sha" ]]; then
        rm -rf "$joined"
        echo "error: the joined parts do not match the manifest; run prepare_wheels.sh again" >&2
        exit 1
    fi
    mkdir -p "$1"
    tar -C "$1" -xf "$joined/wheels.tar"
    rm -rf "$joined"
}

if [[ ${1:-} == --wheelhouse ]]; then
    join_parts "$2"
    echo "unpacked $(find "$2" -name '*.whl' | wc -l) wheels into $2"
    exit 0
fi
if [[ -f $stamp ]]; then
    echo "wheels already installed in $KIMI_SITE"
else
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    join_parts "$unpacked"
    started=$SECONDS
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$KIMI_SITE" "$unpacked"/*.whl
    touch "$stamp"
    echo "installed $(find "$unpacked" -name '*.whl' | wc -l) wheels into $KIMI_SITE in $((SECONDS - started)) s"
fi

"$PYTHON" - <<'PY'
import importlib.metadata as md
import sys

import torch
import transformers
import vllm

import kimi_service

# The OpenAI server pulls in most of the carried wheels (fastapi, uvicorn, pydantic, openai, zmq...):
# a missing one fails here, not minutes later in the first server start.
import vllm.entrypoints.openai.api_server  # noqa: F401

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"transformers {transformers.__version__}, vllm {vllm.__version__}, "
      f"kimi_service {kimi_service.__version__} from {kimi_service.__file__}, httpx {md.version('httpx')}")
PY
echo "export PYTHONPATH=$PYTHONPATH PATH=$KIMI_SITE/bin:\$PATH"
