"""Pipeline schedules searched under a memory cap (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 3; Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362).

Given measured costs (`timing.Costs`: F, B, W per model stage, the latency `comm` of a
send, the memory an F leaves and the part B keeps for W) and a cap on each device's live
activation memory (M_B units: p is 1F1B's memory), `search` finds device orders, the
backward split into B and W, with a small bubble:

  seeds     the published orders that fit the cap (1F1B with W after B, ZB-H1, ZB-H2,
            DualPipe-V / ZB-V); one microbatch's block repeated at a fixed interval (the
            order of least memory: Qi et al. 2024's V-Min at v = 2); and a greedy list
            scheduler after Qi et al.'s heuristic, under several policies: the device free
            first takes a B whose input has arrived, else an F if memory allows (keeping
            room for the later chunks of the microbatches it started) and its warm-up
            wants it, else a W that fills the gap, holding some W's back for the drain;
            one policy keeps the warm-up's microbatches in flight through the steady
            state (1F1B's rule, the warm-up fitted to the costs: Qi et al.'s ZB-2p at
            large m, where the first device's wait for its first B is the whole bubble);
  local     moves of one action of one device's order to another place (half of them on
            the device that sets the step time), kept when the step time does not grow
            and the device stays under the cap.

The step time is Qi et al.'s cost, `Timing.cost`: the longest span of one device from its
first start to its last end, every action at the earliest time its device is free and
its inputs have arrived (`timing.timed`'s rule). The search is deterministic given `seed`:
its work is counted in actions timed (`time_limit` x EVALUATIONS_PER_SECOND); the clock
only cuts a run short on a machine five times slower than that.

    costs = Costs.parse("F=18.522,B=18.086,W=9.337,comm=0.601,weight_memory=0.366")  # Qi et al.'s 1.5B
    s = search(8, 24, costs, memory_cap=16)              # 2p M_B
    s.timing.bubble, s.timing.peak_memory, s.method      # 0.0433 (ZB-2p's), [15.83, ...], "greedy(...)"

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import numbers
import random
import time
from collections.abc import Sequence

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.pipeline import orders
from jaxpar.pipeline.orders import Action
from jaxpar.pipeline.schedule import PLACEMENTS, Schedule, ScheduleError, check_sizes, simulate
from jaxpar.pipeline.timing import Costs, Timing, timed

__all__ = ["Searched", "search", "minimum_cap", "validate_memory"]

KINDS = "FBW"
F, B, W = 0, 1, 2
UNIT_COSTS = {"F": 1, "B": 1, "W": 1}   # the table's ticks: they fix each device's order only
# Actions evaluated per second of `time_limit` (a slow core manages about this many);
# counting work instead of reading the clock keeps a search deterministic given its seed.
EVALUATIONS_PER_SECOND = 500_000
# The wall clock stops a search only past this many times its limit (a loaded machine):
# a search that stops early is no longer the same for the same seed.
BACKSTOP = 5
MAX_TIME_LIMIT = 3600.0
TOLERANCE = 1e-9


@dataclasses.dataclass(frozen=True, eq=False)
class Searched(Schedule):
    """A searched `Schedule`: its table runs the found device orders (timed with unit
    costs, so the runtime runs exactly that order), and it carries what the search knew:
    `timing` (the orders timed with the search's `Costs`), the `memory_cap` it kept (M_B
    units), `search_seconds` and `method`: the seed it started from (a published name,
    "repeated block" or "greedy(<policy>)"), with "+local" when local moves improved it."""

    timing: Timing | None = None
    memory_cap: float = 0.0
    search_seconds: float = 0.0
    method: str = ""

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["search"] = {"memory_cap": self.memory_cap, "method": self.method,
                         "search_seconds": self.search_seconds,
                         "bubble": self.timing.bubble if self.timing else None,
                         "peak_memory": self.timing.peak_memory if self.timing else None}
        return out


# ---- the problem as flat tables ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
    """One search's sizes and costs as flat lists indexed by action (node).

    node = (kind * S + stage) * m + microbatch, S = p * v model stages; `device[node]`,
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


