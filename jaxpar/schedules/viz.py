"""Views of a `Schedule`: the lecture's ASCII timeline, a matplotlib PNG, a Chrome trace.

All three read the same table (`Schedule.program`); none knows how a schedule was built.
Every function takes the `schedule.Schedule` to draw as `s` (this module sits below
schedule.py, which uses it, so it names the type in words only).
matplotlib is imported only when a PNG is asked for.
"""

from __future__ import annotations

import os
import string
import textwrap

from jaxpar.errors import ConfigError
from jaxpar.schedules import orders
from jaxpar.schedules.orders import Action


LEGEND = (
    "one character per tick; digit i = forward of microbatch i (mod 10); a, b, c, ... = "
    "backward of microbatch 0, 1, 2, ... (mod 26; the input gradient only when the backward "
    "is split); A, B, C, ... = its weight gradient W; '.' = idle; '#' = two actions at once "
    "(invalid). Interleaved and DualPipe-V: one row per device, and under it the chunk of each "
    "busy tick (DualPipe-V: chunk 0 is stage d, chunk 1 stage 2p-1-d)."
)


def label(name: str) -> str:
    """The schedule's display name ("1F1B"), from the registry; a hand-built table's own name."""
    return orders.REGISTRY[name].label if name in orders.REGISTRY else name


def char(a: Action) -> str:
    """The lecture's alphabet: digits forward, lowercase backward, uppercase weight gradient."""
    if a.kind == "F":
        return str(a.microbatch % 10)
    letters = string.ascii_lowercase if a.kind == "B" else string.ascii_uppercase
    return letters[a.microbatch % 26]


def percent(x: float) -> str:
    """27.3%, 75% (one decimal, as the lecture prints them)."""
    return f"{100 * x:.1f}".removesuffix(".0") + "%"


def _label(s) -> tuple[str, int]:
    word = "stage" if s.chunks == 1 else "device"
    return word, len(f"{word} {s.stages - 1}")


def timeline_rows(s) -> list[str]:
    """One row per stage (per device, plus a chunk row, when chunks > 1)."""
    word, width = _label(s)
    rows = []
    for d in range(s.stages):
        cells, chunks = ["."] * s.total_time, [" "] * s.total_time
        for t, a in s.program(d):
            for u in range(t, t + s.cost(a)):
                cells[u] = char(a) if cells[u] == "." else "#"
                chunks[u] = str(a.chunk % 10)
        rows.append(f"  {f'{word} {d}':<{width}}: {''.join(cells)}")
        if s.chunks > 1:
            rows.append(f"  {'chunk':<{width}}: {''.join(chunks)}".rstrip())
    return rows


def header(s) -> str:
    word, _ = _label(s)
    dims = (f"p={s.stages}, m={s.microbatches}" + (f", v={s.chunks}" if s.chunks > 1 else "")
            + (" in a V" if s.placement == "v" else ""))
    out = (f"{label(s.name)} ({dims}): bubble {percent(s.bubble_fraction)}, "
           f"total time {s.total_time}, peak activations "
           + (f"(microbatch-chunks, 1/{s.chunks} stage each) " if s.chunks > 1 else "")
           + f"per {word} {s.peak_activations}")
    if s.split_backward:
        out += f", in flight until W {s.peak_in_flight}"
    if abs(s.steady_bubble_fraction - s.bubble_fraction) > 1e-9:
        out += f"; back to back: bubble {percent(s.steady_bubble_fraction)}"
    return out


def render(s) -> str:
    return "\n".join([header(s), *timeline_rows(s)])


def mark(s, tick: int | None, device: int) -> str:
    """The timeline with a `^` under (tick, device); at the row's end when tick is None."""
    _, width = _label(s)
    rows = timeline_rows(s)
    at = device * (2 if s.chunks > 1 else 1)
    col = 4 + width + (s.total_time if tick is None else tick)
    note = "missing here" if tick is None else f"tick {tick}, device {device}"
    return "\n".join(rows[:at + 1] + [" " * col + "^ " + note] + rows[at + 1:])


def chrome_trace(s) -> dict:
    """Chrome-trace JSON (chrome://tracing, ui.perfetto.dev): one thread per device, one
    slice per action, a flow arrow per send; 1 tick = 1000 us."""
    us = 1000
    events: list[dict] = [{"ph": "M", "pid": 0, "name": "process_name",
                           "args": {"name": f"{s.name} p={s.stages} m={s.microbatches} v={s.chunks} "
                                            f"({s.placement})"}}]
    for d in range(s.stages):
        events.append({"ph": "M", "pid": 0, "tid": d, "name": "thread_name", "args": {"name": f"device {d}"}})
        for t, a in s.program(d):
            events.append({"ph": "X", "pid": 0, "tid": d, "name": str(a), "cat": a.kind,
                           "ts": t * us, "dur": s.cost(a) * us,
                           "args": {"microbatch": a.microbatch, "chunk": a.chunk,
                                    "stage": s.stage_of(d, a.chunk)}})
    for n, snd in enumerate(s.sends):
        what = "activation" if snd.kind == "F" else "input gradient"
        common = {"pid": 0, "id": n, "cat": "send", "name": f"{what} {snd.microbatch}"}
        events.append({**common, "ph": "s", "tid": snd.src, "ts": snd.tick * us - 1})
        events.append({**common, "ph": "f", "bp": "e", "tid": snd.dst, "ts": snd.needed_at * us})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#8172b3"}


def save_png(s, path: str) -> None:
    """A timeline figure: one lane per device, one box per action, labelled microbatch
    (and chunk); colours F blue, B orange, W purple."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"path={path!r}: folder {folder!r} does not exist; create it or write elsewhere")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * s.total_time), 0.5 * s.stages + 1.6))
    for d in range(s.stages):
        for t, a in s.program(d):
            ax.broken_barh([(t, s.cost(a))], (d - 0.4, 0.8), facecolors=COLORS[a.kind], edgecolor="white")
            label = f"{a.microbatch}" + (f".{a.chunk}" if s.chunks > 1 else "")
            ax.text(t + s.cost(a) / 2, d, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(s.stages), [f"device {d}" for d in range(s.stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, s.total_time)
    ax.set_xlabel("tick")
    width = fig.get_size_inches()[0]
    ax.set_title(textwrap.fill(header(s), int(width * 14)), fontsize=8)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()],
              labels=["F", "B", "W"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
