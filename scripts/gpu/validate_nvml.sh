#!/usr/bin/env bash
# Check the exporter and `kimi-service health` against a real GPU's NVML.
# Run from the repository root on a GPU host (no install: the checkout goes on PYTHONPATH):
#   scripts/gpu/validate_nvml.sh [OUT_DIR]        (default: $OUT, else ./gpu-validation-out)
# Needs python3 with nvidia-ml-py, prometheus-client and httpx; PyYAML only for the CLI step.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-gpu-validation-out}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python=${PYTHON:-python3}

{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(hostname)"
    nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,ecc.mode.current --format=csv || true
    "$python" -c 'import pynvml, prometheus_client, httpx; print("pynvml", pynvml.__file__)'
} >"$out/environment.txt" 2>&1

status=0
"$python" scripts/gpu/validate_nvml.py "$out" 20 || status=$?

# The CLI end to end: no endpoint runs here, so the API checks say "down" (exit 2) while the GPU
# checks run against the real NVML; what matters is the GPU part of the JSON.
if "$python" -c 'import yaml' 2>/dev/null; then
    cat >"$out/config.yaml" <<YAML
model:
  path: /nonexistent/model
paths:
  state_dir: /tmp/kimi-validate
  plan_file: $PWD/$out/plan.json
plan:
  engine: cuda
YAML
    set +e
    "$python" -m kimi_service health --config "$out/config.yaml" --url http://127.0.0.1:9 --json \
        >"$out/health-cli.json" 2>"$out/health-cli.err"
    echo "health exit status: $?" >>"$out/health-cli.err"
    set -e
fi
echo "validate_nvml: status $status, results in $out"
exit "$status"
