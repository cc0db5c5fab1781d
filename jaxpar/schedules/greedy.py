"""The schedule search's greedy list scheduler (`search.py`), after Qi et al. 2023's
heuristic ("Zero Bubble Pipeline Parallelism", section 3.1): the device free first decides
next; it takes a B whose input has arrived, else an F if memory allows (keeping room for
the later chunks of the microbatches it started) and its warm-up wants it, else a W that
fills the gap, holding some W's back for the drain. `Policy` says how it breaks each
choice; `greedy_seeds` runs the policies the budget allows.

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from jaxpar.schedules.search_problem import B, F, TOLERANCE, W, Budget, Problem, fits


@dataclasses.dataclass(frozen=True)
class Policy:
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


# The most useful first: the search runs the first FREE_POLICIES of those that apply (the
# oldest-first ones only with chunks), then as many as its budget allows. The warm-up kept
# in flight first: alone it gives Qi et al.'s ZB-2p to four decimals on 11 of Table 5's 12
# rows (28.3B m = 256 among them; 1.5B m = 24: 0.0446 against 0.0433).
IN_FLIGHT = tuple(Policy(deep_first=True, fill="always", warmup=warmup, in_flight=True) for warmup in ("end", "start"))
OTHERS = tuple(Policy(deep, fill, patient, warmup, hold)
               for patient in (False, True) for hold in (False, True)
               for warmup in ("end", "start", "memory") for fill in ("always", "fit") for deep in (True, False))
POLICIES = IN_FLIGHT + OTHERS
# A greedy run costs about this many evaluations of an order of the same size.
GREEDY_COST = 20
FREE_POLICIES = 4
INFINITY = math.inf


class Greedy:
    """The list scheduler: the device free earliest decides next (module docstring)."""

    def __init__(self, problem: Problem, policy: Policy):
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


def _first_back_arrival(problem: Problem, device: int) -> float:
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


def _held_for_drain(problem: Problem, device: int) -> int:
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


def greedy_seeds(problem: Problem, budget: Budget) -> dict[str, list[list[int]]]:
    """The greedy scheduler's orders, one a policy that does not get stuck, the most
    useful policies first, as many as the budget allows (FREE_POLICIES at least)."""
    seeds = {}
    policies = [policy for policy in POLICIES if problem.chunks > 1 or policy.deep_first]
    for n, policy in enumerate(policies):
        if n >= FREE_POLICIES and not budget.take(GREEDY_COST * len(problem.duration)):
            break
        programs = Greedy(problem, policy).run()
        if programs is not None and all(fits(problem, program) for program in programs):
            seeds[policy.name] = programs
    return seeds