def _problem(p: int, m: int, v: int, placement: str, costs: Costs, cap: float) -> _Problem:
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
    return _Problem(p, m, v, placement, cap, tuple(device), tuple(duration), tuple(memory), tuple(inputs), stage_of,
                    costs.comm)


def minimum_cap(stages: int, chunks: int, costs: Costs, placement: str = "loop") -> float:
    """The smallest memory cap any order fits in (M_B units): a microbatch's forward reaches
    every chunk of a device before its backward frees the first, so each device holds at
    least one microbatch's activations on all its chunks at once."""
    shape = Schedule("search", stages, 1, chunks, UNIT_COSTS, True, (), placement)

    def size(stage: int) -> float:
        return costs.of("activation", stage) if isinstance(costs.activation, tuple) else costs.activation / chunks

    return max(math.fsum(size(shape.stage_of(d, c)) for c in range(chunks)) for d in range(stages))


# ---- timing an order ----------------------------------------------------------------


def _evaluate(problem: _Problem, programs: Sequence[Sequence[int]]) -> tuple[float, float] | None:
    """(step time, sum of the device spans) of `programs` (node lists, one a device) timed
    as `timing.timed` does, or None if they deadlock. The step time is the longest span."""
    spans = _spans(problem, programs)
    return None if spans is None else (max(spans), math.fsum(spans))


def _spans(problem: _Problem, programs: Sequence[Sequence[int]]) -> list[float] | None:
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


def _fits(problem: _Problem, program: Sequence[int]) -> bool:
    """True if the device running `program` never holds more than the cap."""
    live, cap, memory = 0.0, problem.cap + TOLERANCE, problem.memory
    for node in program:
        live += memory[node]
        if live > cap:
            return False
    return True


# ---- seeds: the published orders --------------------------------------------------


def _published_seeds(problem: _Problem) -> dict[str, list[list[int]]]:
    """The published orders of this shape that fit the cap, as node lists."""
    p, m, v = problem.stages, problem.microbatches, problem.chunks
    found: dict[str, list[list[Action]]] = {}
    if problem.placement == "loop" and v == 1:
        found["1f1b"] = orders.one_f_one_b(p, m, v, split=True)
        if m >= p:
            found["zb-h1"] = orders.zb_h1(p, m, v)
            found["zb-h2"] = orders.zb_h2(p, m, v)
    if problem.placement == "v" and m >= 2 * p - 1:
        found["dualpipe-v"] = orders.dualpipe_v(p, m, v)
    found["one at a time"] = _one_at_a_time(problem)
    seeds = {}
    for name, actions in found.items():
        programs = [[problem.node(KINDS.index(a.kind), problem.stage_of[d][a.chunk], a.microbatch) for a in prog]
                    for d, prog in enumerate(actions)]
        if all(_fits(problem, program) for program in programs):
            seeds[name] = programs
    return seeds


def _one_at_a_time(problem: _Problem) -> list[list[Action]]:
    """Each microbatch forward through every stage and back before the next starts, W
    right after B: one microbatch live at a time, so it fits `minimum_cap`."""
    programs: list[list[Action]] = [[] for _ in range(problem.stages)]
    for i in range(problem.microbatches):
        for kinds, stages in (("F", range(problem.model_stages)), ("BW", reversed(range(problem.model_stages)))):
            for stage in stages:
                d = problem.device[problem.node(F, stage, 0)]
                chunk = problem.stage_of[d].index(stage)
                programs[d] += [Action(kind, i, chunk) for kind in kinds]
    return programs


class _Budget:
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


# ---- seeds: one microbatch's block, repeated (modulo scheduling) -----------------------


