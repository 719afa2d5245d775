"""Exceptions whose message tells the user what is wrong and how to fix it.

The CLI turns each into an exit code without a traceback.
"""


class KimiError(Exception):
    """Base class of errors a user can act on."""

    exit_code = 1


class UsageError(KimiError):
    """Bad input: a malformed argument, an unknown name, an invalid config value."""

    exit_code = 2
