"""Oracles shared by several test files: independent readings of what the library computes,
written from the definitions, never from the library's own code."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import settings

from jaxpar.schedules import schedule as S

FAST = settings(max_examples=40, deadline=None)   # property tests of pure-Python schedules


def v_stage(p: int, device: int, chunk: int) -> int:
    """The V placement (DualPipe-V): chunk 0 goes down the devices, chunk 1 comes back up."""
    return device if chunk == 0 else 2 * p - 1 - device


def model_stage(s: S.Schedule, device: int, chunk: int) -> int:
    """The model stage of (device, chunk): the V placement, or Megatron's chunk * p + device."""
    return v_stage(s.stages, device, chunk) if s.placement == "v" else chunk * s.stages + device


def bubble(s: S.Schedule) -> Fraction:
    """Idle ticks / (devices x total time), counted from the occupancy, exactly."""
    idle = sum(a is None for d in range(s.stages) for a in s.occupancy(d))
    return Fraction(idle, s.stages * s.total_time)


def check_dependencies(s: S.Schedule) -> None:
    """An independent reading of the table: every action exactly once, none overlapping on
    its device, F after the previous stage's F, B after its own F and the next stage's B,
    W after its B."""
    start, end = {}, {}
    for d in range(s.stages):
        prev_end = 0
        for t, a in s.program(d):
            assert t >= prev_end, f"device {d} overlaps at tick {t}"
            prev_end = t + s.costs[a.kind]
            key = (a.kind, a.microbatch, model_stage(s, d, a.chunk))
            assert key not in start
            start[key], end[key] = t, prev_end
    n = s.stages * s.chunks
    kinds = "FBW" if s.split_backward else "FB"
    assert set(start) == {(k, i, st) for k in kinds for i in range(s.microbatches) for st in range(n)}
    for (kind, i, k), t in start.items():
        needs = {"F": [("F", i, k - 1)] if k else [],
                 "B": [("F", i, k)] + ([("B", i, k + 1)] if k < n - 1 else []),
                 "W": [("B", i, k)]}[kind]
        assert all(t >= end[x] for x in needs), (kind, i, k)


# ---- pipeline sends -----------------------------------------------------------------------
# From the schedules' definitions: which device holds each model stage, and what crosses
# between devices. Each microbatch crosses every stage boundary once forward (its
# activation) and once backward (its gradient); W sends nothing; a boundary between two
# chunks of one device (the V's turn) moves nothing between devices.

def placement(name: str, p: int, v: int = 1) -> list[int]:
    """The device of model stage k = 0 .. p*v-1: one stage per device (chunks = 1), Megatron's
    interleaving for `interleaved` (stage k on device k mod p: chunk c of device d is
    stage c*p + d), and the V for `dualpipe-v` (down the devices, then back up)."""
    if name == "dualpipe-v":
        return list(range(p)) + list(reversed(range(p)))
    return [k % p for k in range(p * v)]


def crossings(name: str, p: int, v: int = 1) -> list[tuple[int, int]]:
    """(device of stage k, device of stage k+1) for every boundary whose two stages sit on
    different devices."""
    where = placement(name, p, v)
    return [(a, b) for a, b in zip(where, where[1:]) if a != b]


def sends(name: str, p: int, m: int, v: int = 1) -> int:
    """Device-to-device sends of one step: 2 m per crossing boundary. In closed form,
    for p >= 2: 2m(p-1) with one stage per device (W sends nothing, so ZB-H1 and ZB-H2
    send as 1F1B does); 2m(pv-1) interleaved (stage k+1 is always on the next device,
    wrapping from p-1 to 0); 2m(2p-2) for the V (2p-1 boundaries, the turn local)."""
    return 2 * m * len(crossings(name, p, v))


def direction(src: int, dst: int, lane: str, p: int) -> str:
    """The runtime's direction of a send: right to d+1 (mod p), left to d-1; at p = 2 the
    two neighbours are one device, and activations (lane F) go right, gradients left."""
    return "right" if dst == (src + 1) % p and (lane == "F" or dst != (src - 1) % p) else "left"


def channel_pairs(name: str, p: int, v: int = 1) -> dict[tuple[str, str], set[tuple[int, int]]]:
    """{(lane, direction): (source, destination) devices}: activations go down each
    crossing boundary in the F lane, gradients back up it in the B lane."""
    out: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for a, b in crossings(name, p, v):
        for lane, src, dst in (("F", a, b), ("B", b, a)):
            out.setdefault((lane, direction(src, dst, lane, p)), set()).add((src, dst))
    return out


def lockstep_permutes(s: S.Schedule) -> int:
    """Collective-permutes the runtime executes for `s`, from how it runs: SPMD steps, each
    a backward lane (B or W) then a forward lane (F) on every device, data moving at the
    end of a step. Each action, in order of its start tick, runs at the first step after
    every step producing what it needs (F: the previous stage's F; B: its own F and the
    next stage's B; W: its B) and not before its device's previous action: in the same
    step only when that one was in the backward lane and this one is an F. A step runs one
    collective-permute for each (lane, direction) in which some device sends."""
    p, v = s.stages, s.chunks
    where = placement(s.name, p, v)
    last = p * v - 1
    stage = {}                    # (device, chunk) -> model stage: chunk c is the device's c-th stage
    for k, d in enumerate(where):
        stage[d, where[:k].count(d)] = k
    step: dict[tuple[str, int, int], int] = {}
    previous: dict[int, tuple[str, int]] = {}
    lanes = {"F": "F", "B": "B", "W": "B"}
    permutes = set()
    for t, d, a in sorted((t, d, a) for d in range(p) for t, a in s.program(d)):
        k, i = stage[d, a.chunk], a.microbatch
        needs = {"F": [("F", i, k - 1)] if k else [],
                 "B": [("F", i, k)] + ([("B", i, k + 1)] if k < last else []),
                 "W": [("B", i, k)]}[a.kind]
        j = max((step[x] + 1 for x in needs), default=0)
        if d in previous:
            lane, at = previous[d]
            j = max(j, at if (lane, lanes[a.kind]) == ("B", "F") else at + 1)
        step[a.kind, i, k] = j
        previous[d] = (lanes[a.kind], j)
        target = k + 1 if a.kind == "F" else k - 1 if a.kind == "B" else None
        if target is not None and 0 <= target <= last and where[target] != d:
            lane = lanes[a.kind]
            permutes.add((j, lane, direction(d, where[target], lane, p)))
    return len(permutes)
