"""What each kind of configured value may be, so that it lands in the file it is written to (a systemd unit,
supervisord's configuration, HAProxy's, nftables', a shell script, YAML) as the one path, address or word it
claims to be and never as a line or a directive of its own.

The roles' argument validation (roles/kimi_common/tasks/validate.yml, through the kimi_refusals filter) and
config.yaml's reader (kimi_service.config) both ask here. A value is checked by what it is, parsed where it
has a grammar (ipaddress for addresses and networks), never by a pattern that merely looks for a character.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from kimi_service.engine_flags import has_control

# A path written into a unit, a supervisord program or a shell script: letters, digits and these only, so
# that no shell (`$`, backtick, `;`, quotes, globs ...), systemd specifier (`%`) or whitespace can reach them.
_PATH = re.compile(r"/[A-Za-z0-9._+@,=/-]*")
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_WORD = re.compile(r"[A-Za-z0-9._+:,=@/^*~-]+")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# Hugging Face repo ids: ORG/NAME of letters, digits, '.', '_' and '-' (at most 96 each), no '..'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET = re.compile(r"[\x21-\x7e]*")
# supervisord's byte_size (supervisor/datatypes.py): digits with an optional KB, MB or GB, any case.
_SIZE = re.compile(r"[0-9]+(KB|MB|GB)?", re.IGNORECASE)
# Prometheus' duration (common/model/time.go, ParseDuration): units from the largest, each at most once.
_DURATION = re.compile(r"([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?")
# HAProxy's retry-on keywords (configuration manual, "retry-on").
HAPROXY_RETRY_ON = frozenset({
    "none", "conn-failure", "empty-response", "junk-response", "response-timeout", "0rtt-rejected",
    "all-retryable-errors", "401", "403", "404", "408", "425", "500", "501", "502", "503", "504",
})
PORTS = range(1, 65536)


def path_problem(value: str) -> str | None:
    if not _PATH.fullmatch(value):
        return "an absolute path of letters, digits and . _ + @ , = / - only (no spaces, quotes, $ or %)"
    if posixpath.normpath(value) != value or value.startswith("//"):
        return f"a normalized absolute path (no //, /./, /../ or trailing /: {posixpath.normpath(value)!r})"
    return None


def _ip_problem(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "an IP address"
    return None if re.fullmatch(r"[0-9A-Fa-f:.]+", value) else "an IP address (no zone or spaces)"


def _cidr_problem(value: str) -> str | None:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return "an IP address or network (CIDR)"
    return None if re.fullmatch(r"[0-9A-Fa-f:./]+", value) else "an IP address or network (CIDR) alone"


def _hostname_problem(value: str) -> str | None:
    labels = value.split(".")
    if len(value) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return None
    return "a host name (RFC 1123: dot-separated letters, digits and inner hyphens)"


def _host_problem(value: str) -> str | None:
    if _ip_problem(value) is None or _hostname_problem(value) is None:
        return None
    return "an IP address or a host name (RFC 1123)"


def _target_problem(value: str) -> str | None:
    """An address a connection plugin reaches: an IP address (v4 or v6) or a name (a container's too)."""
    if _ip_problem(value) is None or _NAME.fullmatch(value):
        return None
    return "an IP address or a name of letters, digits and . _ - (not starting with . or -)"


def _port_problem(value: Any) -> str | None:
    text = str(value)
    if isinstance(value, bool) or not text.isascii() or not text.isdigit() or int(text) not in PORTS:
        return "a port number from 1 to 65535"
    return None


def _port_range_problem(value: Any) -> str | None:
    low, _, high = str(value).partition("-")
    if _port_problem(low) or (high and (_port_problem(high) or int(high) < int(low))):
        return "a port from 1 to 65535 or a range of them, LOW-HIGH"
    return None


def _listen_problem(value: str) -> str | None:
    host, colon, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host_ok = ":" in host and _ip_problem(host[1:-1]) is None
    else:
        host_ok = host == "" or (":" not in host and _host_problem(host) is None)
    if colon and host_ok and _port_problem(port) is None:
        return None
    return "HOST:PORT (an IP address, [IPv6] or host name, and a port)"


def _url_problem(value: str) -> str | None:
    rule = "an http(s) URL without spaces, quotes or backslashes"
    if has_control(value) or any(c.isspace() or c in "\"'`\\<>{}" for c in value):
        return rule
    try:
        parts = urlsplit(value)
        port_ok = parts.port is None or parts.port in PORTS
    except ValueError:
        return rule
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not port_ok or _host_problem(host.strip("[]")) is not None:
        return rule
    return None


def _matching(pattern: re.Pattern[str], rule: str) -> Callable[[str], str | None]:
    return lambda value: None if pattern.fullmatch(value) else rule


def is_repo_id(text: str) -> bool:
    """The one rule for a hub repo id, wherever one is read (inventory, config.yaml, `--model`)."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text


def _model_problem(value: str) -> str | None:
    if value.startswith("/"):
        return path_problem(value)
    return None if is_repo_id(value) else "a hub repo id (owner/name) or an absolute path"


def _retry_on_problem(value: str) -> str | None:
    words = value.split(" ")
    if words and all(word in HAPROXY_RETRY_ON for word in words):
        return None
    return f"HAProxy retry-on keywords separated by single spaces ({', '.join(sorted(HAPROXY_RETRY_ON))})"


def _line_problem(value: str) -> str | None:
    return "one line of text (no newline or other control character)" if has_control(value) else None


def _env_problem(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return "a mapping of environment variables"
    for name, item in value.items():
        if not _ENV_NAME.fullmatch(str(name)) or has_control(str(item)):
            return f"environment variables NAME: value (bad entry {name!r}: {item!r})"
    return None


# Every kind of value; each takes the value (a string unless said otherwise) and says the rule it breaks.
KINDS: dict[str, Callable[[Any], str | None]] = {
    "path": path_problem,
    "local_path": _line_problem,
    "model": _model_problem,
    "ip": _ip_problem,
    "cidr": _cidr_problem,
    "host": _host_problem,
    "target": _target_problem,
    "hostname": _hostname_problem,
    "listen": _listen_problem,
    "url": _url_problem,
    "port": _port_problem,
    "port_range": _port_range_problem,
    "size": _matching(_SIZE, "a size in bytes: digits with an optional KB, MB or GB"),
    "duration": _matching(_DURATION, "a Prometheus duration such as 15s, 1m30s or 15d"),
    "name": _matching(_NAME, "a name of letters, digits and . _ - (not starting with . or -)"),
    "word": _matching(_WORD, "one word of letters, digits and . _ + : , = @ / ^ * ~ - (no spaces or quotes)"),
    "user": _matching(_USER, "a system user name (lowercase letters, digits, _ and -, at most 32)"),
    "retry_on": _retry_on_problem,
    "line": _line_problem,
    "secret": _matching(_SECRET, "printable ASCII characters without spaces"),
    "env": _env_problem,
}
# A kind ending in "?" also takes the empty string (an unset optional value).
OPTIONAL = "?"


def problem(kind: str, value: Any) -> str | None:
    """The rule `value` breaks as a value of `kind` ("path", "cidr?" ...), or None; a list is checked item by item."""
    name = kind.removesuffix(OPTIONAL)
    check = KINDS[name]
    if name == "env":
        return check(value)
    for item in value if isinstance(value, list) else [value]:
        if item in ("", None) and kind.endswith(OPTIONAL):
            continue
        if not isinstance(item, str) and not (name in ("port", "port_range") and isinstance(item, int)):
            return f"a {name} value (a string), not {type(item).__name__} {item!r}"
        if rule := check(item):
            return rule
    return None


def refusals(values: Mapping[str, Any], kinds: Mapping[str, str]) -> list[str]:
    """One line per value that breaks its kind's rule: the variable, its value (repr; never a secret's) and the rule."""
    found = []
    for name, value in values.items():
        if rule := problem(kinds[name], value):
            shown = "(a secret: not shown)" if kinds[name].startswith("secret") else repr(value)
            found.append(f"{name}: {shown} must be {rule}")
    return found
