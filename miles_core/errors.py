"""Errors a user can cause. The CLI prints their message as one line and exits with code 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MilesUserError(Exception):
    """Bad input from the user: a config key or value, a data file, reward code, a plugin.

    The message names what is wrong and where, and says how to fix it when that is known.
    """


class ConfigError(MilesUserError):
    pass


class DataError(MilesUserError):
    pass


class PluginError(MilesUserError):
    pass


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest choice, or a list of the valid ones."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    if len(choices) <= 12:
        return f" (valid: {', '.join(choices)})" if choices else ""
    return ""
