"""The one place the library's words become the command line's: `microbatches=7` -> `-m 7`."""

from __future__ import annotations

import re


def translate(message: str, flags: dict[str, str]) -> str:
    """The library's `name=value` as the command line's `flag value`, for each name in `flags`."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w.]){re.escape(name)}=", f"{flag} ", message)
    return message
