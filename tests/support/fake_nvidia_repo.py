"""A local stand-in for NVIDIA's CUDA apt repository (debian12/x86_64), signed and served over HTTP.

The packages carry the names, versions and dependencies of NVIDIA's Debian 12 repository for one
driver branch; their payloads are placeholders (an nvidia-smi that reports no driver, systemd units
that sleep), so apt, pins, holds, repository files, services and the roles' logic run for real while
NVIDIA's servers cannot be reached. The repository is signed with a throw-away key published at the
path of NVIDIA's signing key, so the roles' keyring handling is exercised too.

Also published: a linux-headers package for the controller's running kernel, because a test host is
a container without a kernel of its own and the role installs headers for `uname -r`.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import tempfile
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path

DISTRO = "debian12"
ARCH_DIR = "x86_64"
# The file name of NVIDIA's CUDA repository signing key (the key rotated in 2022).
KEY_FILE = "3bf863cc.pub"

_NO_DRIVER_SMI = """#!/bin/sh
echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." >&2
exit 9
"""


def _unit(description: str) -> str:
    return textwrap.dedent(f"""\
        [Unit]
        Description={description} (test stand-in)

        [Service]
        ExecStart=/bin/sleep infinity

        [Install]
        WantedBy=multi-user.target
        """)


@dataclass
class Package:
    name: str
    version: str
    depends: str = ""
    conflicts: str = ""
    provides: str = ""
    files: dict[str, tuple[str, int]] = field(default_factory=dict)


def driver_packages(version: str) -> list[Package]:
    """NVIDIA's Debian 12 compute driver stack for one driver version (e.g. 580.95.05)."""
    deb = f"{version}-1"
    return [
        Package("nvidia-kernel-open-dkms", deb, provides=f"nvidia-kernel-dkms-any (= {deb})",
                conflicts="nvidia-kernel-dkms",
                files={f"/usr/src/nvidia-{version}/dkms.conf": (f'PACKAGE_VERSION="{version}"\n', 0o644)}),
        Package("nvidia-kernel-dkms", deb, provides=f"nvidia-kernel-dkms-any (= {deb})",
                conflicts="nvidia-kernel-open-dkms",
                files={f"/usr/src/nvidia-{version}/dkms.conf": (f'PACKAGE_VERSION="{version}"\n', 0o644)}),
        Package("libnvidia-ml1", deb),
        Package("libcuda1", deb, depends=f"libnvidia-ml1 (= {deb})"),
        Package("nvidia-driver-cuda", deb,
                depends=f"libcuda1 (= {deb}), nvidia-kernel-open-dkms (= {deb}) | nvidia-kernel-dkms (= {deb})",
                files={"/usr/bin/nvidia-smi": (_NO_DRIVER_SMI, 0o755)}),
        Package("nvidia-persistenced", deb, depends=f"libnvidia-ml1 (= {deb})",
                files={"/lib/systemd/system/nvidia-persistenced.service": (_unit("NVIDIA Persistence Daemon"), 0o644)}),
        Package("libnvidia-nscq", deb),
        Package("nvidia-fabricmanager", deb,
                files={"/lib/systemd/system/nvidia-fabricmanager.service": (_unit("NVIDIA fabric manager"), 0o644)}),
        Package("nvidia-open", deb, depends=f"nvidia-driver-cuda (= {deb}), nvidia-kernel-open-dkms (= {deb})"),
        Package("cuda-drivers", deb, depends=f"nvidia-driver-cuda (= {deb}), nvidia-kernel-dkms (= {deb})"),
    ]


