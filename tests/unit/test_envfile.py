"""secrets.env read as systemd's EnvironmentFile= reads it (systemd.exec(5), its env-file parser), so a
command run with --env-file sends the key the unit's engine got."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_service.cli import main
from kimi_service.config import ConfigError, read_env_file
from kimi_service.envfile import EnvFileError, parse_env_file


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("KEY='sk-123'\n", {"KEY": "sk-123"}),  # systemd strips single quotes
        ("KEY='a\\\"b $x'\n", {"KEY": 'a\\"b $x'}),  # no escapes in single quotes
        ('KEY="a\\"b\\\\c\\$d\\`e"\n', {"KEY": 'a"b\\c$d`e'}),  # \" \\ \$ \` keep the character
        ('KEY="a\\nb"\n', {"KEY": "a\\nb"}),  # any other escape keeps both characters
        ('KEY="multi\nline"\n', {"KEY": "multi\nline"}),  # quotes span lines
        ('KEY="joined\\\nline"\n', {"KEY": "joinedline"}),  # escaped newline in quotes joins
        ("KEY=joined\\\nline\n", {"KEY": "joinedline"}),  # and unquoted
        ("KEY=a\\ b\\\\c\n", {"KEY": "a b\\c"}),  # unquoted: a backslash keeps the next character
        ("  KEY =  value with  blanks  \n", {"KEY": "value with  blanks"}),
        ("KEY=a # not a comment\n", {"KEY": "a # not a comment"}),
        ("# comment\n; comment\n   # indented comment\nKEY=1\n", {"KEY": "1"}),
        ("# comment ending in a backslash \\\nKEY=1\n", {"KEY": "1"}),
        ("KEY=\"x\"y'z'\n", {"KEY": "xy'z'"}),  # joined; quotes inside an unquoted part stay
        ("KEY='x' \n", {"KEY": "x"}),
        ("KEY=1\nKEY=2\n", {"KEY": "2"}),  # the last assignment wins
        ("just words\nKEY=1\n", {"KEY": "1"}),  # a line without = is ignored
        ("export KEY=1\n", {}),  # not a valid name: ignored, as systemd does
        ("1KEY=1\nA-B=2\n", {}),
        ("KEY=\n", {"KEY": ""}),
        ("KEY", {}),
        ("KEY='unterminated", {"KEY": "unterminated"}),
        ("KEY=v\r\nOTHER=w\r\n", {"KEY": "v", "OTHER": "w"}),
        ("KEY=last line without newline", {"KEY": "last line without newline"}),
        ("", {}),
    ],
)
def test_environment_file_reads_as_systemd_reads_it(text: str, expected: dict[str, str]) -> None:
    assert parse_env_file(text.encode()) == expected


@pytest.mark.parametrize(
    ("data", "line"),
    [(b"VLLM_API_KEY=sk-\xff\n", 1), (b"A=1\nB='x\n\xc3('\n", 2), (b"A=1\n\xfe=1\n", 2)],
)
def test_invalid_utf8_in_a_name_or_value_is_refused_with_its_line(data: bytes, line: int) -> None:
    with pytest.raises(EnvFileError, match=rf"^line {line}: not UTF-8 text"):
        parse_env_file(data)


def test_invalid_utf8_in_a_comment_is_ignored_as_systemd_does() -> None:
    assert parse_env_file(b"# caf\xe9\nKEY=1\n") == {"KEY": "1"}


def test_single_quoted_key_reaches_health_without_its_quotes(tmp_path: Path) -> None:
    path = tmp_path / "secrets.env"
    path.write_text("VLLM_API_KEY='sk-single'\n")
    assert read_env_file(path) == {"VLLM_API_KEY": "sk-single"}


def test_unreadable_env_file_is_exit_2_with_one_line(tmp_path: Path, capsys) -> None:
    # /proc/self/mem is a file even root cannot read this way (EIO): an unreadable file on any host.
    for path, fragment in ((Path("/proc/self/mem"), "cannot read it (Input/output error)"),
                           (tmp_path, "cannot read it (Is a directory)")):
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            read_env_file(path)
    bad = tmp_path / "bad.env"
    bad.write_bytes(b"VLLM_API_KEY=\xff\n")
    code = main(["health", "--url", "http://127.0.0.1:9", "--env-file", str(bad), "--no-gpu", "--no-smoke"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "bad.env, line 1: not UTF-8 text" in err
