"""A systemd EnvironmentFile, read exactly as systemd reads it (its env-file parser, systemd.exec(5)).

A command that takes the API key from secrets.env must send the key the unit's vLLM got, so the
file's syntax is systemd's, not the shell's:

- Lines starting (after blanks) with `#` or `;` are comments; a line without `=` is ignored; so is
  an assignment whose name is not a valid variable name (`export KEY=v` sets nothing).
- Blanks around the name and before the value are dropped; so are trailing blanks of an unquoted value.
- Unquoted: `\\` keeps the next character (and a `\\` at the end of a line joins the next line).
- `'...'`: every character literally, newlines included; no escapes.
- `"..."`: `\\` before one of `"`, `\\`, `` ` ``, `$` keeps that character; before a newline joins the
  lines; before anything else both characters stay.
- An unquoted part may follow a quoted one (`A="x"y` is `xy`; quotes in it stay); a later assignment
  of the same name wins; a quote still open at the end of the file ends there.
- The file must be UTF-8: systemd refuses to start the unit when a name or value is not.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BLANK = " \t\n\r"
_NEWLINE = "\n\r"
_SHELL_NEED_ESCAPE = '"\\`$'


class EnvFileError(ValueError):
    """Not a file systemd would load; the message starts with the line number."""


def parse_env_file(data: bytes) -> dict[str, str]:
    """The variables `data` sets, in systemd's reading; raises EnvFileError for what systemd refuses."""
    values: dict[str, str] = {}
    for line, name, value in _assignments(data.decode("utf-8", errors="surrogateescape")):
        for part in (name, value):
            if any("\udc80" <= c <= "\udcff" for c in part):
                raise EnvFileError(f"line {line}: not UTF-8 text; systemd refuses to start the unit with it")
        if _NAME.fullmatch(name):  # systemd ignores an invalid name ("Ignoring invalid environment assignment")
            values[name] = value
    return values


def _assignments(text: str) -> list[tuple[int, str, str]]:
    reader = _Reader()
    for c in text:
        getattr(reader, "in_" + reader.state)(c)
        if c == "\n":
            reader.line += 1
    return reader.finish()


class _Reader:
    """systemd's parse_env_file_internal: one method per state, each given the next character."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []
        self.state, self.name, self.value, self.line, self.start = "pre_key", "", "", 1, 1
        self.name_end: int | None = None  # where the name's trailing blanks begin
        self.value_end: int | None = None  # where an unquoted value's trailing blanks begin

    def push(self) -> None:
        name = self.name[: self.name_end] if self.name_end is not None else self.name
        value = self.value[: self.value_end] if self.state == "value" and self.value_end is not None else self.value
        self.found.append((self.start, name, value))
        self.state = "pre_key"

    def finish(self) -> list[tuple[int, str, str]]:
        if self.state not in ("pre_key", "key", "comment", "comment_escape"):
            self.push()  # a quote still open ends with the file
        return self.found

    def in_pre_key(self, c: str) -> None:
        if c in "#;":
            self.state = "comment"
        elif c not in _BLANK:
            self.state, self.name, self.name_end, self.start = "key", c, None, self.line

    def in_key(self, c: str) -> None:
        if c in _NEWLINE:
            self.state = "pre_key"  # a line without `=`: ignored
        elif c == "=":
            self.state, self.value, self.value_end = "pre_value", "", None
        else:
            if c not in _BLANK:
                self.name_end = None
            elif self.name_end is None:
                self.name_end = len(self.name)
            self.name += c

    def in_pre_value(self, c: str) -> None:
        if c in _NEWLINE:
            self.push()
        elif c in "'\"\\":
            self.state = {"'": "single", '"': "double", "\\": "escape"}[c]
        elif c not in _BLANK:
            self.state, self.value = "value", self.value + c

    def in_value(self, c: str) -> None:
        if c in _NEWLINE:
            self.push()
        elif c == "\\":
            self.state, self.value_end = "escape", None
        else:
            if c not in _BLANK:
                self.value_end = None
            elif self.value_end is None:
                self.value_end = len(self.value)
            self.value += c

    def in_escape(self, c: str) -> None:
        self.state = "value"
        if c not in _NEWLINE:  # an escaped newline joins the lines
            self.value += c

    def in_single(self, c: str) -> None:
        if c == "'":
            self.state = "pre_value"
        else:
            self.value += c

    def in_double(self, c: str) -> None:
        if c == '"':
            self.state = "pre_value"
        elif c == "\\":
            self.state = "double_escape"
        else:
            self.value += c

    def in_double_escape(self, c: str) -> None:
        self.state = "double"
        if c in _SHELL_NEED_ESCAPE:
            self.value += c
        elif c != "\n":  # like the shell, keep the backslash before any other character
            self.value += "\\" + c

    def in_comment(self, c: str) -> None:
        if c == "\\":
            self.state = "comment_escape"
        elif c in _NEWLINE:
            self.state = "pre_key"

    def in_comment_escape(self, c: str) -> None:
        # Since systemd 254 a comment's trailing backslash no longer continues the comment.
        self.state = "pre_key" if c in _NEWLINE else "comment"