def toolkit_packages(major: int, minor: int, patch: int) -> list[Package]:
    dashed, dotted, deb = f"{major}-{minor}", f"{major}.{minor}", f"{major}.{minor}.{patch}-1"
    nvcc = f"#!/bin/sh\necho 'Cuda compilation tools, release {dotted} (test stand-in)'\n"
    return [
        Package(f"cuda-nvcc-{dashed}", deb, files={f"/usr/local/cuda-{dotted}/bin/nvcc": (nvcc, 0o755)}),
        Package(f"cuda-toolkit-{dashed}", deb, depends=f"cuda-nvcc-{dashed} (>= {deb})"),
    ]


def support_packages() -> list[Package]:
    return [
        Package("cuda-keyring", "1.1-1"),
        Package(f"linux-headers-{os.uname().release}", "1.0-1",
                files={f"/usr/src/linux-headers-{os.uname().release}/Makefile": ("# stand-in\n", 0o644)}),
    ]


def _build_deb(package: Package, out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for path, (content, mode) in package.files.items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
            target.chmod(mode)
        control = [
            f"Package: {package.name}", f"Version: {package.version}", "Architecture: amd64",
            "Maintainer: kimi-service tests <tests@localhost>", "Section: non-free/libs", "Priority: optional",
        ]
        for key, value in (("Depends", package.depends), ("Conflicts", package.conflicts),
                           ("Provides", package.provides)):
            if value:
                control.append(f"{key}: {value}")
        control.append(f"Description: {package.name} (test stand-in for NVIDIA's package)")
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN/control").write_text("\n".join(control) + "\n")
        deb = out_dir / f"{package.name}_{package.version}_amd64.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(root), str(deb)],
                       check=True, capture_output=True)


class FakeNvidiaRepo:
    """A flat, signed apt repository at <root>/debian12/x86_64/, like NVIDIA's layout."""

    def __init__(self, root: Path) -> None:
        for tool in ("dpkg-deb", "apt-ftparchive", "gpg"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is missing: run scripts/bootstrap.sh (it installs apt-utils)")
        self.root = root
        self.pool = root / DISTRO / ARCH_DIR
        self.pool.mkdir(parents=True, exist_ok=True)
        self.gnupg = root.parent / f"{root.name}.gnupg"
        self.gnupg.mkdir(mode=0o700, exist_ok=True)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._make_key()

    def _gpg(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["gpg", "--homedir", str(self.gnupg), "--batch", "--yes", *args],
                              check=True, capture_output=True, text=True)

    def _make_key(self) -> None:
        self._gpg("--passphrase", "", "--quick-gen-key", "kimi-service test repository", "ed25519", "sign", "never")
        (self.pool / KEY_FILE).write_text(self._gpg("--armor", "--export").stdout)

    def publish(self, packages: list[Package]) -> None:
        """Add packages and re-sign the index, as NVIDIA does when a release lands."""
        for package in packages:
            _build_deb(package, self.pool)
        packages_index = subprocess.run(["apt-ftparchive", "packages", "."], cwd=self.pool,
                                        check=True, capture_output=True, text=True).stdout
        (self.pool / "Packages").write_text(packages_index)
        release = subprocess.run(
            ["apt-ftparchive", "-o", "APT::FTPArchive::Release::Origin=NVIDIA",
             "-o", "APT::FTPArchive::Release::Label=NVIDIA CUDA (test stand-in)", "release", "."],
            cwd=self.pool, check=True, capture_output=True, text=True,
        ).stdout
        (self.pool / "Release").write_text(release)
        for name in ("InRelease", "Release.gpg"):
            (self.pool / name).unlink(missing_ok=True)
        self._gpg("--clearsign", "-o", str(self.pool / "InRelease"), str(self.pool / "Release"))
        self._gpg("-abs", "-o", str(self.pool / "Release.gpg"), str(self.pool / "Release"))

    def serve(self, address: str = "127.0.0.1") -> str:
        """Serve the repository over HTTP in a thread; returns the base URL (like .../compute/cuda/repos)."""
        handler = functools.partial(_QuietHandler, directory=str(self.root))
        self._server = http.server.ThreadingHTTPServer((address, 0), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://{address}:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass
