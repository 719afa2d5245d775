"""Which vLLM option an extra argument names, read the way vLLM's own parser reads it.

vLLM's FlexibleArgumentParser turns `_` into `-` in an option's name (up to its first `.`), turns
`--name.key value` into `--name '{"key": value}'`, reads `--name=value` as the option and its value,
and argparse takes any unambiguous prefix (`--ho` is `--host`). A reserved flag must be refused under
every spelling the engine would accept, and under the ones argparse would turn into something else.
"""

from __future__ import annotations

import re

# The flags kimi-service sets itself, and where their values belong instead. A secret on a command
# line is readable by every user (`ps`); the others carry what readiness checks and balancers rely on.
RESERVED = {
    "--api-key": "kimi_api_key (VLLM_API_KEY in secrets.env)",
    "--hf-token": "kimi_hf_token (HF_TOKEN in secrets.env)",
    "--host": "api.host (kimi_api_host)",
    "--port": "api.port (kimi_api_port)",
    "--served-model-name": "model.served_name (kimi_served_name)",
    "--model": "model.path (kimi_model)",
    # vLLM reads flags from this YAML file too, where none of the checks here would see them.
    "--config": "plan.extra_args itself, one flag per item (kimi_vllm_extra_args)",
}
SECRET_FLAGS = ("--api-key", "--hf-token")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def has_control(text: str) -> bool:
    """A control character (a newline, NUL, escape...) or a Unicode line separator."""
    return bool(_CONTROL.search(text))


def option_name(token: str) -> str:
    """`--served_model_name.x=1` -> `--served-model-name`: the long option a flag token names, before
    abbreviation; every run of leading dashes reads as `--` (argparse's `-host` and `---port` are
    errors or other options, never something this check should let through)."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    return "--" + name.lstrip("-").replace("_", "-")


def reserved_flags(token: str) -> list[str]:
    """The reserved flags `token` is or may abbreviate (none: it is not one); `token` starts with `-`."""
    name = option_name(token)
    if name == "--":
        return []
    if name in RESERVED:
        return [name]
    return [flag for flag in RESERVED if flag.startswith(name)]


def check_extra_args(args: tuple[str, ...], key: str) -> None:
    """Refuse, naming the flag and where its value belongs, any reserved flag in any spelling; a flag
    item that holds whitespace or a control character; and `--`, after which vLLM reads positionals."""
    for arg in args:
        if has_control(arg):
            raise ValueError(f"{key}: {arg[:60]!r} holds a control character (a newline?); remove it")
        if not arg.startswith("-") or _is_number(arg):
            continue
        flag = arg.split("=", 1)[0]
        if arg == "--":
            raise ValueError(f"{key}: '--' would make vLLM read what follows as positional arguments; remove it")
        if any(c.isspace() for c in flag):
            raise ValueError(f"{key}: {arg[:60]!r} is one item holding a flag and more; write the flag and its "
                             "value as two items, or as --flag=value")
        reserved = reserved_flags(arg)
        if len(reserved) > 1:
            raise ValueError(f"{key}: {flag!r} may abbreviate {' or '.join(reserved)}, which kimi-service sets "
                             "itself; spell the flag out in full")
        if reserved:
            spelled = "" if flag == reserved[0] else f" (vLLM reads {flag!r} as {reserved[0]})"
            raise ValueError(f"{key}: {reserved[0]}{spelled} is set by kimi-service itself; set "
                             f"{RESERVED[reserved[0]]} instead")


def _is_number(text: str) -> bool:
    # argparse reads `-1` and `-.5` as values, not options.
    return bool(re.fullmatch(r"-\d+|-\d*\.\d+", text))
