"""`serve --env-file FILE --user NAME`: what systemd's EnvironmentFile= and User= do, for service managers
that do neither safely (supervisord would need the secrets in its world-readable config).

serve starts as root, reads the 0600 env file into its environment (and so the engine's), then becomes
the service user before it plans or starts anything.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from kimi_service.config import read_env_file
from kimi_service.errors import UsageError

log = logging.getLogger(__package__)


def load_env_file(path: Path, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set the file's variables, over what the environment had (as EnvironmentFile= does); returns
    their names."""
    values = read_env_file(path)
    environ.update(values)
    return sorted(values)


def become_user(name: str, own_dirs: Sequence[Path] = (), environ: MutableMapping[str, str] = os.environ) -> None:
    """Root: drop to `name` (supplementary groups, group, user; HOME, USER, LOGNAME as systemd's User=
    sets them), first creating those of `own_dirs` that are missing, owned by `name` (what systemd's
    RuntimeDirectory= does for /run/kimi-service, which a container restart empties). Not root: only
    `name` being who we already are is fine."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise UsageError(f"--user {name}: no such user on this host") from None
    if os.geteuid() != 0:
        if account.pw_uid != os.geteuid():
            raise UsageError(f"--user {name}: serve runs as uid {os.geteuid()}, not as root, so it cannot "
                             f"become {name}; start it as root or as {name}")
        return
    for directory in own_dirs:
        if not directory.exists():
            directory.mkdir(mode=0o755, parents=True)
            os.chown(directory, account.pw_uid, account.pw_gid)
    os.initgroups(name, account.pw_gid)
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    if os.getuid() != account.pw_uid or os.geteuid() != account.pw_uid:
        raise UsageError(f"--user {name}: still uid {os.geteuid()} after setuid")
    environ.update({"HOME": account.pw_dir, "USER": name, "LOGNAME": name})
    log.info("running as %s (uid %d, gid %d %s)", name, account.pw_uid, account.pw_gid,
             grp.getgrgid(account.pw_gid).gr_name)


def user_name(uid: int) -> str | None:
    """The account name of `uid`, or None where the system has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
