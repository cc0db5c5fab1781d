"""The order in which each device runs its actions, for every named schedule, and the
one registry that says everything else about a schedule name.

A generator returns one list of `Action`s per device; `schedule.make` looks the name up
in `REGISTRY` (its order, whether the backward is split, the chunks' placement, the default
chunks, its label, the sizes it needs) and times the lists into a `Schedule`; the
formulas, the memory model's callers, the planner and the CLI read the rest of what they
say about a schedule (its closed forms, its chunks) here too. Nothing else lists schedule
names. The orders are the published ones: GPipe (Huang et al. 2019), 1F1B /
PipeDream-Flush (Narayanan et al. 2021), Megatron's interleaved 1F1B (Narayanan et al.
2021, virtual stage = chunk*p + device) and the handcrafted ZB-H1 / ZB-H2 of Qi et al.
2023 ("Zero Bubble Pipeline Parallelism"), whose backward is split into B (input
gradient, which the previous stage waits for) and W (weight gradient, which nobody waits
for and so fills the bubbles), and DualPipeV (DeepSeek-AI 2025, the V-shape ZB-V of Qi et
al. 2024, "Pipeline Parallelism with Controllable Memory"), two chunks per device in a V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from jaxpar.errors import ConfigError


class Action(NamedTuple):
    """One unit of work: kind F (forward), B (backward; input gradient only when the
    schedule splits the backward), or W (weight gradient), of one microbatch on one chunk
    (model piece) of a device."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".c{self.chunk}" if self.chunk else "")


def naive(p: int, m: int, v: int) -> list[list]:
    """No pipelining: each microbatch goes all the way forward and back before the next
    starts (m > 1 is gradient accumulation, which does not shrink the bubble)."""
    return [[Action(k, i) for i in range(m) for k in "FB"] for _ in range(p)]


def gpipe(p: int, m: int, v: int) -> list[list]:
    """All m forwards, then all m backwards (Huang et al. 2019)."""
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
            for _ in range(p)]


def one_f_one_b(p: int, m: int, v: int, split: bool = False, deferred=lambda d: 0,
                warmup=lambda d, p: p - d - 1) -> list[list]:
    """1F1B (PipeDream-Flush): stage s warms up with p-s-1 forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    With `split`, each B is followed by the W of the microbatch `deferred(s)` backwards
    earlier, and the held-back W's close the program (the zero-bubble variants)."""
    progs = []
    for d in range(p):
        w = min(warmup(d, p), m)
        prog = [Action("F", i) for i in range(w)]
        for j in range(m):
            if w + j < m:
                prog.append(Action("F", w + j))
            prog.append(Action("B", j))
            if split and j >= deferred(d):
                prog.append(Action("W", j - deferred(d)))
        if split:
            prog += [Action("W", i) for i in range(max(0, m - deferred(d)), m)]
        progs.append(prog)
    return progs


def zb_h1(p: int, m: int, v: int) -> list[list]:
    """ZB-H1: 1F1B's forwards and input-gradient backwards, so 1F1B's activation memory;
    stage s holds back s weight gradients, which then fill the drain, where stage s would
    otherwise wait for input gradients (bubble (p-1)(F+B-W) per device; Qi et al. 2023)."""
    return one_f_one_b(p, m, v, split=True, deferred=lambda d: d)


def zb_h2(p: int, m: int, v: int) -> list[list]:
    """ZB-H2: stage s runs 2(p-s)-1 forwards before its first backward (up to 2p-1 live
    activations on the first stage), so no device waits for its first input gradient,
    and holds back 2s weight gradients for the drain. With m >= 2p-1, back-to-back steps
    form a parallelogram with no bubble (Qi et al. 2023, who post-validate the optimizer
    step to keep it)."""
    return one_f_one_b(p, m, v, split=True, deferred=lambda d: 2 * d,
                       warmup=lambda d, p: 2 * (p - d - 1))