def _repeated_block(problem: _Problem) -> list[list[int]] | None:
    """Every microbatch runs the same block of actions, the next one `interval` later
    (Qi et al. 2024's building blocks; modulo scheduling): one microbatch's actions are
    placed in dependency order, each as early as its inputs allow where its device is
    free at that time modulo the interval, the F's and B's first, then each W at the first
    room after its B. The interval starts at the busiest device's work for one microbatch and grows until the
    block fits. Each microbatch's activations live only as long as its block, so this
    is the order of least memory (V-Min's, at v = 2); None if no interval up to twice the
    work fits."""
    total, m = problem.model_stages, problem.microbatches
    work = [0.0] * problem.stages
    for node in range(len(problem.duration)):
        if node % m == 0:
            work[problem.device[node]] += problem.duration[node]
    interval = max(work)
    shortest = min(problem.duration[problem.node(kind, stage, 0)] for kind in (F, B) for stage in range(total))
    order = [problem.node(F, k, 0) for k in range(total)] + [problem.node(B, k, 0) for k in reversed(range(total))]
    while interval <= 2 * max(work) + TOLERANCE:
        start = _place_block(problem, order, interval)
        if start is not None:
            break
        interval += shortest / 4
    else:
        return None
    timed_nodes = [[] for _ in range(problem.stages)]
    for node, t in start.items():
        for i in range(m):
            timed_nodes[problem.device[node]].append((t + i * interval, node + i))
    return [[node for _, node in sorted(row)] for row in timed_nodes]


def _place_block(problem: _Problem, order: list[int], interval: float) -> dict[int, float] | None:
    """Start times of one microbatch's actions (node of microbatch 0 -> time) with no two
    actions of a device overlapping modulo `interval`: the F's and B's first (the chain
    the next stage waits for), then each W at the first room after its B; None if an
    action finds no room."""
    busy: list[list[tuple[float, float]]] = [[] for _ in range(problem.stages)]   # per device, mod interval
    start: dict[int, float] = {}
    weights = [node + problem.model_stages * problem.microbatches for node in order if problem.action(node)[0] == B]
    for node in order + weights:
        ready = max((start[source] + problem.duration[source] + delay for source, delay in problem.inputs[node]),
                    default=0.0)
        device = problem.device[node]
        t = _free_at(busy[device], ready, problem.duration[node], interval)
        if t is None:
            return None
        start[node] = t
        _occupy(busy[device], t, problem.duration[node], interval)
    return start


def _free_at(busy: list[tuple[float, float]], ready: float, length: float, interval: float) -> float | None:
    """The earliest time >= ready at which [t, t + length) modulo `interval` misses every
    interval of `busy`, or None."""
    candidates = sorted({ready} | {ready + (end - ready) % interval for _, end in busy})
    for t in candidates:
        if t - ready >= interval:
            break
        if not _overlaps(busy, t, length, interval):
            return t
    return None


def _overlaps(busy: list[tuple[float, float]], t: float, length: float, interval: float) -> bool:
    """True if [t, t + length) modulo `interval` meets an interval of `busy`."""
    if length <= 0:
        return False
    a = t % interval
    pieces = [(a, min(a + length, interval))] + ([(0.0, a + length - interval)] if a + length > interval else [])
    return any(lo < hi_b - TOLERANCE and lo_b < hi - TOLERANCE for lo, hi in pieces for lo_b, hi_b in busy)


def _occupy(busy: list[tuple[float, float]], t: float, length: float, interval: float) -> None:
    """Mark [t, t + length) modulo `interval` busy (two pieces when it wraps around)."""
    a = t % interval
    busy.append((a, min(a + length, interval)))
    if a + length > interval:
        busy.append((0.0, a + length - interval))


