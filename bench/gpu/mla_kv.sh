#!/usr/bin/env bash
# Runs on the device machine after install.sh: the planner's KV prediction for an MLA + MoE model
# (DeepSeek-V3 architecture, bench/gpu/mla_model.py) against vLLM's "GPU KV cache size" on one GPU.
# Each case starts vLLM with the plan's own argv (random weights: --load-format dummy, no tokenizer),
# reads the figure from its log and stops it; one case takes 2-4 minutes.
# Usage: [LAYERS=N] bench/gpu/mla_kv.sh CASE...   (chat: the chat plan; big-batch: --max-num-batched-tokens
#        16384 --max-num-seqs 512; eager: --enforce-eager). LAYERS (default 8) shows how the reserve scales.
# Results: $OUT/mla-kv/CASE[-Nl].{json,log,plan.json} (the suffix when LAYERS is given).
set -euo pipefail
# shellcheck source=bench/gpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
LAYERS=${LAYERS:-}
MODEL_DIR=${MODEL_DIR:-$KIMI_WORK/models/deepseek-v3-${LAYERS:-8}l-32e}
MAX_LEN=${MAX_LEN:-32768}
WAIT=${WAIT:-420}
OUT=${OUT:-$KIMI_WORK/out}
mkdir -p "$OUT/mla-kv"
"$PYTHON" "$KIMI_REPO/bench/gpu/mla_model.py" config "$MODEL_DIR" ${LAYERS:+"$LAYERS"}

for case in "$@"; do
    case $case in
        chat) extra=() ;;
        big-batch) extra=(--max-num-batched-tokens 16384 --max-num-seqs 512) ;;
        eager) extra=(--enforce-eager) ;;
        *) echo "unknown case $case" >&2; exit 2 ;;
    esac
    name=$case${LAYERS:+-${LAYERS}l}
    plan="$OUT/mla-kv/$name.plan.json"
    logfile="$OUT/mla-kv/$name.log"
    "$PYTHON" "$KIMI_REPO/bench/gpu/mla_model.py" plan "$MODEL_DIR" "$plan" --max-model-len "$MAX_LEN" "${extra[@]}"
    mapfile -t argv < <("$PYTHON" -c 'import json,sys; print("\n".join(json.load(open(sys.argv[1]))["argv"][2:]))' "$plan")
    echo "== $name: vllm serve ${argv[*]} --load-format dummy --skip-tokenizer-init --moe-backend triton"
    start=$(date +%s)
    setsid "$PYTHON" -m kimi_service.vllm_cli serve "${argv[@]}" --load-format dummy --skip-tokenizer-init \
        --moe-backend triton > "$logfile" 2>&1 < /dev/null &
    pid=$!
    until grep -q "GPU KV cache size" "$logfile" || ! kill -0 "$pid" 2>/dev/null \
        || (( $(date +%s) - start > WAIT )); do sleep 3; done
    sleep 2
    # The engine core may be capturing CUDA graphs and not heed SIGTERM: a grace period, then SIGKILL.
    kill -- -"$pid" 2>/dev/null || true
    for _ in $(seq 15); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    "$PYTHON" - "$plan" "$logfile" "$OUT/mla-kv/$name.json" "$name" <<'PY'
import json, re, sys
plan, log = json.load(open(sys.argv[1])), open(sys.argv[2]).read()
found = re.search(r"GPU KV cache size: ([\d,]+) tokens", log)
memory = re.search(r"Available KV cache memory: ([\d.]+) GiB", log)
vllm = int(found.group(1).replace(",", "")) if found else None
result = {"case": sys.argv[4], "gpu": plan["hardware"], "planner_kv_tokens": plan["kv_cache_tokens"], "vllm_kv_tokens": vllm,
          "vllm_available_kv_gib": float(memory.group(1)) if memory else None,
          "planner_kv_gib": plan["budget"]["kv_cache_bytes"] / 2**30,
          "error": None if vllm is None else plan["kv_cache_tokens"] / vllm - 1,
          "budget": plan["budget"], "argv": plan["argv"]}
for line in log.splitlines():
    if re.search(r"Model loading took|torch.compile takes|CUDA graph|memory profiling|peak|non-torch|Graph capturing", line):
        result.setdefault("log_lines", []).append(line[-300:])
json.dump(result, open(sys.argv[3], "w"), indent=2)
print(json.dumps({k: result[k] for k in ("case", "gpu", "planner_kv_tokens", "vllm_kv_tokens", "error",
                                          "vllm_available_kv_gib", "planner_kv_gib")}))
PY
    [[ -n $(grep "GPU KV cache size" "$logfile") ]] || tail -40 "$logfile"
done
