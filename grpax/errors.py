"""Errors shared by every layer, and the did-you-mean helper their messages use.

A leaf module: it imports nothing of grpax, so that ``grpax.models`` (below ``grpax.config``) can raise the same
``ConfigError`` as the config parser without importing it (which would be an import circle).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad key or value on the command line or in a YAML file; the message names the key and the fix."""


def suggest(key: str, valid: Iterable[str]) -> str:
    """Returns ' Did you mean X?' for the closest valid key, or ''."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""
