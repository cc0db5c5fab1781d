"""The one place the library's words become the command line's: `microbatches=7` -> `-m 7`."""

from __future__ import annotations

import re

# A quoted value ('...' or "...", as repr writes it): the user's own text, never rewritten.
_QUOTED = re.compile(r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def _runs(flags: dict[str, str]) -> list[tuple[str, re.Pattern]]:
    """(flag, pattern) for each compound flag (`--mesh dp`, `--mesh pp`, ...): a pattern of a
    comma-joined run of its names' pairs, `dp=2,pp=2,tp=2`, which is that flag's own value."""
    names: dict[str, list[str]] = {}
    for name, flag in flags.items():
        head, _, rest = flag.partition(" ")
        if rest == name:
            names.setdefault(head, []).append(name)
    out = []
    for head, group in names.items():
        pair = rf"(?:{'|'.join(map(re.escape, group))})=[^,\s;:]+"
        out.append((head, re.compile(rf"(?<![\w.=-])({pair}(?:,{pair})+)")))
    return out


def _plain(text: str, flags: dict[str, str], runs) -> str:
    if runs:
        head, pattern = runs[0]
        parts = pattern.split(text)
        return "".join(f"{head} {part}" if i % 2 else _plain(part, flags, runs[1:]) for i, part in enumerate(parts))
    for name, flag in flags.items():
        # `name=value` -> `flag value`; `name=` with nothing after it -> the flag alone
        text = re.sub(rf"(?<![\w.=-]){re.escape(name)}=(?=\s)", flag, text)
        text = re.sub(rf"(?<![\w.=-]){re.escape(name)}=", f"{flag} ", text)
    return text


def translate(message: str, flags: dict[str, str]) -> str:
    """The library's `name=value` as the command line's `flag value`, for each name in
    `flags`; quoted text (the user's own values) is left as it was given."""
    parts, runs = _QUOTED.split(message), _runs(flags)
    out = "".join(part if i % 2 else _plain(part, flags, runs) for i, part in enumerate(parts))
    return out if message.endswith(" ") else out.rstrip(" ")
