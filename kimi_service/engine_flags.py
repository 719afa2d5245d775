"""Which vLLM option an extra argument names, read the way vLLM's own parser reads it.

vLLM's FlexibleArgumentParser turns `_` into `-` in an option's name (up to its first `.`), turns
`--name.key value` into `--name '{"key": value}'`, reads `--name=value` as the option and its value,
and argparse takes any unambiguous prefix of a long option (`--ho` is `--host`) and refuses an
ambiguous one. Which option a token resolves to is computed from the pinned vLLM's full option list
(data/, written by scripts/vllm_flags.py), so a reserved flag is refused under every spelling the
engine would accept, from every source: config.yaml's extra_args, tune's candidates and tuned.json.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

VLLM_FLAGS_FILE = "vllm-0.21.0-serve-flags.txt"
NEGATION = "--no-"

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
    "--headless": "cluster.node_rank (a follower node runs headless)",
}
_TLS = ("serve, health, the exporter and load balancers probe plain HTTP on api.port; terminate TLS in front "
        "of the endpoint")
# Flags that change what the engine trusts, exposes or loads, judged one by one: refused with why.
REFUSED = {
    "--uds": "the API server would listen on a Unix socket, where the route gate counts every client as this "
             "host's and no probe of api.port reaches it",
    "--middleware": "it loads more ASGI code into the API server beside the route gate, the one middleware "
                    "kimi-service adds",
    "--root-path": "it moves every route away from where serve's readiness check, health, the exporter and "
                   "balancers look",
    "--trust-request-chat-template": "it lets any API client send a chat template for the engine to render",
    "--allowed-local-media-path": "it lets any API client make the engine read files under that path "
                                  "(file:// media URLs)",
    **{flag: _TLS for flag in ("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--ssl-cert-reqs",
                               "--ssl-ciphers", "--enable-ssl-refresh")},
}
_OPERATOR_CODE = ("imports Python the operator names into an engine that runs as the service user either way: "
                  "no more trust than the service user already has")
# ...and allowed with why: none of these widens who reaches what.
ALLOWED = {
    "--trust-remote-code": "runs the code that ships in model.path, the directory the operator chose to serve; "
                           "the planner sets it where config.json's auto_map needs it",
    "--tokenizer": "a tokenizer directory or hub name, trusted as model.path is (its code runs only with "
                   "--trust-remote-code)",
    "--download-dir": "where weights named by hub id would land; serve starts from model.path, a directory",
    "--chat-template": "a template the operator chose, rendered in a sandboxed Jinja environment",
    "--allowed-origins": "browsers' CORS policy only: the key is a bearer header no browser adds by itself, "
                         "and the route gate judges the socket's peer, not the Origin",
    "--allowed-methods": "browsers' CORS policy only (see --allowed-origins)",
    "--allowed-headers": "browsers' CORS policy only (see --allowed-origins)",
    "--allow-credentials": "browsers' CORS policy only: the key is a header, not a cookie",
    "--allowed-media-domains": "narrows which hosts media URLs may name",
    "--tool-parser-plugin": _OPERATOR_CODE,
    "--reasoning-parser-plugin": _OPERATOR_CODE,
    "--io-processor-plugin": _OPERATOR_CODE,
    "--logits-processors": _OPERATOR_CODE,
    "--log-config-file": _OPERATOR_CODE,
}
SECRET_FLAGS = ("--api-key", "--hf-token")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


@cache
def vllm_flags() -> frozenset[str]:
    """The long options of the pinned vLLM's `vllm serve` (argparse's `--no-` negations left out)."""
    text = resources.files("kimi_service").joinpath("data", VLLM_FLAGS_FILE).read_text()
    return frozenset(line for line in text.splitlines() if line.startswith("--"))


def has_control(text: str) -> bool:
    """A control character (a newline, NUL, escape...) or a Unicode line separator."""
    return bool(_CONTROL.search(text))


def option_name(token: str) -> str:
    """`--served_model_name.x=1` -> `--served-model-name`: the long option a flag token names, before
    abbreviation; every run of leading dashes reads as `--` (argparse's `-host` and `---port` are
    errors or other options, never something this check should let through)."""
    name = token.split("=", 1)[0].split(".", 1)[0]
    return "--" + name.lstrip("-").replace("_", "-")


def resolve(token: str) -> list[str]:
    """The vLLM options argparse could read `token` as: the exact option, else every one it is a prefix of
    (one: that option; several: argparse refuses the token as ambiguous; none: an option vLLM lacks).
    `--no-X` reads as X, the negation argparse adds to a boolean option."""
    name = option_name(token)
    if name == "--":
        return []
    known = vllm_flags() | RESERVED.keys() | REFUSED.keys()
    if name in known:
        return [name]
    found = sorted(flag for flag in known if flag.startswith(name))
    if not found and name.startswith(NEGATION):
        return resolve("--" + name[len(NEGATION):])
    return found


def reserved_flags(token: str) -> list[str]:
    """The reserved or refused flags `token` is or may abbreviate (none: it is neither)."""
    return [flag for flag in resolve(token) if flag in RESERVED or flag in REFUSED]


def check_extra_args(args: tuple[str, ...], key: str) -> None:
    """Refuse, naming the flag and where its value belongs (or why it is refused), any reserved or refused
    flag in any spelling; a prefix argparse would refuse as ambiguous; a flag item that holds whitespace
    or a control character; and `--`, after which vLLM reads positionals."""
    for arg in args:
        if not isinstance(arg, str):
            raise ValueError(f"{key}: {str(arg)[:60]!r} is not a string")
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
            raise ValueError(f"{key}: {flag[:60]!r} may abbreviate {' or '.join(reserved[:4])}, which kimi-service "
                             "does not take from here; spell the flag out in full")
        options = resolve(arg)
        if len(options) > 1:
            raise ValueError(f"{key}: {flag[:60]!r} is ambiguous to vLLM ({', '.join(options[:4])}"
                             f"{', ...' if len(options) > 4 else ''}); spell the flag out in full")
        if reserved:
            spelled = "" if flag == reserved[0] else f" (vLLM reads {flag[:60]!r} as {reserved[0]})"
            if reserved[0] in RESERVED:
                raise ValueError(f"{key}: {reserved[0]}{spelled} is set by kimi-service itself; set "
                                 f"{RESERVED[reserved[0]]} instead")
            raise ValueError(f"{key}: {reserved[0]}{spelled} is refused: {REFUSED[reserved[0]]}")


def _is_number(text: str) -> bool:
    # argparse reads `-1` and `-.5` as values, not options.
    return bool(re.fullmatch(r"-\d+|-\d*\.\d+", text))
