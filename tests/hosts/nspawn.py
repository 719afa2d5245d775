"""Real systemd test hosts: Debian 12 roots booted with systemd-nspawn on throw-away overlays.

The root is built once with debootstrap and cached as a zstd tarball; each host boots a fresh
overlay of it, reachable over SSH either on the controller's network (one host at a time per
port set) or in a network namespace of its own behind a bridge (several hosts that talk to each
other). Hosts are started detached, so the demo can outlive the command that started it, and
are always stopped by PID with their mounts removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.ports import free_port

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
ROOT_PACKAGES = (
    "systemd,systemd-sysv,udev,dbus,openssh-server,python3,python3-apt,sudo,iproute2,"
    "ca-certificates,netbase,procps,kmod,pciutils,curl,gnupg,less"
)
# Bump when the root's customisation below changes, so cached roots are rebuilt.
ROOT_RECIPE_VERSION = "1"
REBOOT_EXIT_STATUS = 133
SSH_OPTIONS = (
    "-o", "StrictHostKeyChecking=no",
    "-o", "UserKnownHostsFile=/dev/null",
    "-o", "LogLevel=ERROR",
    "-o", "BatchMode=yes",
    "-o", "ConnectTimeout=3",
)


class HostError(RuntimeError):
    """A test host could not be built, booted or stopped; the message carries the evidence."""


def cache_dir() -> Path:
    path = Path(os.environ.get("KIMI_CACHE_DIR") or Path.home() / ".cache" / "kimi-service")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """Serialise builders across parallel test sessions sharing the cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_dir() -> Path:
    """Where live hosts keep their overlays and PID files (tmpfs-backed /run when possible)."""
    path = Path(os.environ.get("KIMI_TESTHOST_RUN_DIR", "/var/tmp/kimi-testhosts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _mirror() -> str:
    return os.environ.get("KIMI_DEBIAN_MIRROR", DEFAULT_MIRROR)


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("check", True)
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    try:
        return subprocess.run(argv, **kwargs)
    except subprocess.CalledProcessError as exc:
        raise HostError(
            f"{' '.join(argv)} failed with exit {exc.returncode}:\n{exc.stdout or ''}{exc.stderr or ''}"
        ) from exc


# ---------------------------------------------------------------------------------------------
# The root image


def _root_key() -> str:
    digest = hashlib.sha256(f"{SUITE}|{ROOT_PACKAGES}|{ROOT_RECIPE_VERSION}".encode()).hexdigest()
    return f"debian12-{digest[:12]}"


def _customise_root(root: Path) -> None:
    """Make the bare debootstrap root a useful, quiet server."""
    (root / "etc/hostname").unlink(missing_ok=True)
    (root / "etc/machine-id").write_text("")
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    # Host keys are made at build time once; every host booted from this root shares them,
    # which is harmless for throw-away test hosts and saves a second per boot.
    _run(["chroot", str(root), "ssh-keygen", "-A"])
    (root / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
    # A persistent journal, so the controller can read it from the overlay when the guest is down.
    (root / "var/log/journal").mkdir(parents=True, exist_ok=True)
    # A console getty would fight the passive console; hosts are reached over SSH only.
    for unit in ("getty@tty1.service", "console-getty.service", "systemd-firstboot.service"):
        (root / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (root / "etc/systemd/system" / unit).symlink_to("/dev/null")
    (root / "etc/apt/sources.list").write_text(
        f"deb {_mirror()} {SUITE} main\ndeb {_mirror()} {SUITE}-updates main\n"
    )


def ensure_root_image() -> Path:
    """The unpacked root directory (overlay lower layer), built or unpacked from the cache."""
    key = _root_key()
    images = cache_dir() / "images"
    images.mkdir(exist_ok=True)
    lower = images / key
    if (lower / ".complete").exists():
        return lower
    with cache_lock(images / f"{key}.lock"):
        if not (lower / ".complete").exists():
            _unpack_root_image(key, lower)
    return lower


def _unpack_root_image(key: str, lower: Path) -> None:
    images = lower.parent
    tarball = cache_dir() / f"{key}.tar.zst"
    if not tarball.exists():
        _build_tarball(tarball)
    staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=images))
    try:
        _run(["tar", "--zstd", "-xpf", str(tarball), "-C", str(staging), "--numeric-owner"])
        (staging / ".complete").write_text(key)
        if lower.exists():
            shutil.rmtree(lower)
        staging.rename(lower)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _build_tarball(tarball: Path) -> None:
    for tool in ("debootstrap", "systemd-nspawn", "zstd"):
        if shutil.which(tool) is None:
            raise HostError(f"{tool} is missing: run scripts/bootstrap.sh (it installs the host packages)")
    started = time.monotonic()
    build = Path(tempfile.mkdtemp(prefix="root-build.", dir=cache_dir()))
    root = build / "root"
    try:
        _run(
            ["debootstrap", "--variant=minbase", f"--include={ROOT_PACKAGES}", SUITE, str(root), _mirror()],
            timeout=1200,
        )
        _customise_root(root)
        _run(["apt-get", "-o", f"Dir={root}", "clean"], check=False)
        partial = tarball.with_suffix(".partial")
        _run(["tar", "--zstd", "-cpf", str(partial), "-C", str(root), "--numeric-owner", "."])
        partial.rename(tarball)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    print(f"testhost: built {tarball.name} in {time.monotonic() - started:.0f} s")


# ---------------------------------------------------------------------------------------------
# Networks


@dataclass
class Network:
    """A bridge on the controller with one network namespace per host, NATed to the outside."""

    name: str
    subnet_octet: int
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"kbr{self.name}"

    @property
    def gateway(self) -> str:
        return f"10.213.{self.subnet_octet}.1"

    @property
    def cidr(self) -> str:
        return f"10.213.{self.subnet_octet}.0/24"

    def address(self, index: int) -> str:
        return f"10.213.{self.subnet_octet}.{10 + index}"

    @classmethod
    def create(cls) -> Network:
        name = secrets.token_hex(3)
        # Test sessions run side by side: the subnet is chosen and taken under one lock, among those
        # no bridge of this controller holds yet.
        with cache_lock(cache_dir() / "networks.lock"):
            net = cls(name=name, subnet_octet=_free_subnet_octet())
            _run(["ip", "link", "add", net.bridge, "type", "bridge"])
            _run(["ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge])
        _run(["ip", "link", "set", net.bridge, "up"])
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        _run(["nft", "-f", "-"], input=(
            f"table ip kimi_testnet_{name} {{\n"
            f"  chain postrouting {{ type nat hook postrouting priority srcnat; "
            f"ip saddr {net.cidr} ip daddr != {net.cidr} masquerade; }}\n"
            f"}}\n"
        ))
        return net

    def add_namespace(self, index: int) -> str:
        ns = f"kimi-{self.name}-{index}"
        veth_host, veth_guest = f"kv{self.name}{index}", f"kg{self.name}{index}"
        _run(["ip", "netns", "add", ns])
        self.namespaces.append(ns)
        _run(["ip", "link", "add", veth_host, "type", "veth", "peer", "name", veth_guest])
        _run(["ip", "link", "set", veth_host, "master", self.bridge, "up"])
        _run(["ip", "link", "set", veth_guest, "netns", ns])
        inside = ["ip", "netns", "exec", ns]
        _run([*inside, "ip", "link", "set", "lo", "up"])
        _run([*inside, "ip", "link", "set", veth_guest, "name", "eth0"])
        _run([*inside, "ip", "addr", "add", f"{self.address(index)}/24", "dev", "eth0"])
        _run([*inside, "ip", "link", "set", "eth0", "up"])
        _run([*inside, "ip", "route", "add", "default", "via", self.gateway])
        return ns

    def destroy(self) -> None:
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        self.namespaces.clear()
        _run(["ip", "link", "del", self.bridge], check=False)
        _run(["nft", "delete", "table", "ip", f"kimi_testnet_{self.name}"], check=False)


def _free_subnet_octet() -> int:
    taken = set(re.findall(r"inet 10\.213\.(\d+)\.", _run(["ip", "-o", "-4", "addr", "show"]).stdout))
    free = [octet for octet in range(2, 252) if str(octet) not in taken]
    if not free:
        raise HostError("every 10.213.X.0/24 test subnet is taken: leftover bridges? `ip -o -4 addr show`")
    return secrets.choice(free)


# ---------------------------------------------------------------------------------------------
# Hosts


def _ssh_keypair() -> Path:
    key = cache_dir() / "testhost_ed25519"
    with cache_lock(cache_dir() / "testhost_ed25519.lock"):
        if not key.exists():
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kimi-testhost", "-f", str(key)])
    return key


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_mounted(path: Path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


@dataclass
class TestHost:
    """One booted systemd-nspawn guest."""

    __test__ = False  # not a pytest test class

    name: str
    address: str
    ssh_port: int
    workdir: Path
    netns: str | None = None
    # False: a container rental's shape, systemd not PID 1 (sshd runs under nspawn's stub init instead).
    systemd: bool = True
    # Host directories bind-mounted into the guest, as "HOST:GUEST" (a rental's persistent volume).
    binds: tuple[str, ...] = ()
    # Without systemd: a shell command run before sshd, as a rental runs its provider start command.
    start_command: str = ""

    # --- paths -------------------------------------------------------------------------------
    @property
    def merged(self) -> Path:
        return self.workdir / "merged"

    @property
    def console_log(self) -> Path:
        return self.workdir / "console.log"

    @property
    def state_file(self) -> Path:
        return self.workdir / "host.json"

    def _read_pid(self, name: str) -> int | None:
        try:
            return int((self.workdir / name).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def nspawn_pid(self) -> int | None:
        return self._read_pid("nspawn.pid")

    @property
    def boots(self) -> int:
        """How many times the guest has been started (a reboot starts it again)."""
        try:
            return len((self.workdir / "boots").read_text().split())
        except FileNotFoundError:
            return 0

    # --- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def create(
        cls, name: str, *, network: Network | None = None, index: int = 0, layers: tuple[Path, ...] = (),
        systemd: bool = True, binds: tuple[str, ...] = (), start_command: str = "",
    ) -> TestHost:
        """A host on a fresh overlay of the root image, with `layers` (captured hosts, newest first)
        stacked over the root: it boots as those hosts were when they were captured."""
        lower = ":".join(str(layer) for layer in (*layers, ensure_root_image()))
        workdir = run_dir() / name
        if workdir.exists():
            raise HostError(f"a test host named {name} already exists at {workdir}; stop it first")
        workdir.mkdir(parents=True)
        netns = network.add_namespace(index) if network else None
        host = cls(
            name=name,
            address=network.address(index) if network else "127.0.0.1",
            ssh_port=22 if network else free_port(),
            workdir=workdir,
            netns=netns,
            systemd=systemd,
            binds=tuple(binds),
            start_command=start_command,
        )
        host.state_file.write_text(json.dumps({
            "name": name, "address": host.address, "ssh_port": host.ssh_port, "netns": netns,
            "systemd": systemd, "binds": list(binds), "start_command": start_command,
        }))
        for sub in ("upper", "work", "merged"):
            (workdir / sub).mkdir()
        _run([
            "mount", "-t", "overlay", "overlay",
            "-o", f"lowerdir={lower},upperdir={workdir / 'upper'},workdir={workdir / 'work'}",
            str(host.merged),
        ])
        host._personalise()
        return host

    @classmethod
    def load(cls, name: str) -> TestHost:
        workdir = run_dir() / name
        state = json.loads((workdir / "host.json").read_text())
        return cls(name=state["name"], address=state["address"], ssh_port=state["ssh_port"],
                   workdir=workdir, netns=state["netns"], systemd=state.get("systemd", True),
                   binds=tuple(state.get("binds", ())), start_command=state.get("start_command", ""))

    def _personalise(self) -> None:
        root = self.merged
        pubkey = _ssh_keypair().with_suffix(".pub").read_text()
        keys = root / "root/.ssh/authorized_keys"
        keys.write_text(pubkey)
        keys.chmod(0o600)
        listen = "127.0.0.1" if self.netns is None else self.address
        (root / "etc/ssh/sshd_config.d/kimi-testhost.conf").write_text(
            f"Port {self.ssh_port}\nListenAddress {listen}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nUseDNS no\n"
        )
        # The controller's CA bundle, so HTTPS (pip) through an intercepting proxy works inside.
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.exists():
            shutil.copyfile(bundle, root / "etc/ssl/certs/ca-certificates.crt")
        (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {self.name}\n")

    def cgroups(self) -> list[Path]:
        """This guest's own cgroup in each hierarchy a guest's systemd uses.

        nspawn with --keep-unit puts the guest in a `payload` cgroup below the one it was started in.
        Started from the same cgroup, every guest would share `payload/system.slice/...`: the same
        unit on two guests would then be one cgroup, and one guest's stop kills, freezes or
        re-attaches the other's processes (seen as "Failed to kill control group" and starts hanging).
        """
        root = Path("/sys/fs/cgroup")
        if (root / "cgroup.procs").exists():  # the unified hierarchy alone
            hierarchies = [root]
        else:  # hybrid: the v2 tree and systemd's named v1 tree
            hierarchies = [h for h in (root / "unified", root / "systemd") if (h / "cgroup.procs").exists()]
        return [h / "kimi-testhosts" / self.name for h in hierarchies]

    def _remove_cgroups(self) -> None:
        for top in self.cgroups():
            for directory, _subdirs, _files in sorted(os.walk(top), key=lambda d: -d[0].count("/")):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)

    def start(self, timeout: float = 90) -> None:
        argv = [
            "systemd-nspawn", f"--directory={self.merged}", f"--machine={self.name}",
            "--register=no", "--keep-unit", "--resolv-conf=copy-host", "--timezone=off",
            *(f"--bind={bind}" for bind in self.binds),
        ]
        if self.netns:
            argv.append(f"--network-namespace-path=/run/netns/{self.netns}")
        if self.systemd:
            argv += ["--boot", "--console=read-only"]
            if self.netns:
                # Network administration (nftables) is safe to grant only inside a namespace of its own.
                argv.append("--capability=CAP_NET_ADMIN")
        else:
            # As a rented container is started: no systemd, no network administration, one foreground
            # process (here sshd, so the play can reach it).
            before = f"{self.start_command}; " if self.start_command else ""
            argv += ["--as-pid2", "--console=pipe", "--", "/bin/sh", "-c",
                     f"{before}mkdir -p /run/sshd && exec /usr/sbin/sshd -D -e"]
        cgroups = self.cgroups()
        for cgroup in cgroups:
            cgroup.mkdir(parents=True, exist_ok=True)
        # A supervisor loop: `systemctl reboot` in the guest makes nspawn exit 133; start it again.
        # It first moves itself into the guest's own cgroups, so nspawn and the guest start there.
        enter = "".join(f"echo $$ > {cgroup}/cgroup.procs; " for cgroup in cgroups)
        loop = (
            f"{enter}while :; do date +%s >> boots; {shlex.join(argv)} & echo $! > nspawn.pid; wait $!; rc=$?; "
            f"[ $rc -eq {REBOOT_EXIT_STATUS} ] || exit $rc; done"
        )
        with open(self.console_log, "ab") as console:
            proc = subprocess.Popen(
                ["bash", "-c", loop], cwd=self.workdir, stdin=subprocess.DEVNULL,
                stdout=console, stderr=subprocess.STDOUT, start_new_session=True,
            )
        (self.workdir / "supervisor.pid").write_text(str(proc.pid))
        self.wait_until_running(timeout)

    def wait_until_running(self, timeout: float = 90, *, previous_pid: int | None = None) -> str:
        """Wait for `systemctl is-system-running` to say running or degraded (logged); without systemd,
        for SSH to answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.nspawn_pid
            supervisor = self._read_pid("supervisor.pid")
            if supervisor is not None and not _pid_alive(supervisor):
                raise HostError(f"test host {self.name} exited while booting\n{self.diagnostics()}")
            if pid is None or pid == previous_pid or not _pid_alive(pid):
                time.sleep(0.2)
                continue
            remaining = max(5.0, deadline - time.monotonic())
            if not self.systemd:
                if self.ssh("true", check=False, timeout=remaining).returncode == 0:
                    return "running"
                time.sleep(0.3)
                continue
            result = self.ssh("systemctl is-system-running --wait", check=False, timeout=remaining)
            state = result.stdout.strip()
            if state == "running":
                return state
            if state == "degraded":
                failed = self.ssh("systemctl --failed --no-legend --plain", check=False).stdout.strip()
                print(f"testhost {self.name}: degraded, failed units: {failed}")
                return state
            time.sleep(0.3)
        raise HostError(f"test host {self.name} did not reach running within {timeout:.0f} s\n{self.diagnostics()}")

    def reboot(self, timeout: float = 90) -> None:
        before = self.nspawn_pid
        self.ssh("systemctl reboot", check=False, timeout=10)
        self.wait_until_running(timeout, previous_pid=before)

    def stop(self, timeout: float = 20, *, keep_upper: Path | None = None) -> None:
        """Stop the guest by PID (orderly, then forced), unmount, and remove its files.

        With `keep_upper`, an orderly stop is required and what the guest changed (the overlay's upper
        layer) is moved there, to be stacked under later hosts (see `create(layers=...)`)."""
        supervisor = self._read_pid("supervisor.pid")
        if supervisor and _pid_alive(supervisor):
            os.kill(supervisor, signal.SIGKILL)  # no restart once the guest goes down
        pid = self.nspawn_pid
        if pid and _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                if keep_upper is not None:
                    raise HostError(f"{self.name} did not shut down within {timeout:.0f} s; not capturing it")
                os.kill(pid, signal.SIGKILL)
        self._kill_strays()
        for _ in range(50):
            if not _is_mounted(self.merged):
                break
            result = subprocess.run(["umount", str(self.merged)], capture_output=True, text=True)
            if result.returncode != 0:
                time.sleep(0.2)
        if _is_mounted(self.merged):
            _run(["umount", "--lazy", str(self.merged)])
        if self.netns:
            _run(["ip", "netns", "del", self.netns], check=False)
        self._remove_cgroups()
        if keep_upper is not None:
            _forget_identity(self.workdir / "upper")
            try:
                (self.workdir / "upper").rename(keep_upper)
            except OSError:  # another filesystem: cp keeps the whiteouts (device nodes) and xattrs
                _run(["cp", "-a", str(self.workdir / "upper"), str(keep_upper)])
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_strays(self) -> None:
        """Kill any process still rooted in the guest (e.g. after nspawn was SIGKILLed)."""
        merged = str(self.merged.resolve())
        for _ in range(3):
            found = False
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    root = os.readlink(entry / "root")
                except OSError:
                    continue
                if root == merged or root.startswith(merged + "/"):
                    found = True
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry.name), signal.SIGKILL)
            if not found:
                return
            time.sleep(0.3)

    # --- access --------------------------------------------------------------------------------
    def ssh_argv(self) -> list[str]:
        return ["ssh", *SSH_OPTIONS, "-i", str(_ssh_keypair()), "-p", str(self.ssh_port), f"root@{self.address}"]

    def ssh(self, command: str, *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        try:
            result = subprocess.run(
                [*self.ssh_argv(), command], capture_output=True, text=True, timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            if check:
                raise HostError(f"{self.name}: `{command}` timed out after {timeout:.0f} s") from exc
            return subprocess.CompletedProcess(exc.cmd, 124, "", "timed out")
        if check and result.returncode != 0:
            raise HostError(
                f"{self.name}: `{command}` exited {result.returncode}\n{result.stdout}{result.stderr}"
            )
        return result

    def inventory_vars(self) -> dict:
        return {
            # A guest on the controller's network shares its packet filter: never firewall it.
            **({"kimi_firewall_enabled": False} if self.netns is None else {}),
            "ansible_host": self.address,
            "ansible_port": self.ssh_port,
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(_ssh_keypair()),
            "ansible_ssh_common_args": " ".join(SSH_OPTIONS[:6]),
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def journal(self, lines: int = 300) -> str:
        """The guest's journal, read from its files on the controller (works when SSH does not)."""
        journal_dir = self.merged / "var/log/journal"
        if not journal_dir.exists():
            journal_dir = self.merged / "run/log/journal"
        result = subprocess.run(
            ["journalctl", f"--directory={journal_dir}", "--no-pager", "-n", str(lines), "-o", "short-monotonic"],
            capture_output=True, text=True,
        )
        return result.stdout or result.stderr

    def diagnostics(self) -> str:
        console = self.console_log.read_text(errors="replace")[-8000:] if self.console_log.exists() else ""
        return (
            f"--- console of {self.name} (last 8000 chars) ---\n{console}\n"
            f"--- journal of {self.name} ---\n{self.journal(lines=800)}"
        )


def _forget_identity(upper: Path) -> None:
    """What makes a captured guest one particular machine: its journal (read back by diagnostics, which
    must show the new host's alone), machine id, random seed, and the test key and sshd settings that
    every host writes anew."""
    shutil.rmtree(upper / "var/log/journal", ignore_errors=True)
    (upper / "var/log/journal").mkdir(parents=True, exist_ok=True)
    (upper / "etc/machine-id").write_text("")
    for leftover in ("var/lib/systemd/random-seed", "root/.ssh/authorized_keys",
                     "etc/ssh/sshd_config.d/kimi-testhost.conf", "etc/hosts"):
        (upper / leftover).unlink(missing_ok=True)


def write_inventory(
    path: Path, hosts: list[TestHost], group: str = "kimi_hosts", extra_vars: dict | None = None,
    *, groups: dict[str, list[TestHost]] | None = None, host_vars: dict[str, dict] | None = None,
) -> Path:
    """An Ansible inventory (YAML is a JSON superset) listing the hosts in `group`, and in the other
    `groups` (a host may be in several); `extra_vars` apply to every host, `host_vars` (by host name)
    to one."""
    members = {group: hosts, **(groups or {})}
    inventory = {
        "all": {
            "vars": extra_vars or {},
            "children": {
                name: {"hosts": {h.name: {**h.inventory_vars(), **(host_vars or {}).get(h.name, {})}
                                 for h in group_hosts}}
                for name, group_hosts in members.items()
            },
        }
    }
    path.write_text(json.dumps(inventory, indent=2))
    return path
