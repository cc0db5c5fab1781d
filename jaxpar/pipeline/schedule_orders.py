"""The order in which each device runs its actions, for every named schedule, and the
simulator that times them.

A generator returns one list of `Action`s per device; `simulate` turns the lists into
the timed table of a `Schedule`, `find_deadlock` names the cycle when they cannot run
(the validator uses it too), and `build` (behind `schedule.make`) checks the request
first. The orders are the published ones: GPipe (Huang et al. 2019), 1F1B /
PipeDream-Flush (Narayanan et al. 2021), Megatron's interleaved 1F1B (Narayanan et al.
2021, virtual stage = chunk*p + device) and the handcrafted ZB-H1 / ZB-H2 of Qi et al.
2023 ("Zero Bubble Pipeline Parallelism"), whose backward is split into B (input
gradient, which the previous stage waits for) and W (weight gradient, which nobody waits
for and so fills the bubbles), and DualPipeV (DeepSeek-AI 2025, the V-shape ZB-V of Qi et
al. 2024, "Pipeline Parallelism with Controllable Memory"), two chunks per device in a V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jaxpar.pipeline.schedule import (DEFAULT_COSTS, DEFAULT_SPLIT_COSTS, KNOWN, SPLIT, Action, Key,
                                      Schedule, check_count, is_whole)


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
    """Megatron's interleaved 1F1B: device d holds chunks 0..v-1 (stages d, p+d, ...);
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
    runs 2p-1 forwards of chunk 0 before its first B0); `v` is 2."""
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


PROGRAMS: dict[str, Callable[[int, int, int], list[list]]] = {
    "naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
    "zb-h1": zb_h1, "zb-h2": zb_h2, "dualpipe-v": dualpipe_v,
}
LAYOUT = {"dualpipe-v": "v"}  # the others: "interleaved" (stage = chunk*p + device)


def find_deadlock(programs: Sequence[Sequence[Action]], shape: Schedule) -> list[tuple[int, Action]]:
    """A cycle of the wait-for graph, as [(device, action), ...], or [] if none.

    Each action waits for the one before it on its device and for the actions whose
    results it receives (`Schedule.inputs`); a receive blocks until the producer ran.
    Iterative depth-first search, so p=8, m=32, v=4 stays well under a millisecond a node."""
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


def simulate(name: str, stages: int, microbatches: int, chunks: int, costs: Mapping[str, int],
             split_backward: bool, programs: Sequence[Sequence[Action]],
             layout: str = "interleaved") -> Schedule:
    """Place each device's program in order, every action at the earliest tick at which
    its device is free and its inputs have ended (a device with blocking receives)."""
    shape = Schedule(name, stages, microbatches, chunks, dict(costs), split_backward, (), layout)
    end: dict[Key, int] = {}
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(stages)]
    free = [0] * stages
    progress = True
    while progress:
        progress = False
        for d, prog in enumerate(programs):
            while len(placed[d]) < len(prog):
                a = prog[len(placed[d])]
                needs = shape.inputs(d, a)
                if any(k not in end for k in needs):
                    break
                t = max([free[d]] + [end[k] for k in needs])
                free[d] = end[shape._key(d, a)] = t + costs[a.kind]
                placed[d].append((t, a))
                progress = True
    if any(len(p) < len(q) for p, q in zip(placed, programs)):
        chain = " -> ".join(f"{a} on device {d}" for d, a in find_deadlock(programs, shape))
        raise ValueError(f"{name}: the device programs deadlock: {chain} -> (back to the first)")
    table: list[list[Action | None]] = [[None] * stages for _ in range(max(free, default=0))]
    for d, p in enumerate(placed):
        for t, a in p:
            table[t][d] = a
    return dataclasses.replace(shape, actions=tuple(tuple(r) for r in table))


def build(name: str, stages: int, microbatches: int, chunks: int | None,
          costs: Mapping[str, int] | None) -> Schedule:
    """`schedule.make`: check the request, run the named order through `simulate`, validate."""
    if name not in KNOWN:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(KNOWN)}")
    split = name in SPLIT
    chunks = (2 if name in ("interleaved", "dualpipe-v") else 1) if chunks is None else chunks
    _check_shape(name, stages, microbatches, chunks)
    full = dict(DEFAULT_SPLIT_COSTS if split else DEFAULT_COSTS)
    for kind, c in (costs or {}).items():
        if kind not in full:
            raise ValueError(f"cost {kind}={c}: {name} has kinds {', '.join(full)} only"
                             + ("" if split else f" (W exists only with the split backward: {', '.join(SPLIT)})"))
        if not is_whole(c) or c < 1:
            raise ValueError(f"cost {kind}={c}: costs are whole ticks >= 1, e.g. {kind}=1")
        full[kind] = c
    programs = PROGRAMS[name](stages, microbatches, chunks)
    return simulate(name, stages, microbatches, chunks, full, split, programs,
                    LAYOUT.get(name, "interleaved")).validate()


def _check_shape(name: str, p: int, m: int, v: int) -> None:
    for what, n in (("stages p", p), ("microbatches m", m), ("chunks v", v)):
        check_count(what, n)
    if name == "interleaved":
        if v < 2:
            raise ValueError(f"interleaved with chunks v={v}: use -v 2 or more (v=1 is 1f1b)")
        if m % p:
            lo, hi = m // p * p, m // p * p + p
            near = str(hi) if lo == 0 or hi - m < m - lo else str(lo) if m - lo < hi - m else f"{lo} or {hi}"
            raise ValueError(f"interleaved needs microbatches a multiple of stages (Megatron's "
                             f"schedule): m={m}, p={p}; nearest valid m: {near}")
    elif name == "dualpipe-v":
        if v != 2:
            raise ValueError(f"dualpipe-v has 2 chunks per device (down the devices and back up), "
                             f"not v={v}; drop -v")
        if m < 2 * p - 1:
            raise ValueError(f"dualpipe-v needs microbatches >= 2*stages - 1 (device 0 runs 2p-1 "
                             f"forwards before its first backward): m={m} < {2 * p - 1} for p={p}; "
                             f"use -m {2 * p - 1} or more, or zb-h1")
    elif v != 1:
        raise ValueError(f"chunks v={v} applies to interleaved only; drop -v for {name}")
    if name.startswith("zb-") and m < p:
        raise ValueError(f"{name} needs microbatches >= stages: m={m} < p={p}; use -m {p} or more")