# ---- seeds: the greedy list scheduler -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Policy:
    """How the greedy scheduler breaks its choices.

    deep_first   among ready F's, the one on the later model stage first (it brings a B
                 sooner); otherwise the older microbatch first.
    fill         "fit": an idle device runs a W only if it ends before the next known
                 arrival (or no arrival is known); "always": whenever it would idle.
    patient      an F that would delay a B known to arrive during it waits for the B
                 when the wait is shorter than the delay.
    warmup       before its first B, a device runs F's as memory allows ("memory"), or
                 only those that start ("start") or end ("end") before its first B would
                 arrive if no device were ever busy (Qi et al.'s warm-up).
    hold         keep W's back for the drain: once at most h = `_held_for_drain(d)` F's
                 are left, device d runs a W to fill a gap only when more than h are
                 pending, when memory needs it or when no B is left (h W's fill the time
                 by which its last B precedes the end of a parallelogram, d (F + B + 2 comm)).
    in_flight    after its first B, a device keeps at most as many microbatches in flight
                 (F's run minus B's run) as it had when that B ran: the warm-up's depth
                 kept through the steady state (1F1B's rule with a warm-up fitted to the
                 costs), so no device runs F's ahead of the B's it will wait for: Qi et
                 al.'s ZB-2p at large m, where the first device's wait for its first B
                 is the whole bubble."""

    deep_first: bool = True
    fill: str = "fit"
    patient: bool = False
    warmup: str = "memory"
    hold: bool = False
    in_flight: bool = False

    @property
    def name(self) -> str:
        return (f"greedy({'deep' if self.deep_first else 'oldest'}-first, fill {self.fill}"
                f"{', patient' if self.patient else ''}, warm-up {self.warmup}{', hold' if self.hold else ''}"
                f"{', in flight' if self.in_flight else ''})")


# The most useful first: the search runs the first FREE_POLICIES, then as many as its budget allows.
POLICIES = (_Policy(True, "always", False, "end", False, True),) + tuple(_Policy(deep, fill, patient, warmup, hold) for patient in (False, True) for hold in (False, True)
                 for warmup in ("end", "start", "memory") for fill in ("always", "fit") for deep in (True, False))
# A greedy run costs about this many evaluations of an order of the same size.
GREEDY_COST = 20
FREE_POLICIES = 3
INFINITY = math.inf


