#!/usr/bin/env bash
# Runs on the device machine: site.yml end to end on the GPU host itself (ansible_connection: local). The
# host has no systemd, so the services run under supervisord; the runtime comes from the carried wheelhouse
# on top of the image's torch (kimi_runtime_site_packages); the weights from a local directory
# (kimi_model_source: local) that make_model.py fills with a random-weight Llama-3.1-8B shape. One section
# per call keeps each call under its 10-minute limit; results collect in $E2E/results and every call packs
# them into $OUT/e2e.tar.gz.
#
# Usage: bench/gpu/site_e2e.sh SECTION...
#   prepare    the wheelhouse from the carried parts (install.sh --wheelhouse), ansible-core from
#              .device/ansible, the model (skipped when present, or with PREPARE_MODEL=0)
#   converge   ansible-playbook site.yml, the first run, in the background (it may outlast one call)
#   wait       wait for the latest background run to end
#   rerun      site.yml again (changed=0 expected), kimi-service health --json, a scrape of the exporter
#   bench      playbooks/bench.yml at concurrency 1, 16, 64 through the deployed endpoint, then vLLM's
#              defaults (`vllm serve MODEL`, nothing else) from the same venv on the same GPU, swept alike;
#              the deployed engine stays stopped (the next converge starts it; or section serve-again)
#   serve-again  start the deployed engine again and wait until it serves
#   tune       playbooks/tune.yml (kimi-service tune on the deployed host: candidates measured against the plan,
#              the winner served) with TUNE_BUDGET (8m), TUNE_INPUT_LEN (512), TUNE_OUTPUT_LEN (128),
#              TUNE_PREFIX_LEN (0); then bench.yml again through the tuned endpoint
#   kill       kill -9 of vLLM: seconds until the endpoint serves again under supervisord
#   moe        the MLA + MoE shape (make_model.py --shape deepseek-v3-4l) through site.yml in place of the
#              Llama model, in the background: the planner's KV tokens against vLLM's
#   moe-probe  the same model under plain `vllm serve` (vLLM's own MoE backend choice) for 150 s, with
#              what the engine runs meanwhile (compilers), to show why the plan picks Triton's MoE
#   kimi       Kimi K2.5 as it ships at reduced depth (make_model.py --shape $KIMI_SHAPE, kimi-k2.5-4l: INT4
#              experts, vision tower, Kimi's tokenizer; 36 GB) through site.yml in place of the served model, in
#              the background (section wait waits again). Source and deployed copy need twice the weights on
#              disk: kimi-k2.5-4l wants a 128 GiB disk (nvidia-h100-x2); on 64 GiB use KIMI_SHAPE=kimi-k2.5-2l
#   kimi-checks  through the deployed endpoint: a chat, a tool call round trip (kimi_k2 tool parser),
#              reasoning apart from content (kimi_k2 reasoning parser), an image; the plan's KV tokens beside
#              vLLM's allocation and the MoE backend vLLM picked for the INT4 experts
#   uninstall  playbooks/uninstall.yml
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
E2E=${E2E:-/tmp/kimi-e2e}
OUT=${OUT:-$E2E/out}
RESULTS="$E2E/results"
WHEELHOUSE="$E2E/wheelhouse"
ANSIBLE_SITE="$E2E/ansible"
MODEL_SRC="$E2E/models/llama-3.1-8b"
MOE_SRC="$E2E/models/deepseek-v3-4l"
KIMI_SHAPE=${KIMI_SHAPE:-kimi-k2.5-4l}
KIMI_SRC="$E2E/models/$KIMI_SHAPE"
INVENTORY="$E2E/inventory/hosts.yml"
MOE_INVENTORY="$E2E/inventory/moe.yml"
VENV=/opt/kimi-service/venv
SUPERVISORCTL=("$VENV/bin/supervisorctl" -c /etc/kimi-service/supervisord.conf)
PYTHON=${PYTHON:-python3}
mkdir -p "$RESULTS" "$OUT" "$(dirname "$INVENTORY")"
cd "$REPO"

