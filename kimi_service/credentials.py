"""Secrets the service's commands need (the API key, a hub token): where they are read, how a request
carries them. Never from argv, where `ps` and a verbose Ansible run would show them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kimi_service.config import read_env_file
from kimi_service.errors import UsageError

# The variable secrets.env sets; vLLM reads it as its --api-key.
API_KEY_VAR = "VLLM_API_KEY"


def read_secret(name: str = API_KEY_VAR, *, env: Mapping[str, str] | None = None,
                env_file: Path | None = None) -> str | None:
    """A secret from the environment (os.environ unless `env` is given), else from a systemd
    environment file such as /etc/kimi-service/secrets.env; None when neither has it."""
    env = os.environ if env is None else env
    if env.get(name):
        return env[name]
    if env_file:
        return read_env_file(env_file).get(name) or None
    return None


def bearer(token: str | None) -> dict[str, str]:
    """The Authorization header that carries a token; no header without one. A token no header can
    carry is bad input (exit 2), named without being shown: the HTTP client's own error quotes it."""
    if token and not (token.isascii() and token.isprintable() and token == token.strip()):
        raise UsageError("the API key holds a character an HTTP header cannot carry (non-ASCII, a control "
                         "character, or blanks at either end); it is not shown here: check VLLM_API_KEY "
                         "(kimi_api_key in secrets.env)")
    return {"Authorization": f"Bearer {token}"} if token else {}
