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
#              .device/ansible, the model (skipped when present)
#   converge   ansible-playbook site.yml, the first run, in the background (it may outlast one call)
#   wait       wait for that run to end
#   rerun      site.yml again (changed=0 expected), kimi-service health --json, a scrape of the exporter
#   kill       kill -9 of vLLM: seconds until the endpoint serves again under supervisord
#   uninstall  playbooks/uninstall.yml
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
E2E=${E2E:-/tmp/kimi-e2e}
OUT=${OUT:-$E2E/out}
RESULTS="$E2E/results"
WHEELHOUSE="$E2E/wheelhouse"
ANSIBLE_SITE="$E2E/ansible"
MODEL_SRC="$E2E/models/llama-3.1-8b"
INVENTORY="$E2E/inventory/hosts.yml"
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
        "$PYTHON" "$ANSIBLE_SITE/bin/ansible-playbook" -i "$INVENTORY" "$name" "$@" > "$RESULTS/$logfile.log" 2>&1 \
        || rc=$?
    echo "$name $* exit $rc in $((SECONDS - started)) s" | tee -a "$RESULTS/timings.txt"
    report "$logfile"
    return $rc
}

wait_converge() {  # the first run goes on in the background past one call's limit; wait up to $1 s
    local deadline=$((SECONDS + $1))
    while [[ ! -f $RESULTS/converge.rc ]] && ((SECONDS < deadline)); do
        sleep 5
    done
    if [[ ! -f $RESULTS/converge.rc ]]; then
        echo "site.yml still running; last task:"
        grep 'TASK \[' "$RESULTS/converge.log" | tail -1
        return 1
    fi
    report converge
    return "$(cat "$RESULTS/converge.rc")"
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
    if [[ ! -f $MODEL_SRC/config.json ]]; then
        "$PYTHON" bench/gpu/make_model.py "$MODEL_SRC" --shape llama-3.1-8b
    fi
    du -sh "$MODEL_SRC"
    local torch_site
    torch_site=$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    cat > "$INVENTORY" <<EOF
all:
  hosts:
    gpu0:
      ansible_connection: local
      ansible_python_interpreter: /usr/bin/python3
  vars:
    kimi_model: e2e/llama-3.1-8b
    kimi_model_source: local
    kimi_model_local_path: $MODEL_SRC
    kimi_served_model_name: e2e
    kimi_wheelhouse: $WHEELHOUSE
    # The image's CUDA torch (gigabytes) is used as it is: the venv sees it, the wheelhouse need not carry it.
    kimi_runtime_site_packages: [$torch_site]
    # flashinfer's sampler JIT-compiles kernels its cubin package (not carried) would provide.
    kimi_vllm_extra_env: {VLLM_USE_FLASHINFER_SAMPLER: "0"}
EOF
    cp "$INVENTORY" "$RESULTS/inventory.yml"
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
        echo "PID 1: $(tr '\0' ' ' < /proc/1/cmdline | cut -c1-80)"
        echo "python3: $(command -v "$PYTHON") $("$PYTHON" --version 2>&1); torch site: $torch_site"
        df -h /tmp | tail -1
    } | tee "$RESULTS/facts.txt"
}

section_converge() {
    log "site.yml, first run (in the background; this call waits up to 530 s, section wait waits again)"
    rm -f "$RESULTS/converge.rc"
    setsid nohup bash -c "source '$REPO/bench/gpu/site_e2e.sh' --functions-only
        rc=0; playbook site.yml converge || rc=\$?; echo \$rc > '$RESULTS/converge.rc'" > /dev/null 2>&1 < /dev/null &
    wait_converge 530
}

section_wait() {
    wait_converge 560
}

section_rerun() {
    log "site.yml, second run"
    playbook site.yml rerun || true
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

section_kill() {
    log "kill -9 of vLLM's API server"
    local pid started
    pid=$(pgrep -f vllm.entrypoints.openai.api_server | head -1)
    echo "vLLM pid $pid"
    started=$SECONDS
    kill -9 "$pid"
    # Out of service first (serve sees its engine die), then serving again.
    while curl -sf -m 5 -o /dev/null http://127.0.0.1:8001/ready && ((SECONDS - started < 60)); do
        sleep 0.5
    done
    echo "not ready $((SECONDS - started)) s after kill -9"
    until curl -sf -m 5 -o /dev/null http://127.0.0.1:8001/ready; do
        if ((SECONDS - started > 540)); then
            echo "not serving again after 540 s"
            return 1
        fi
        sleep 2
    done
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
    ("section_$section")
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