log() { printf '\n== [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# ansible-core refuses a locale that is not UTF-8.
export LC_ALL=C.UTF-8 ANSIBLE_FORCE_COLOR=0

report() {  # LOG: the recap, and the failure when there is one
    sed -n '/PLAY RECAP/,$p' "$RESULTS/$1.log"
    grep -n -B2 -A25 'fatal:\|FAILED!' "$RESULTS/$1.log" | head -80 || true
}

playbook() {  # NAME LOG ARGS...: ansible-playbook from the carried ansible-core, its log kept in results
    local name=$1 logfile=$2
    shift 2
    local started=$SECONDS rc=0
    PYTHONPATH="$ANSIBLE_SITE" ANSIBLE_LOG_PATH="$RESULTS/$logfile.ansible.log" \
        "$PYTHON" "$ANSIBLE_SITE/bin/ansible-playbook" -i "${PLAY_INVENTORY:-$INVENTORY}" "$name" "$@" \
        > "$RESULTS/$logfile.log" 2>&1 || rc=$?
    echo "$name $* exit $rc in $((SECONDS - started)) s" | tee -a "$RESULTS/timings.txt"
    report "$logfile"
    return $rc
}

background_site() {  # LOG INVENTORY WAIT: site.yml in the background (it may outlast one call), waited for
    local logfile=$1
    rm -f "$RESULTS/$logfile.rc"
    echo "$logfile" > "$RESULTS/background"
    echo "$2" > "$RESULTS/background.inventory"  # what section rerun converges again
    setsid nohup bash -c "source '$REPO/bench/gpu/site_e2e.sh' --functions-only
        rc=0; PLAY_INVENTORY='$2' playbook site.yml $logfile || rc=\$?; echo \$rc > '$RESULTS/$logfile.rc'" \
        > /dev/null 2>&1 < /dev/null &
    wait_background "$3"
}

wait_background() {  # wait up to $1 s for the latest background site.yml
    local logfile deadline=$((SECONDS + $1))
    logfile=$(cat "$RESULTS/background")
    while [[ ! -f $RESULTS/$logfile.rc ]] && ((SECONDS < deadline)); do
        sleep 5
    done
    if [[ ! -f $RESULTS/$logfile.rc ]]; then
        echo "site.yml ($logfile) still running; last task:"
        grep 'TASK \[' "$RESULTS/$logfile.log" | tail -1
        return 1
    fi
    report "$logfile"
    return "$(cat "$RESULTS/$logfile.rc")"
}

wait_url() {  # URL SECONDS PID: until URL answers 200, the process ends, or time runs out
    local deadline=$((SECONDS + $2))
    until curl -sf -m 5 -o /dev/null "$1"; do
        if ((SECONDS > deadline)) || ! kill -0 "$3" 2>/dev/null; then
            return 1
        fi
        sleep 2
    done
}

stop_group() {  # PID: the process group a setsid started, SIGTERM then SIGKILL
    kill -- -"$1" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
}

deployed_model_dir() {
    sed -n 's/^ *path: *//p' /etc/kimi-service/config.yaml | head -1
}

wait_deployed_ready() {  # SINCE LIMIT: until serve's readiness port says ready, at most LIMIT s after SINCE
    until curl -sf -m 5 -o /dev/null http://127.0.0.1:8001/ready; do
        if ((SECONDS - $1 > $2)); then
            echo "the deployed engine is not serving $2 s later"
            return 1
        fi
        sleep 2
    done
}


section_prepare() {
    log "wheelhouse"
    if [[ ! -d $WHEELHOUSE ]]; then
        bash bench/gpu/install.sh --wheelhouse "$WHEELHOUSE"
        # The runtime stage builds this checkout's wheel itself.
        rm -f "$WHEELHOUSE"/kimi_service-*.whl
    fi
    log "ansible-core"
    if [[ ! -x $ANSIBLE_SITE/bin/ansible-playbook ]]; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$ANSIBLE_SITE" .device/ansible/*.whl
    fi
    PYTHONPATH="$ANSIBLE_SITE" "$PYTHON" "$ANSIBLE_SITE/bin/ansible-playbook" --version | head -3
    log "model"
    # PREPARE_MODEL=0: a run that serves only another shape (section kimi) skips the 16 GB Llama model.
    if [[ ${PREPARE_MODEL:-1} == 1 && ! -f $MODEL_SRC/config.json ]]; then
        "$PYTHON" bench/gpu/make_model.py "$MODEL_SRC" --shape llama-3.1-8b
    fi
    du -sh "$MODEL_SRC" 2>/dev/null || echo "no Llama model (PREPARE_MODEL=0)"
    write_inventory "$INVENTORY" e2e/llama-3.1-8b "$MODEL_SRC"
    cp "$INVENTORY" "$RESULTS/inventory.yml"
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        echo "PID 1: $(tr '\0' ' ' < /proc/1/cmdline | cut -c1-80)"
        echo "python3: $(command -v "$PYTHON") $("$PYTHON" --version 2>&1)"
        df -h /tmp | tail -1
    } | tee "$RESULTS/facts.txt"
}

write_inventory() {  # FILE MODEL SOURCE_DIR [MORE_VARS_YAML]
    local torch_site
    torch_site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    cat > "$1" <<EOF
all:
  hosts:
    gpu0:
      ansible_connection: local
      ansible_python_interpreter: /usr/bin/python3
  vars:
    kimi_model: $2
    kimi_model_source: local
    kimi_model_local_path: $3
    kimi_served_model_name: e2e
    kimi_wheelhouse: $WHEELHOUSE
    # The image's CUDA torch (gigabytes) is used as it is: the venv sees it, the wheelhouse need not carry it.
    kimi_runtime_site_packages: [$torch_site]
    # flashinfer's sampler JIT-compiles kernels its cubin package (not carried) would provide.
    kimi_vllm_extra_env: {VLLM_USE_FLASHINFER_SAMPLER: "0"}
${4:-}
EOF
}

section_converge() {
    log "site.yml, first run (in the background; this call waits up to 530 s, section wait waits again)"
    background_site converge "$INVENTORY" 530
}

section_wait() {
    wait_background 560
}

section_rerun() {
    # The inventory of the latest converge (the kimi and moe sections switch the model): on the first
    # one's, preflight would look for a model those sections have deleted.
    local rc=0
    log "site.yml, second run"
    PLAY_INVENTORY=$(cat "$RESULTS/background.inventory" 2>/dev/null || echo "$INVENTORY") \
        playbook site.yml rerun || rc=$?
    ((rc == 0)) || log "the second run FAILED (exit $rc): see rerun.log"
    grep -B1 '^changed:' "$RESULTS/rerun.log" | grep 'TASK' || true
    log "kimi-service health --json"
    /opt/kimi-service/venv/bin/kimi-service health --config /etc/kimi-service/config.yaml \
        --env-file /etc/kimi-service/secrets.env --json | tee "$RESULTS/health.json" || true
    log "exporter and vLLM metrics"
    curl -sS -m 30 http://127.0.0.1:9400/metrics > "$RESULTS/exporter.prom" || true
    curl -sS -m 30 http://127.0.0.1:8000/metrics > "$RESULTS/vllm.prom" || true
    grep -c '^DCGM_FI_' "$RESULTS/exporter.prom" || true
    grep -E '^kimi_plan_info|^kimi_kv_cache|^vllm:cache_config_info' "$RESULTS/exporter.prom" "$RESULTS/vllm.prom" \
        | cut -c1-300 || true
}

