"""Filters that check inventory values by what they are and write them safely into the files they land in.

The rules live in kimi_service.values (config.yaml's reader applies the same ones); this checkout's package
is the one the controller's venv installs, and is found beside the roles when Ansible runs from elsewhere.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

from ansible.errors import AnsibleFilterError

try:
    from kimi_service import values
    from kimi_service.engine_flags import has_control
except ImportError:
    sys.path.append(str(Path(__file__).resolve().parents[3]))
    from kimi_service import values
    from kimi_service.engine_flags import has_control


def kimi_refusals(named_values, kinds):
    """One message per value of `named_values` ({variable: value}) that breaks the rule of its kind in `kinds`."""
    return values.refusals(named_values, kinds)


def kimi_ip_family(items, version):
    """The items that parse as IP addresses or networks of this version (4 or 6), as nftables writes them;
    host names and the other family are left out."""
    found = []
    for item in items:
        try:
            network = ipaddress.ip_network(str(item), strict=False)
        except ValueError:
            continue
        if network.version == int(version):
            found.append(str(network.network_address) if network.num_addresses == 1 else str(network))
    return found


def _one_line(value, where):
    text = str(value)
    if has_control(text):
        raise AnsibleFilterError(f"{text!r} holds a control character (a newline?) and cannot go into {where}")
    return text


def kimi_systemd(value):
    """A value for a systemd unit setting: on one line, with `%` (a specifier there) written as `%%`."""
    return _one_line(value, "a systemd unit").replace("%", "%%")


def kimi_supervisord(value):
    """A value for supervisord's configuration: on one line, with `%` (its interpolation) written as `%%`."""
    return _one_line(value, "supervisord's configuration").replace("%", "%%")


class FilterModule:
    def filters(self):
        return {
            "kimi_refusals": kimi_refusals,
            "kimi_ip_family": kimi_ip_family,
            "kimi_systemd": kimi_systemd,
            "kimi_supervisord": kimi_supervisord,
        }
