"""What several commands share: argument types, the config and env-file options, secrets read for a command
(never from argv), and the hub options fetch and plan take alike."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from kimi_service.errors import UsageError

# A hub token is a few dozen characters: a --token-file far larger is not one.
TOKEN_FILE_BYTES = 64 << 10


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def request_shape(text: str):
    from kimi_service.tuned import Shape

    try:
        return Shape.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def float_list(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def env_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--env-file", type=Path, metavar="FILE",
                        help="systemd environment file to read VLLM_API_KEY from when the environment lacks it "
                        "(default: secrets.env beside --config when this user can read it, as root on a "
                        "deployed host; keeps the key out of argv and Ansible's -vvv)")


def secret(args: argparse.Namespace, name: str) -> str | None:
    """A secret from the environment, else from --env-file, else from the secrets.env the roles write beside
    the config (readable by root only: for anyone else the key must come from the environment); never from
    an argument."""
    from kimi_service.credentials import read_secret

    env_file = getattr(args, "env_file", None)
    config = getattr(args, "config", None)
    if env_file is None and config is not None:
        beside = Path(config).parent / "secrets.env"
        if beside.is_file() and os.access(beside, os.R_OK):
            env_file = beside
    return read_secret(name, env_file=env_file)


def config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=Path("/etc/kimi-service/config.yaml"),
                        help="config file (default /etc/kimi-service/config.yaml)")


def hub_args(parser: argparse.ArgumentParser, *, sources: Sequence[str]) -> None:
    """Where a repository is listed and read: one set of options for fetch and plan."""
    parser.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    parser.add_argument("--source", choices=sources, default="hf")
    parser.add_argument("--endpoint", default="",
                        help="hub or mirror base URL (default $HF_ENDPOINT or https://huggingface.co; "
                        "https://www.modelscope.cn)")
    parser.add_argument("--manifest-url", default="", help="http source: manifest URL (default ENDPOINT/"
                        "kimi-manifest.json)")
    parser.add_argument("--token-file", type=Path, metavar="FILE",
                        help="read the hub token from FILE (root-only) instead of the environment (HF_TOKEN, "
                        "HUGGING_FACE_HUB_TOKEN; MODELSCOPE_API_TOKEN)")


def hub_endpoint(args: argparse.Namespace) -> str:
    from kimi_service.weights_sources import default_endpoint

    return args.endpoint or default_endpoint(args.source)


def hub_token(args: argparse.Namespace) -> str:
    from kimi_service import weights

    return read_token(args.token_file) if args.token_file else weights.token_from_env(args.source)


def read_token(path: Path) -> str:
    from kimi_service import weights
    from kimi_service.untrusted import UntrustedInput, read_bytes

    try:
        text = read_bytes(path, limit=TOKEN_FILE_BYTES).decode("utf-8")
    except OSError as exc:
        raise UsageError(f"--token-file {path}: cannot read it ({exc.strerror})") from None
    except UntrustedInput as exc:
        raise UsageError(f"--token-file {exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"--token-file {path}: not UTF-8 text; it is not shown here") from None
    # Checked before it goes into a header: httpx's error for a bad header value quotes the value.
    return weights.check_token(text.strip(), f"--token-file {path}")