section_bench() {
    local levels=1,16,64 prompts=16 model_dir pid
    log "playbooks/bench.yml at concurrency $levels through the deployed endpoint (the planner's flags)"
    playbook playbooks/bench.yml bench -e "kimi_bench_concurrency=$levels" -e "kimi_bench_prompts=$prompts" \
        -e "kimi_bench_results_dir=$RESULTS/bench-deployed" || true
    grep -A12 'Show the table' "$RESULTS/bench.log" | sed -n 's/^ *"\(.*\)",\?$/\1/p' || true
    log "vLLM's defaults: vllm serve MODEL from the deployed venv, nothing else (the deployed engine stopped)"
    model_dir=$(deployed_model_dir)
    "${SUPERVISORCTL[@]}" stop kimi-vllm
    # The same environment the deployed unit gives vLLM for the sampler (kimi_vllm_extra_env).
    VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 setsid "$VENV/bin/vllm" serve "$model_dir" \
        --served-model-name e2e --port 8000 > "$RESULTS/vllm-default.log" 2>&1 < /dev/null &
    pid=$!
    local started=$SECONDS
    if wait_url http://127.0.0.1:8000/health 420 "$pid"; then
        echo "vLLM with its defaults served after $((SECONDS - started)) s" | tee -a "$RESULTS/timings.txt"
        "$VENV/bin/kimi-service" bench --url http://127.0.0.1:8000 --model e2e --tokenizer "$model_dir" \
            --concurrency "$levels" --input-len 512 --output-len 128 --prompts "$prompts" \
            --json "$RESULTS/bench-default.json" || true
    else
        echo "vLLM with its defaults did not serve:"
        tail -30 "$RESULTS/vllm-default.log"
    fi
    stop_group "$pid"
    "$PYTHON" - "$RESULTS/bench-deployed/gpu0/bench.json" "$RESULTS/bench-default.json" <<'PY' \
        | tee "$RESULTS/bench-table.md"
import json, sys
def levels(path):
    try:
        return {level["concurrency"]: level for level in json.load(open(path))["levels"]}
    except (OSError, ValueError, KeyError):
        return {}
deployed, default = levels(sys.argv[1]), levels(sys.argv[2])
print("| concurrency | deployed tok/s | vLLM defaults tok/s | ratio | deployed TTFT p50 s | defaults TTFT p50 s "
      "| deployed ITL p50 ms | defaults ITL p50 ms |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for conc in sorted(set(deployed) | set(default)):
    d, v = deployed.get(conc, {}), default.get(conc, {})
    tok = lambda x: x.get("output_tokens_per_s")
    ratio = f"{tok(d) / tok(v):.2f}" if tok(d) and tok(v) else "-"
    ttft = lambda x: f"{x['ttft_s']['p50']:.3f}" if x else "-"
    itl = lambda x: f"{1000 * x['itl_s']['p50']:.1f}" if x else "-"
    print(f"| {conc} | {tok(d) or 0:.0f} | {tok(v) or 0:.0f} | {ratio} | {ttft(d)} | {ttft(v)} | {itl(d)} | {itl(v)} |")
PY
}

section_tune() {
    log "playbooks/tune.yml: budget ${TUNE_BUDGET:-8m}, ${TUNE_INPUT_LEN:-512} in, ${TUNE_OUTPUT_LEN:-128} out"
    playbook playbooks/tune.yml tune -e "kimi_tune_budget=${TUNE_BUDGET:-8m}" -e kimi_tune_concurrency=1,16,64 \
        -e "kimi_tune_input_len=${TUNE_INPUT_LEN:-512}" -e "kimi_tune_output_len=${TUNE_OUTPUT_LEN:-128}" \
        -e "kimi_tune_shared_prefix_len=${TUNE_PREFIX_LEN:-0}" || true
    cp /var/lib/kimi-service/tuned.json "$RESULTS/tuned.json" 2>/dev/null || true
    cp -r /var/lib/kimi-service/tune "$RESULTS/tune" 2>/dev/null || true
    find "$RESULTS/tune" -name '*.log' -size +200k -delete 2>/dev/null || true
    cat /var/lib/kimi-service/tune/*/report.txt 2>/dev/null || true
    log "playbooks/bench.yml through the tuned endpoint"
    playbook playbooks/bench.yml bench-tuned -e kimi_bench_concurrency=1,16,64 -e kimi_bench_prompts=16 \
        -e "kimi_bench_input_len=${TUNE_INPUT_LEN:-512}" -e "kimi_bench_output_len=${TUNE_OUTPUT_LEN:-128}" \
        -e "kimi_bench_shared_prefix_len=${TUNE_PREFIX_LEN:-0}" -e "kimi_bench_results_dir=$RESULTS/bench-tuned" || true
}

section_serve_again() {
    "${SUPERVISORCTL[@]}" start kimi-vllm
    local started=$SECONDS
    wait_deployed_ready "$started" 400 || return 1
    echo "the deployed engine serves again after $((SECONDS - started)) s"
}

section_moe() {
    log "the MLA + MoE shape: make_model.py --shape deepseek-v3-4l"
    # The Llama source directory is not needed any more (its copy is served); the disk holds both models' copies.
    rm -rf "$MODEL_SRC"
    "$PYTHON" bench/gpu/make_model.py "$MOE_SRC" --shape deepseek-v3-4l
    du -sh "$MOE_SRC"
    # The 64 GiB disk holds the Llama copy still in service, this model's source and its copy: preflight's
    # default 20 GiB of headroom (a rental's logs and caches) refused it (run 3, docs/gpu-e2e.md).
    write_inventory "$MOE_INVENTORY" e2e/deepseek-v3-4l "$MOE_SRC" "    kimi_preflight_disk_headroom_gb: 5"
    {
        echo "nvcc: $(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null || echo none)"
        "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PY
    } 2>&1 | tee "$RESULTS/moe-facts.txt"
    log "site.yml with the MoE model (in the background; this call waits up to 480 s, section wait waits again)"
    local rc=0
    background_site moe "$MOE_INVENTORY" 480 || rc=$?
    moe_report
    return $rc
}

moe_report() {
    cp /run/kimi-service/plan.json "$RESULTS/moe-plan.json" 2>/dev/null || true
    curl -sS -m 30 http://127.0.0.1:9400/metrics > "$RESULTS/moe-exporter.prom" || true
    grep -E '^kimi_kv_cache_tokens|^kimi_plan_info' "$RESULTS/moe-exporter.prom" | cut -c1-400 || true
    grep -h -E 'GPU KV cache size|Available KV cache memory|MoE backend|Model loading took|torch.compile takes|Graph capturing finished|init engine' \
        /var/lib/kimi-service/logs/*.log 2>/dev/null | tail -20 | tee "$RESULTS/moe-engine-lines.txt" || true
}

section_moe_probe() {
    local model_dir pid started
    model_dir=$(deployed_model_dir)
    log "vllm serve $model_dir with vLLM's own MoE backend choice, 150 s, the deployed engine stopped"
    "${SUPERVISORCTL[@]}" stop kimi-vllm
    VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 setsid "$VENV/bin/vllm" serve "$model_dir" \
        --served-model-name probe --port 8000 --max-model-len 8192 > "$RESULTS/moe-probe.log" 2>&1 < /dev/null &
    pid=$!
    started=$SECONDS
    while ((SECONDS - started < 150)); do
        if curl -sf -m 2 -o /dev/null http://127.0.0.1:8000/health; then
            echo "served after $((SECONDS - started)) s" | tee -a "$RESULTS/moe-probe-ps.txt"
            break
        fi
        kill -0 "$pid" 2>/dev/null || break
        {
            echo "== $((SECONDS - started)) s"
            ps -eo pid,etimes,pcpu,args --sort=-pcpu | grep -E 'nvcc|cicc|ptxas|ninja|c\+\+|gcc|VLLM|vllm' \
                | grep -v grep | cut -c1-250 | head -12
        } >> "$RESULTS/moe-probe-ps.txt"
        sleep 15
    done
    stop_group "$pid"
    grep -E 'MoE|moe|flashinfer|FlashInfer|JIT|jit|compil' "$RESULTS/moe-probe.log" | cut -c1-300 | tail -25 || true
    tail -40 "$RESULTS/moe-probe-ps.txt"
}

section_kimi() {
    log "Kimi K2.5 as it ships: make_model.py --shape $KIMI_SHAPE"
    rm -rf "$MODEL_SRC" "$MOE_SRC"
    local need free
    need=$(PYTHONPATH=bench/gpu "$PYTHON" -c 'import sys, kimi_model
print(2 * kimi_model.index(kimi_model.shape_named(sys.argv[1]).config())["metadata"]["total_size"])' "$KIMI_SHAPE")
    free=$(df -B1 --output=avail "$E2E" | tail -1)
    if ((free < need)); then
        echo "$KIMI_SHAPE needs $((need / 10**9)) GB free for its source and deployed copy, $((free / 10**9)) GB here"
        return 1
    fi
    "$PYTHON" bench/gpu/make_model.py "$KIMI_SRC" --shape "$KIMI_SHAPE"
    du -sh "$KIMI_SRC"
    write_inventory "$MOE_INVENTORY" "e2e/$KIMI_SHAPE" "$KIMI_SRC" "    kimi_preflight_disk_headroom_gb: 5"
    log "site.yml with $KIMI_SHAPE (in the background; this call waits up to ${KIMI_WAIT:-480} s, section wait waits again)"
    local rc=0
    background_site kimi "$MOE_INVENTORY" "${KIMI_WAIT:-480}" || rc=$?
    moe_report
    return $rc
}

section_kimi_checks() {
    log "Kimi K2.5 through the deployed endpoint: chat, tool call round trip, reasoning, image"
    moe_report
    grep -h -E 'Using .*(Marlin|MoE|WNA16)|CompressedTensorsWNA16' /var/lib/kimi-service/logs/*.log 2>/dev/null \
        | cut -c1-300 | tail -5 | tee "$RESULTS/kimi-moe-backend.txt" || true
    KEY=$(sed -n 's/^VLLM_API_KEY="\(.*\)"$/\1/p' /etc/kimi-service/secrets.env 2>/dev/null) "$PYTHON" - "$RESULTS" <<'PY'
import base64, io, json, os, sys, urllib.request
results, key = sys.argv[1], os.environ.get("KEY", "")
def chat(**body):
    body = {"model": "e2e", "max_tokens": 48, **body}
    request = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        return json.load(reply)
tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
call = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
from PIL import Image
buffer = io.BytesIO()
Image.new("RGB", (448, 336), "teal").save(buffer, format="PNG")
png = base64.b64encode(buffer.getvalue()).decode()
checks = {
    "chat": chat(messages=[{"role": "user", "content": "hello"}]),
    "no-thinking": chat(messages=[{"role": "user", "content": "hello"}],
                        chat_template_kwargs={"thinking": False}),
    "tools": chat(messages=[{"role": "user", "content": "weather in Paris?"}], tools=[tool], tool_choice="auto"),
    "tool-result": chat(tools=[tool], messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]),
    "image": chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}]),
}
for name, reply in checks.items():
    message = reply["choices"][0]["message"]
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    print(f"{name}: prompt {reply['usage']['prompt_tokens']} tokens; reasoning {len(reasoning)} chars, "
          f"content {len(message.get('content') or '')} chars, tool_calls {len(message.get('tool_calls') or [])}")
json.dump(checks, open(f"{results}/kimi-checks.json", "w"), indent=2)
PY
}

section_kill() {
    log "kill -9 of vLLM's API server"
    local pid started
    pid=$(pgrep -f vllm.entrypoints.openai.api_server | head -1) || true
    if [[ -z $pid ]]; then
        echo "no vLLM API server runs: nothing to kill (did the converge before fail?)"
        return 1
    fi
    echo "vLLM pid $pid"
    started=$SECONDS
    kill -9 "$pid"
    # Out of service first (serve sees its engine die), then serving again.
    while curl -sf -m 5 -o /dev/null http://127.0.0.1:8001/ready && ((SECONDS - started < 60)); do
        sleep 0.5
    done
    echo "not ready $((SECONDS - started)) s after kill -9"
    wait_deployed_ready "$started" 540 || return 1
    echo "serving again $((SECONDS - started)) s after kill -9" | tee -a "$RESULTS/timings.txt"
}

section_uninstall() {
    log "playbooks/uninstall.yml"
    playbook playbooks/uninstall.yml uninstall
}

if [[ ${1:-} == --functions-only ]]; then
    return 0
fi
started=$SECONDS
failed=()
for section in "$@"; do
    set +e
    ("section_${section//-/_}")
    rc=$?
    set -e
    if ((rc != 0)); then
        echo "SECTION $section FAILED (exit $rc)"
        failed+=("$section")
    fi
done
cp -a /etc/kimi-service/config.yaml "$RESULTS/" 2>/dev/null || true
for log in /var/lib/kimi-service/logs/*.log; do
    [[ -f $log ]] && tail -c 200000 "$log" > "$RESULTS/$(basename "$log")"
done
tar -C "$RESULTS" -czf "$OUT/e2e.tar.gz" .
echo "sections $* took $((SECONDS - started)) s; results in $OUT/e2e.tar.gz"
((${#failed[@]} == 0))
