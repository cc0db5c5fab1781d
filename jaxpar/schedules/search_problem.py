"""The schedule search's problem as flat tables, and the timing of device orders that its
seeds and moves are scored by (`search.py` is the search; `seeds.py`, `greedy.py` and
`annealing.py` make and improve the orders).

An action is a node: node = (kind * S + stage) * m + microbatch, with kind F=0, B=1, W=2
and S = p * chunks model stages. A device's order is a list of nodes; `device_spans` times the
orders as `timing.timed` does (each action at the earliest time its device is free and
its inputs have arrived, plus comm across devices) and `fits` checks a device's live
memory against the cap.

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from jaxpar.schedules.schedule import Schedule
from jaxpar.schedules.timing import Costs

KINDS = "FBW"
F, B, W = 0, 1, 2
UNIT_COSTS = {"F": 1, "B": 1, "W": 1}   # the table's ticks: they fix each device's order only
# Actions evaluated per second of `time_limit` (a slow core manages about this many);
# counting work instead of reading the clock keeps a search deterministic given its seed.
EVALUATIONS_PER_SECOND = 500_000
# The wall clock stops a search only past this many times its limit (a loaded machine):
# a search that stops early is no longer the same for the same seed.
BACKSTOP = 5
TOLERANCE = 1e-9


# ---- the problem as flat tables ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One search's sizes and costs as flat lists indexed by action (node).

    node = (kind * S + stage) * m + microbatch, S = p * chunks model stages; `device[node]`,
    `duration[node]`, `memory[node]` (what the action adds to its device's live memory,
    M_B units; negative for B and W) and `inputs[node]` = ((node, delay), ...): the
    actions it waits for, delay = comm when the input crosses devices."""

    stages: int
    microbatches: int
    chunks: int
    placement: str
    cap: float
    device: tuple[int, ...]
    duration: tuple[float, ...]
    memory: tuple[float, ...]
    inputs: tuple[tuple[tuple[int, float], ...], ...]
    stage_of: tuple[tuple[int, ...], ...]   # [device][chunk] -> model stage
    comm: float = 0.0

    @property
    def model_stages(self) -> int:
        return self.stages * self.chunks

    def node(self, kind: int, stage: int, microbatch: int) -> int:
        return (kind * self.model_stages + stage) * self.microbatches + microbatch

    def action(self, node: int) -> tuple[int, int, int]:
        """(kind, model stage, microbatch) of `node`."""
        rest, microbatch = divmod(node, self.microbatches)
        kind, stage = divmod(rest, self.model_stages)
        return kind, stage, microbatch


def make_problem(p: int, m: int, v: int, placement: str, costs: Costs, cap: float) -> Problem:
    shape = Schedule("search", p, m, v, UNIT_COSTS, True, (), placement)
    total = p * v
    device_of = [shape.device_of(k)[0] for k in range(total)]
    device, duration, memory, inputs = [], [], [], []
    for kind in range(3):
        for stage in range(total):
            size = costs.of("activation", stage) if isinstance(costs.activation, tuple) else costs.activation / v
            kept = costs.weight_memory * size
            change = (size, -(size - kept), -kept)[kind]
            for i in range(m):
                needs = []
                if kind == F and stage > 0:
                    needs.append((F, stage - 1))
                if kind == B:
                    needs.append((F, stage))
                    if stage < total - 1:
                        needs.append((B, stage + 1))
                if kind == W:
                    needs.append((B, stage))
                device.append(device_of[stage])
                duration.append(costs.of(KINDS[kind], stage))
                memory.append(change)
                inputs.append(tuple(((k * total + s) * m + i,
                                     costs.comm if device_of[s] != device_of[stage] else 0.0) for k, s in needs))
    stage_of = tuple(tuple(shape.stage_of(d, c) for c in range(v)) for d in range(p))
    return Problem(p, m, v, placement, cap, tuple(device), tuple(duration), tuple(memory), tuple(inputs), stage_of,
                    costs.comm)


# ---- timing an order ----------------------------------------------------------------


def evaluate(problem: Problem, programs: Sequence[Sequence[int]]) -> tuple[float, float] | None:
    """(step time, sum of the device spans) of `programs` (node lists, one a device) timed
    as `timing.timed` does, or None if they deadlock. The step time is the longest span."""
    spans = device_spans(problem, programs)
    return None if spans is None else (max(spans), math.fsum(spans))


def device_spans(problem: Problem, programs: Sequence[Sequence[int]]) -> list[float] | None:
    """Each device's span (first start to last end) with every action at the earliest time
    its device is free and its inputs arrived; None on a deadlock."""
    end = [-1.0] * len(problem.duration)
    inputs, duration = problem.inputs, problem.duration
    p = len(programs)
    first, free, position = [0.0] * p, [0.0] * p, [0] * p
    lengths = [len(program) for program in programs]
    progress = True
    while progress:
        progress = False
        for d in range(p):
            program, j, n, now = programs[d], position[d], lengths[d], free[d]
            begin = j
            while j < n:
                node = program[j]
                start = now
                for source, delay in inputs[node]:
                    arrival = end[source]
                    if arrival < 0:
                        break
                    arrival += delay
                    if arrival > start:
                        start = arrival
                else:
                    if j == 0:
                        first[d] = start
                    now = end[node] = start + duration[node]
                    j += 1
                    continue
                break
            if j != begin:
                position[d], free[d], progress = j, now, True
    if position != lengths:
        return None
    return [free[d] - first[d] if lengths[d] else 0.0 for d in range(p)]


def fits(problem: Problem, program: Sequence[int]) -> bool:
    """True if the device running `program` never holds more than the cap."""
    live, cap, memory = 0.0, problem.cap + TOLERANCE, problem.memory
    for node in program:
        live += memory[node]
        if live > cap:
            return False
    return True


# ---- the work a search may do -------------------------------------------------------


class Budget:
    """The work a search may do, counted in actions timed (deterministic), with a
    wall-clock backstop at five times the time limit for a slow machine."""

    def __init__(self, time_limit: float):
        self.left = time_limit * EVALUATIONS_PER_SECOND
        self.deadline = time.perf_counter() + BACKSTOP * time_limit

    def take(self, work: float) -> bool:
        """Spend `work` if some is left; False once the budget (or the clock) has run out."""
        if self.left <= 0 or time.perf_counter() > self.deadline:
            return False
        self.left -= work
        return True