class _Greedy:
    """The list scheduler: the device free earliest decides next (module docstring)."""

    def __init__(self, problem: _Problem, policy: _Policy):
        self.problem, self.policy = problem, policy
        p, v = problem.stages, problem.chunks
        self.end = [-1.0] * len(problem.duration)
        self.next = [[[0] * v for _ in range(3)] for _ in range(p)]   # [device][kind][chunk] -> microbatch
        self.live = [0.0] * p
        self.reserved = [0.0] * p     # memory kept for the later chunks of started microbatches
        self.free = [0.0] * p
        self.idle_since = [0.0] * p
        self.blocked = [False] * p
        self.programs: list[list[int]] = [[] for _ in range(p)]
        # memory a microbatch started on a device's first chunk will take on its later chunks
        self.later = [math.fsum(problem.memory[problem.node(F, problem.stage_of[d][c], 0)] for c in range(1, v))
                      for d in range(p)]
        self.consumers: dict[int, list[int]] = {}   # node -> devices that wait for it
        self.first_back = [_first_back_arrival(problem, d) for d in range(p)]
        self.hold = [_held_for_drain(problem, d) if policy.hold else 0 for d in range(p)]
        self.depth = [INFINITY] * p   # microbatches in flight when the device ran its first B

    def run(self) -> list[list[int]] | None:
        """Each device's order (node lists), or None if the policy got stuck."""
        problem = self.problem
        total, each = len(problem.duration), 3 * problem.microbatches * problem.chunks
        self.queue = [(0.0, d) for d in range(problem.stages)]   # (free, device), stale entries skipped
        placed = 0
        while placed < total:
            if not self.queue:
                return None
            free, d = heapq.heappop(self.queue)
            if self.blocked[d] or free != self.free[d] or len(self.programs[d]) == each:
                continue
            placed += self._decide(d)
            if not self.blocked[d] and len(self.programs[d]) < each:
                heapq.heappush(self.queue, (self.free[d], d))
        return self.programs

    def _decide(self, d: int) -> int:
        """Place one action on device d (return 1), or move its clock on (return 0)."""
        problem, policy, now = self.problem, self.policy, self.free[d]
        back = forward = weight = None                 # the chosen (rank, ready, node, chunk) per kind
        next_arrival = known_back = INFINITY
        forward_held = False                           # an F has arrived but memory or warm-up holds it
        for chunk in range(problem.chunks):
            stage = problem.stage_of[d][chunk]
            done = self.next[d]
            for kind in (B, F, W):
                i = done[kind][chunk]
                if i >= problem.microbatches or (kind != F and i >= done[kind - 1][chunk]):
                    continue
                node = problem.node(kind, stage, i)
                ready = self._arrival(node)
                if kind == W:
                    rank = (i, -stage)
                    if weight is None or rank < weight[0]:
                        weight = (rank, ready, node, chunk)
                    continue
                if ready > now:
                    next_arrival = min(next_arrival, ready)
                if kind == B:
                    known_back = min(known_back, ready)
                    rank = (i, -stage)
                    if ready <= now and (back is None or rank < back[0]):
                        back = (rank, ready, node, chunk)
                elif not (self._memory_allows(d, node, chunk) and self._warming_allows(d, node, ready)):
                    forward_held = forward_held or ready <= now
                else:
                    rank = (-stage, i) if policy.deep_first else (i, stage)
                    if ready <= now and (forward is None or rank < forward[0]):
                        forward = (rank, ready, node, chunk)
        if back is not None:
            return self._place(d, back, B)
        if forward is not None:
            delay = now + problem.duration[forward[2]] - known_back
            if not (policy.patient and known_back < INFINITY and 0 < known_back - now < delay):
                return self._place(d, forward, F)
        if weight is not None and (forward_held or self._filling(d, weight, next_arrival)):
            return self._place(d, weight, W)
        if next_arrival < INFINITY:
            self.free[d] = next_arrival
        else:
            self.blocked[d] = True
        return 0

    def _filling(self, d: int, weight, next_arrival: float) -> bool:
        """Whether an idle device runs its oldest W now (the policy's fill and hold)."""
        done = self.next[d]
        pending = sum(done[B][c] - done[W][c] for c in range(self.problem.chunks))
        forwards_left = sum(self.problem.microbatches - done[F][c] for c in range(self.problem.chunks))
        backs_left = sum(self.problem.microbatches - done[B][c] for c in range(self.problem.chunks))
        if backs_left and forwards_left <= self.hold[d] and pending <= self.hold[d]:
            return False
        return (self.policy.fill == "always" or next_arrival == INFINITY
                or self.free[d] + self.problem.duration[weight[2]] <= next_arrival + TOLERANCE)

    def _arrival(self, node: int) -> float:
        """When `node`'s inputs have all arrived; INFINITY while one is not placed yet."""
        ready = 0.0
        for source, delay in self.problem.inputs[node]:
            end = self.end[source]
            if end < 0:
                return INFINITY
            if end + delay > ready:
                ready = end + delay
        return ready

    def _memory_allows(self, d: int, node: int, chunk: int) -> bool:
        """An F on the first chunk starts a microbatch on this device: it must leave room
        for that microbatch's later chunks and every started one's (no memory deadlock)."""
        cap = self.problem.cap + TOLERANCE
        size = self.problem.memory[node]
        if chunk == 0:
            return self.live[d] + size + self.reserved[d] + self.later[d] <= cap
        return self.live[d] + size <= cap

    def _warming_allows(self, d: int, node: int, ready: float) -> bool:
        """Before its first B, an F only where the policy's warm-up allows it (the first
        F always: a device that runs nothing never gets a B); after it, any F, or with
        `in_flight` one that keeps the microbatches in flight under the warm-up's depth."""
        done = self.next[d]
        if any(done[B]):
            return not self.policy.in_flight or sum(done[F]) - sum(done[B]) < self.depth[d]
        if self.policy.warmup == "memory" or not self.programs[d]:
            return True
        start = max(self.free[d], ready)
        if self.policy.warmup == "start":
            return start < self.first_back[d] - TOLERANCE
        return start + self.problem.duration[node] <= self.first_back[d] + TOLERANCE

    def _place(self, d: int, candidate, kind: int) -> int:
        """Run `candidate` on device d as early as it can start, and wake the devices that
        wait for its result."""
        _, ready, node, chunk = candidate
        problem = self.problem
        start = max(self.free[d], ready)
        self.end[node] = self.free[d] = start + problem.duration[node]
        self.idle_since[d] = self.free[d]
        self.programs[d].append(node)
        if kind == B and self.depth[d] == INFINITY:
            self.depth[d] = sum(self.next[d][F]) - sum(self.next[d][B])
        self.next[d][kind][chunk] += 1
        self.live[d] += problem.memory[node]
        if kind == F:
            if chunk == 0:
                self.reserved[d] += self.later[d]
            else:
                self.reserved[d] -= problem.memory[node]
        for other in self._consumers(node):
            if other == d:
                continue
            if self.blocked[other] or self.free[other] > self.idle_since[other]:
                self.blocked[other] = False   # it was waiting: decide again, knowing this arrival
                self.free[other] = self.idle_since[other]
                heapq.heappush(self.queue, (self.free[other], other))
        return 1

    def _consumers(self, node: int) -> list[int]:
        """The devices whose next action may wait for `node`'s result (F: the next stage's F,
        B: the previous stage's B)."""
        found = self.consumers.get(node)
        if found is None:
            problem = self.problem
            kind, stage, microbatch = problem.action(node)
            found = []
            if kind == F and stage + 1 < problem.model_stages:
                found.append(problem.device[problem.node(F, stage + 1, microbatch)])
            if kind == B and stage > 0:
                found.append(problem.device[problem.node(B, stage - 1, microbatch)])
            self.consumers[node] = found
        return found


