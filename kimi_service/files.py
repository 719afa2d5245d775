"""Files other processes read while we rewrite them (plan.json, progress, the weights marker)."""

from __future__ import annotations

from pathlib import Path


def write_atomic(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write `text` to a temporary file beside `path` and rename it over `path`: a reader sees the old
    content or the new, never half of it. `mode` sets the file's permissions (else the umask's)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    if mode is not None:
        tmp.chmod(mode)
    tmp.replace(path)
