"""Exceptions whose message tells the user what is wrong and how to fix it.

The CLI turns each into an exit code without a traceback.
"""


class KimiError(Exception):
    """Base class of errors a user can act on."""

    exit_code = 1


class UsageError(KimiError):
    """Bad input: a malformed argument, an unknown name, an invalid config value."""

    exit_code = 2


class EngineFailed(KimiError):
    """vLLM exited or never became ready; exit_code carries a non-zero status for systemd."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