def interleaved(p: int, m: int, v: int) -> list[list]:
    """Megatron's interleaved 1F1B: device d holds chunks 0..chunks-1 (stages d, p+d, ...);
    forwards go in rounds of p microbatches through chunk 0, then chunk 1, ...; backwards
    likewise from the last chunk; warm-up (p-d-1)*2 + (v-1)*p forwards (m % p == 0)."""
    total = m * v

    def order(k: int, backward: bool):
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Action("B" if backward else "F", mb, v - 1 - chunk if backward else chunk)

    progs = []
    for d in range(p):
        w = min((p - d - 1) * 2 + (v - 1) * p, total)
        prog = [order(k, False) for k in range(w)]
        for j in range(total):
            if w + j < total:
                prog.append(order(w + j, False))
            prog.append(order(j, True))
        progs.append(prog)
    return progs


def dualpipe_v(p: int, m: int, v: int) -> list[list]:
    """DualPipeV / ZB-V: device d holds stage d (chunk 0, going down the devices) and stage
    2p-1-d (chunk 1, coming back up), so device 0 has the first stage and the loss, and
    device p-1 turns each microbatch around without a send. In chunk units (F=B=W=1):

      warm-up    2(p-d-1) F0, then d+1 pairs F0 F1, then p-d-1 times B1 W1 F1;
      steady     B1 W1 F0 B0 W0 F1 (one microbatch of the whole device) while forwards
                 remain, a finished kind skipped;
      drain      B1 B0 while B1's remain (their W's held back), then W B0, then the held W's.

    The held-back W's fill the drain as in ZB-H1, and a device keeps at most 2p
    microbatch-chunks live: 1F1B's p full-stage microbatches. Needs m >= 2p-1 (device 0
    runs 2p-1 forwards of chunk 0 before its first B0); `chunks` is 2."""
    progs = []
    for d in range(p):
        prog: list[Action] = []
        held: list[Action] = []  # W's not yet run, oldest first
        done = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}

        def run(step: str) -> None:
            """F0, F1, B0, B1 (its W held back), B0W / B1W (W right after), W (oldest held)."""
            if step == "W":
                prog.append(held.pop(0))
                return
            kind, chunk = step[0], int(step[1])
            if done[step[:2]] == m:
                return
            prog.append(Action(kind, done[step[:2]], chunk))
            done[step[:2]] += 1
            if kind == "B":
                held.append(Action("W", prog[-1].microbatch, chunk))
                if step.endswith("W"):
                    prog.append(held.pop(0))

        for step in ["F0"] * 2 * (p - d - 1) + ["F0", "F1"] * (d + 1) + ["B1W", "F1"] * (p - d - 1):
            run(step)
        while done["F0"] < m or done["F1"] < m:
            for step in ("B1W", "F0", "B0W", "F1"):
                run(step)
        while done["B1"] < m:
            run("B1")
            run("B0")
        while done["B0"] < m:
            run("W")
            run("B0")
        while held:
            run("W")
        progs.append(prog)
    return progs


def find_deadlock(programs: Sequence[Sequence[Action]], shape) -> list[tuple[int, Action]]:
    """A cycle of the wait-for graph of the device programs, as [(device, action), ...], or
    [] if none. `shape` is the Schedule they run in (its `inputs` and `_key` say who waits
    for whom).

    Each action waits for the one before it on its device and for the actions whose
    results it receives (`Schedule.inputs`); a receive blocks until the producer ran.
    Iterative depth-first search, so p=8, m=32, chunks=4 stays well under a millisecond a node."""
    node = {shape._key(d, a): (d, j) for d, p in enumerate(programs) for j, a in enumerate(p)}

    def waits_for(d: int, j: int) -> list[tuple[int, int]]:
        out = [(d, j - 1)] if j else []
        return out + [node[k] for k in shape.inputs(d, programs[d][j]) if k in node]

    state: dict[tuple[int, int], int] = {}  # 1 on the DFS path, 2 done
    for root in node.values():
        if root in state:
            continue
        path, stack = [root], [iter(waits_for(*root))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                cycle = path[path.index(nxt):]
                return [(d, programs[d][j]) for d, j in cycle]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(waits_for(*nxt)))
    return []


def _nearest_multiple(m: int, p: int) -> str:
    lo, hi = m // p * p, m // p * p + p
    return str(hi) if lo == 0 or hi - m < m - lo else str(lo) if m - lo < hi - m else f"{lo} or {hi}"


