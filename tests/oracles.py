"""Oracles shared by several test files: independent readings of what the library computes,
written from the definitions, never from the library's own code."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import settings

from jaxpar.pipeline import schedule as S

FAST = settings(max_examples=40, deadline=None)   # property tests of pure-Python schedules


def v_stage(p: int, device: int, chunk: int) -> int:
    """The V layout (DualPipe-V): chunk 0 goes down the devices, chunk 1 comes back up."""
    return device if chunk == 0 else 2 * p - 1 - device


def model_stage(s: S.Schedule, device: int, chunk: int) -> int:
    """The model stage of (device, chunk): the V layout, or Megatron's chunk * p + device."""
    return v_stage(s.stages, device, chunk) if s.layout == "v" else chunk * s.stages + device


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
