"""The operator's extra vLLM arguments: parsed once, read by flag, refused when they would leak a secret."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kimi_service.errors import UsageError

_ALIASES = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
}
_SECRET_FLAGS = ("--api-key", "--hf-token")
_BYTE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str | None]]:
    """`["--max-num-seqs", "64", "--enforce-eager", "--kv-cache-dtype=fp8"]` -> [(flag, value), ...]."""
    pairs: list[tuple[str, str | None]] = []
    items = list(overrides)
    i = 0
    while i < len(items):
        token = str(items[i])
        if not token.startswith("-"):
            raise UsageError(
                f"extra vLLM argument {token!r} is not a flag; write flags as --name value or --name=value"
            )
        flag, _, inline = token.partition("=")
        flag = _ALIASES.get(flag, flag)
        flag = "--" + flag.lstrip("-").replace("_", "-")
        value: str | None = inline if inline else None
        if value is None and i + 1 < len(items) and not str(items[i + 1]).startswith("--"):
            value = str(items[i + 1])
            i += 1
        if flag in _SECRET_FLAGS:
            raise UsageError(
                f"{flag} must not be a command-line argument (anyone can read a process's argv): "
                "set kimi_api_key / kimi_hf_token, which reach vLLM through its 0600 environment file"
            )
        pairs.append((flag, value))
        i += 1
    return pairs


def parse_byte_count(text: str | None, flag: str) -> int:
    """vLLM's human-readable integers: `256M` is 256 MiB, `256m` is 256 million bytes."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", (text or "").strip(), re.ASCII)
    if not match:
        raise UsageError(f"override {flag} needs a byte count such as 268435456 or 256M, got {text!r}")
    number, suffix = match.groups()
    value = int(float(number) * _BYTE_SUFFIXES.get(suffix, 1))
    if value < 1:
        raise UsageError(f"override {flag} must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class Overrides:
    """The operator's flags in the order given (they go to the end of argv), looked up by name."""

    pairs: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def parse(cls, arguments: Sequence[str]) -> Overrides:
        return cls(tuple(parse_overrides(arguments)))

    @property
    def flags(self) -> set[str]:
        return {flag for flag, _ in self.pairs}

    def __contains__(self, flag: str) -> bool:
        return flag in self.flags

    def get(self, flag: str) -> str | None:
        """The value of the flag's last occurrence; None when absent or given without a value."""
        return dict(self.pairs).get(flag)

    def integer(self, flag: str) -> int | None:
        if flag not in self:
            return None
        text = self.get(flag)
        if text is None or not (text.isascii() and text.isdigit()) or int(text) < 1:
            raise UsageError(f"override {flag} needs a positive whole number, got {text!r}")
        return int(text)

    def fraction(self, flag: str) -> float | None:
        if flag not in self:
            return None
        try:
            value = float(self.get(flag) or "")
        except ValueError:
            value = -1.0
        if not 0.0 < value <= 1.0:
            raise UsageError(f"override {flag} needs a fraction in (0, 1], got {self.get(flag)!r}")
        return value