def _one_chunk(name: str, p: int, m: int, chunks: int) -> None:
    if chunks != 1:
        raise ConfigError(f"chunks={chunks} applies to interleaved only; drop chunks for {name}")


def _needs_interleaved(name: str, p: int, m: int, chunks: int) -> None:
    if chunks < 2:
        raise ConfigError(f"interleaved with chunks={chunks}: use chunks=2 or more (chunks=1 is 1f1b)")
    if m % p:
        raise ConfigError(f"interleaved needs microbatches a multiple of stages (Megatron's schedule): "
                          f"microbatches={m}, stages={p}; nearest valid microbatches={_nearest_multiple(m, p)}")


def _needs_m_ge_p(name: str, p: int, m: int, chunks: int) -> None:
    _one_chunk(name, p, m, chunks)
    if m < p:
        raise ConfigError(f"{name} needs microbatches >= stages: microbatches={m} < stages={p}; "
                          f"use microbatches={p} or more")


def _needs_v(name: str, p: int, m: int, chunks: int) -> None:
    if chunks != 2:
        raise ConfigError(f"dualpipe-v has 2 chunks per device (down the devices and back up), not "
                          f"chunks={chunks}; drop chunks")
    if m < 2 * p - 1:
        raise ConfigError(f"dualpipe-v needs microbatches >= 2*stages - 1 (device 0 runs 2p-1 forwards "
                          f"before its first backward): microbatches={m} < {2 * p - 1} for stages={p}; "
                          f"use microbatches={2 * p - 1} or more, or zb-h1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kind:
    """Everything about one schedule name: its device programs, its label, whether its
    backward is split into B and W, the placement of its chunks over the model, its chunks
    per device, the check of (stages, microbatches, chunks) it needs, and the closed forms
    the formulas give for it (pipeline/formulas.py keeps the forms, by these names)."""

    name: str
    label: str
    order: Callable[[int, int, int], list[list[Action]]]
    split_backward: bool = False
    placement: str = "loop"       # "loop": stage = chunk*p + device; "v": down the devices and back up
    chunks: int = 1               # chunks per device, the default where the caller picks them
    takes_chunks: bool = False    # the caller picks the chunks (>= 2); otherwise always `chunks`
    requires: Callable[[str, int, int, int], None] = _one_chunk
    bubble: str | None = None     # its closed-form bubble (formulas.BUBBLES); None: only the table's
    in_flight: str = "p"          # microbatches the first stage holds at its peak (formulas.IN_FLIGHT)
    chunked: str | None = None    # the schedule that runs this order over more than one chunk per device


REGISTRY: dict[str, Kind] = {k.name: k for k in (
    Kind(name="naive", label="naive", order=naive, bubble="one at a time", in_flight="one"),
    Kind(name="gpipe", label="GPipe", order=gpipe, bubble="fill-drain", in_flight="all"),
    Kind(name="1f1b", label="1F1B", order=one_f_one_b, bubble="fill-drain", chunked="interleaved"),
    Kind(name="interleaved", label="interleaved 1F1B", order=interleaved, chunks=2, takes_chunks=True,
         requires=_needs_interleaved, bubble="interleaved", in_flight="interleaved"),
    Kind(name="zb-h1", label="ZB-H1", order=zb_h1, split_backward=True, requires=_needs_m_ge_p),
    Kind(name="zb-h2", label="ZB-H2", order=zb_h2, split_backward=True, requires=_needs_m_ge_p, in_flight="2p-1"),
    Kind(name="dualpipe-v", label="DualPipe-V", order=dualpipe_v, split_backward=True, placement="v", chunks=2,
         requires=_needs_v, bubble="v"),
)}
# The lecture's schedule: the default of `jaxpar train`, `jaxpar memory` and the planner,
# which runs it in chunks (its `chunked` schedule) when it picks v > 1.
DEFAULT = "1f1b"


def names(**facts) -> list[str]:
    """The names whose Kind has these field values, in registry order: names(split_backward=True)."""
    return [name for name, kind in REGISTRY.items() if all(getattr(kind, k) == v for k, v in facts.items())]


def lookup(name: str) -> Kind:
    """The registry entry of `name`, or ConfigError listing the known names."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise ConfigError(f"unknown schedule {name!r}; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]