def _first_back_arrival(problem: _Problem, device: int) -> float:
    """When the device's first B could start if no device were ever busy: microbatch 0's
    forward through every model stage, then its input gradient back down to the device's
    last chunk, with comm on every hop between devices."""
    total = problem.model_stages
    arrival = 0.0
    for stage in range(total):
        node = problem.node(F, stage, 0)
        arrival += sum(delay for _, delay in problem.inputs[node]) + problem.duration[node]
    for stage in range(total - 1, max(problem.stage_of[device]), -1):
        arrival += problem.duration[problem.node(B, stage, 0)]
        arrival += problem.inputs[problem.node(B, stage - 1, 0)][1][1]   # the hop down to stage - 1
    return arrival


def _held_for_drain(problem: _Problem, device: int) -> int:
    """W's device keeps back for its drain: in a parallelogram (every device as busy as
    the first, each starting F + comm after the one before) device d's last B comes
    d (F + B + 2 comm) before its end, time its held W's fill."""
    def mean(kind: int) -> float:
        return math.fsum(problem.duration[problem.node(kind, stage, 0)] for stage in problem.stage_of[device]) \
            / problem.chunks
    weight = mean(W)
    if weight <= 0:
        return 0
    return int(device * (mean(F) + mean(B) + 2 * problem.comm) / weight)


def _greedy_seeds(problem: _Problem, budget: _Budget) -> dict[str, list[list[int]]]:
    """The greedy scheduler's orders, one a policy that does not get stuck, the most
    useful policies first, as many as the budget allows (FREE_POLICIES at least)."""
    seeds = {}
    policies = [policy for policy in POLICIES if problem.chunks > 1 or policy.deep_first]
    for n, policy in enumerate(policies):
        if n >= FREE_POLICIES and not budget.take(GREEDY_COST * len(problem.duration)):
            break
        programs = _Greedy(problem, policy).run()
        if programs is not None and all(_fits(problem, program) for program in programs):
            seeds[policy.name] = programs
    return seeds


# ---- local search ----------------------------------------------------------------------


def _same_device_order_kept(problem: _Problem, program: Sequence[int], index: int) -> bool:
    """True if the node at `index` still follows its own F (for B) or B (for W) on this
    device and precedes its own B (for F) or W (for B)."""
    node = program[index]
    kind, stage, microbatch = problem.action(node)
    before = problem.node(kind - 1, stage, microbatch) if kind > F else None
    after = problem.node(kind + 1, stage, microbatch) if kind < W else None
    for j, other in enumerate(program):
        if other == before and j > index:
            return False
        if other == after and j < index:
            return False
    return True


