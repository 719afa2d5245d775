#!/usr/bin/env bash
# Runs on a networked machine, in the repository: downloads the wheels pinned in wheels.lock (vLLM and
# the run-time packages the H200 image lacks), builds this project's wheel, and packs everything into
# parts small enough for one device call each (a call carries at most 64 MiB).
# Usage: bench/gpu/prepare_wheels.sh            (PYTHON=... to pick the interpreter that runs pip)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
LOCK="$ROOT/bench/gpu/wheels.lock"
WHEELS="$ROOT/.device/wheels"
PARTS="$ROOT/.device/parts"
PART_BYTES=60000000
VLLM_SHA256_PREFIX=f4a75b13
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PYTHON ]] || PYTHON=python3
# The ansible-core pin is read from the controller's install: fail before the long download, not after it.
"$PYTHON" -c 'import ansible.release' 2>/dev/null || {
    echo "prepare_wheels.sh: $PYTHON has no ansible-core; run scripts/bootstrap.sh (or make bootstrap) first" >&2
    exit 1
}

platforms=()
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

mkdir -p "$WHEELS"
echo "== downloading $(grep -c '^[a-z]' "$LOCK") pinned wheels into $WHEELS"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --require-hashes -r "$LOCK" -d "$WHEELS"

# A second version of any package would stop the install there: keep only what the lock names.
mapfile -t pinned < <(sed -n 's/^\([a-z0-9_]*\)==\([^ ]*\) .*/\1-\2/p' "$LOCK")
for wheel in "$WHEELS"/*.whl; do
    base=$(basename "$wheel")
    normalized=$(echo "$base" | tr 'A-Z.-' 'a-z__')
    keep=false
    for want in "${pinned[@]}"; do
        want=$(echo "$want" | tr '.-' '__')
        [[ $normalized == "${want}"_* ]] && keep=true && break
    done
    if [[ $keep == false ]]; then
        echo "removing $base (not in wheels.lock)"
        rm -f "$wheel"
    fi
done

vllm_wheel=$(find "$WHEELS" -name "vllm-*.whl")
vllm_sha=$(sha256sum "$vllm_wheel" | cut -d' ' -f1)
if [[ $vllm_sha != "$VLLM_SHA256_PREFIX"* ]]; then
    echo "error: $(basename "$vllm_wheel") has sha256 $vllm_sha, expected $VLLM_SHA256_PREFIX...; " \
        "delete $WHEELS and run again" >&2
    exit 1
fi
echo "vllm wheel sha256 $vllm_sha"

echo "== building this project's wheel"
rm -f "$WHEELS"/kimi_service-*.whl
build_dir=$(mktemp -d)
trap 'rm -rf "$build_dir"' EXIT
cp -a "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/kimi_service" "$build_dir/"
"$PYTHON" -m pip wheel --quiet --no-deps -w "$WHEELS" "$build_dir"

echo "== packing into parts of at most $PART_BYTES bytes"
rm -rf "$PARTS"
mkdir -p "$PARTS"
tar -C "$WHEELS" -cf "$build_dir/wheels.tar" .
split -b "$PART_BYTES" -d -a 2 "$build_dir/wheels.tar" "$build_dir/wheels.tar.part-"
chunks=("$build_dir"/wheels.tar.part-*)
{
    echo "tar $(sha256sum "$build_dir/wheels.tar" | cut -d' ' -f1) ${#chunks[@]}"
    for chunk in "${chunks[@]}"; do echo "part $(sha256sum "$chunk" | cut -d' ' -f1) $(basename "$chunk")"; done
} > "$build_dir/MANIFEST"
i=0
for chunk in "${chunks[@]}"; do
    i=$((i + 1))
    mkdir -p "$PARTS/p$i"
    mv "$chunk" "$PARTS/p$i/"
    cp "$build_dir/MANIFEST" "$PARTS/p$i/MANIFEST"
done

# site.yml runs on the device itself (ansible_connection: local, bench/gpu/site_e2e.sh): ansible-core at this
# checkout's version and what it needs, for the device's Python. Small enough to travel with the last part.
ANSIBLE_WHEELS="$ROOT/.device/ansible"
rm -rf "$ANSIBLE_WHEELS"
ansible_version=$("$PYTHON" -c 'import ansible.release; print(ansible.release.__version__)')
echo "== downloading ansible-core $ansible_version and its requirements into $ANSIBLE_WHEELS"
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" "ansible-core==$ansible_version" -d "$ANSIBLE_WHEELS"

echo "== $(find "$WHEELS" -name "*.whl" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1); carry one part per device call:"
for dir in "$PARTS"/p*; do
    printf '%-22s %10d bytes (%s)\n' ".device/parts/$(basename "$dir")" "$(du -cb "$dir"/* | tail -1 | cut -f1)" \
        "$(du -sh "$dir" | cut -f1)"
done
printf '%-22s %10d bytes (%s): carry it with the last part\n' ".device/ansible" \
    "$(du -cb "$ANSIBLE_WHEELS"/* | tail -1 | cut -f1)" "$(du -sh "$ANSIBLE_WHEELS" | cut -f1)"
