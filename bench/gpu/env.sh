# Sourced by the device scripts: where the carried wheels are installed and how vLLM must run there.
# shellcheck shell=bash
KIMI_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export KIMI_REPO
export KIMI_SITE=${KIMI_SITE:-/tmp/site}
export KIMI_WORK=${KIMI_WORK:-/tmp/kimi-bench}
export PYTHON=${PYTHON:-python3}
# The checkout comes first so the kimi_service that travelled with this call wins over the packed wheel.
export PYTHONPATH="$KIMI_REPO:$KIMI_SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$KIMI_SITE/bin:$PATH"
export PYTHONUNBUFFERED=1
# No network there: never try the hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# flashinfer's sampler JIT-compiles kernels that its cubin package (left behind) would provide.
export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_CACHE_ROOT="$KIMI_WORK/cache/vllm" TORCHINDUCTOR_CACHE_DIR="$KIMI_WORK/cache/inductor"