def _better(found: tuple[float, float], score: tuple[float, float]) -> bool:
    """True if `found` is no worse than `score`: a shorter step time, or the same with no
    larger sum of spans (a move along a plateau is kept, which lets the search drift)."""
    if found[0] < score[0] - TOLERANCE:
        return True
    return found[0] <= score[0] + TOLERANCE and found[1] <= score[1] + TOLERANCE


def _local_search(problem: _Problem, programs: list[list[int]], score: tuple[float, float],
                  budget: _Budget, rng: random.Random) -> tuple[list[list[int]], tuple[float, float]]:
    """Simulated annealing over single moves: one action of one device's order (half the
    moves on the device with the longest span) goes up to 2 p v places away, if its own
    F-B-W order holds and the device stays under the cap. A move that does not lengthen the
    step time (then the sum of spans) is kept; a longer one with probability
    exp(-increase / temperature), the temperature falling from 3% of the step time to 0 as
    the budget runs out. Returns the best orders seen."""
    programs = [list(program) for program in programs]
    best, best_score = [list(program) for program in programs], score
    p = problem.stages
    reach = max(2, 2 * p * problem.chunks)
    spans = _spans(problem, programs)
    moves = max(1.0, budget.left / len(problem.duration))
    made = 0
    while budget.take(len(problem.duration)):
        made += 1
        temperature = 0.03 * best_score[0] * max(0.0, 1 - made / moves)
        critical = max(range(p), key=spans.__getitem__)
        d = critical if rng.random() < 0.5 else rng.randrange(p)
        program = programs[d]
        if len(program) < 2:
            continue
        source = rng.randrange(len(program))
        target = min(len(program) - 1, max(0, source + rng.choice((-1, 1)) * rng.randint(1, reach)))
        if target == source:
            continue
        node = program.pop(source)
        program.insert(target, node)
        if _same_device_order_kept(problem, program, target) and _fits(problem, program):
            moved = _spans(problem, programs)
            if moved is not None:
                found = (max(moved), math.fsum(moved))
                if _better(found, score) or (temperature > 0 and
                                             rng.random() < math.exp((score[0] - found[0]) / temperature)):
                    score, spans = found, moved
                    if _better(found, best_score):
                        best, best_score = [list(program) for program in programs], found
                    continue
        program.pop(target)
        program.insert(source, node)
    return best, best_score


# ---- the search ------------------------------------------------------------------------


def _checked_cap(memory_cap, stages: int, chunks: int, costs: Costs, placement: str) -> float:
    if isinstance(memory_cap, bool) or not isinstance(memory_cap, numbers.Real) or not math.isfinite(memory_cap):
        raise ConfigError(f"memory_cap={memory_cap!r}: a finite number of M_B units (one microbatch's "
                          f"activations on a device), e.g. memory_cap={stages} (1F1B's memory)")
    least = minimum_cap(stages, chunks, costs, placement)
    if memory_cap < least - TOLERANCE:
        raise ConfigError(f"memory_cap={memory_cap}: no order fits under it; a device holds at least one "
                          f"microbatch's activations on all its chunks at once, so the smallest feasible "
                          f"cap is {least:g} M_B; use memory_cap={least:g} or more")
    return float(memory_cap)


def _checked(stages, microbatches, costs, memory_cap, chunks, placement, time_limit, seed) -> float:
    """Refuse bad input (ConfigError naming the value and a fix); return the cap as a float."""
    check_sizes(stages, microbatches, chunks)
    errors.one_of("placement", placement, PLACEMENTS)
    if placement == "v" and chunks != 2:
        raise ConfigError(f"placement 'v' has 2 chunks per device (down the devices and back up), not "
                          f"chunks={chunks}; use chunks=2")
    if not isinstance(costs, Costs):
        raise ConfigError(f"costs is a {type(costs).__name__}, not a Costs: Costs(F=1.0, B=1.0, W=1.0) or "
                          f"Costs.parse('F=18.522,B=18.086,W=9.337,comm=0.601')")
    costs.check_stages(stages * chunks)
    errors.number("time_limit", time_limit, fix="give seconds, e.g. time_limit=1.0")
    if time_limit > MAX_TIME_LIMIT:
        raise ConfigError(f"time_limit={time_limit}: at most {MAX_TIME_LIMIT:g} seconds; use time_limit=1.0")
    errors.whole("seed", seed, minimum=0)
    return _checked_cap(memory_cap, stages, chunks, costs, placement)


