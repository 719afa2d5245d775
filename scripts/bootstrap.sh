#!/usr/bin/env bash
# Installs what the demo and the tests need on a Debian/Ubuntu controller, reusing caches:
# host packages (apt), then the project's venv at .venv with the package and its dev tools.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

# prometheus: its promtool checks and unit-tests the alert rules of monitoring/.
host_packages=(debootstrap systemd-container zstd iproute2 nftables openssh-client rsync apt-utils prometheus)
missing=()
for pkg in "${host_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $EUID -ne 0 ]]; then
        echo "bootstrap: need root to install: ${missing[*]}" >&2
        exit 1
    fi
    echo "bootstrap: installing host packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # The tests need only Prometheus's binaries, not the daemon the package starts on this machine.
    if [[ " ${missing[*]} " == *" prometheus "* ]] && [[ -d /run/systemd/system ]]; then
        systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
fi

python=${KIMI_PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "bootstrap: Python 3.11 or newer is needed (found $("$python" --version 2>&1)); set KIMI_PYTHON" >&2
    exit 1
fi

stamp=.venv/.kimi-bootstrap
fingerprint=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$fingerprint" ]]; then
    exit 0
fi
echo "bootstrap: creating .venv and installing kimi-service[dev]"
"$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
echo "$fingerprint" >"$stamp"
