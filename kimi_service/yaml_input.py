"""YAML an operator wrote, read strictly: what is ambiguous or hostile is refused with its line, never guessed.

PyYAML's safe loader lets a later duplicate key silently win, expands aliases (a few lines of `*a`
references become gigabytes once printed: the "billion laughs"), builds self-referencing values, and
recurses once per nesting level until Python's stack runs out. config.yaml needs none of that.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_BYTES = 1 << 20
MAX_DEPTH = 20


class YamlRefused(ValueError):
    """The document is malformed or uses what this loader refuses; the message is one line."""


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise YamlRefused(f"{_where(event.start_mark)}: aliases (*{event.anchor}) are not accepted here; "
                              "write the value out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlRefused(f"{_where(event.start_mark)}: nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says so
            if first is not None:
                raise YamlRefused(f"{_where(key_node.start_mark)}: key {str(key)[:60]!r} is given twice in one "
                                  f"mapping (first on line {first + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}" if mark is not None else "the document"


def load_yaml(data: bytes) -> Any:
    """One YAML document from UTF-8 bytes; raises YamlRefused with a one-line reason."""
    if len(data) > MAX_BYTES:
        raise YamlRefused(f"{len(data):,} bytes; a config file this large is not one this service wrote "
                          f"(at most {MAX_BYTES:,})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise YamlRefused(f"line {line}: not UTF-8 text (byte {data[exc.start]:#04x}); save the file as "
                          "UTF-8") from None
    loader = None
    try:
        loader = _StrictLoader(text)  # reads the start already: a control character fails here
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "malformed"
        raise YamlRefused(f"{_where(mark)}, column {mark.column + 1 if mark else 0}: not valid YAML: "
                          f"{problem}") from None
    except yaml.YAMLError as exc:
        raise YamlRefused(f"not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, OverflowError) as exc:  # a scalar its tag cannot hold: an int of 5,000 digits
        raise YamlRefused(f"a value that cannot be read: {' '.join(str(exc).split())[:200]}") from None
    finally:
        if loader is not None:
            loader.dispose()