def search(stages: int, microbatches: int, costs: Costs, memory_cap: float, *, chunks: int = 1,
           placement: str = "loop", time_limit: float = 1.0, seed: int = 0) -> Searched:
    """The device orders with the smallest step time found for p = `stages` devices, m =
    `microbatches`, v = `chunks` per device placed by `placement` ("loop" or "v"), the
    backward split into B and W, timed with `costs`, every device's live activations at
    most `memory_cap` M_B (p = 1F1B's memory) at every moment.

    Returns a validated `Searched` schedule (a `Schedule`: its table runs the found orders)
    with `.timing` under `costs`, `.memory_cap`, `.search_seconds` and `.method`.
    ConfigError for bad sizes, placement, costs or time_limit, and for a cap under the
    smallest any order needs (the message names it, `minimum_cap`)."""
    cap = _checked(stages, microbatches, costs, memory_cap, chunks, placement, time_limit, seed)
    began = time.perf_counter()
    problem = _problem(stages, microbatches, chunks, placement, costs, cap)
    budget = _Budget(time_limit)
    candidates = {**_published_seeds(problem), **_greedy_seeds(problem, budget)}
    block = _repeated_block(problem)
    if block is not None and all(_fits(problem, program) for program in block):
        candidates["repeated block"] = block
    scored = {name: _evaluate(problem, programs) for name, programs in candidates.items()}
    scored = {name: score for name, score in scored.items() if score is not None}   # "one at a time" always fits
    method = min(scored, key=lambda name: (scored[name], name))
    programs, score = candidates[method], scored[method]
    improved, better = _local_search(problem, programs, score, budget, random.Random(seed))
    if better < score:
        programs, score, method = improved, better, f"{method}+local"
    return _searched(problem, programs, costs, method, time.perf_counter() - began)


def _searched(problem: _Problem, programs: list[list[int]], costs: Costs, method: str, seconds: float) -> Searched:
    """The table of `programs` (timed with unit costs, which keeps each device's order) with
    what the search knew, validated: dependencies, no deadlock, memory under the cap."""
    actions = []
    for d, program in enumerate(programs):
        chunk_of = {stage: c for c, stage in enumerate(problem.stage_of[d])}
        row = []
        for node in program:
            kind, stage, microbatch = problem.action(node)
            row.append(Action(KINDS[kind], microbatch, chunk_of[stage]))
        actions.append(row)
    table = simulate("searched", problem.stages, problem.microbatches, problem.chunks, UNIT_COSTS, True, actions,
                     problem.placement).validate()
    found = Searched(**{field.name: getattr(table, field.name) for field in dataclasses.fields(Schedule)},
                     memory_cap=problem.cap, search_seconds=seconds, method=method)
    found = dataclasses.replace(found, timing=timed(found, costs))
    validate_memory(found, costs, problem.cap)
    return found


def validate_memory(schedule: Schedule, costs: Costs, cap: float) -> Schedule:
    """Raise ScheduleError unless every device's live activation memory (timed with
    `costs`, M_B units, `timing.Timing.peak_memory`) stays at most `cap`; return
    `schedule`. Locates the first action that goes over."""
    size_of = {}
    for d in range(schedule.stages):
        live = 0.0
        for tick, action in schedule.program(d):
            stage = schedule.stage_of(d, action.chunk)
            size = size_of.setdefault(stage, costs.of("activation", stage) if isinstance(costs.activation, tuple)
                                      else costs.activation / schedule.chunks)
            kept = costs.weight_memory * size if schedule.split_backward else 0.0
            live += {"F": size, "B": -(size - kept), "W": -kept}[action.kind]
            if live > cap + TOLERANCE:
                raise ScheduleError(f"tick {tick}, device {d}: {action} brings the live activations to "
                                    f"{live:.4g} M_B, over the cap {cap:g}", schedule, tick, d)
    return schedule
