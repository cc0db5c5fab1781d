"""The schedule search's fixed seeds (`search.py`): the published orders that fit the cap
(1F1B with W after B, ZB-H1, ZB-H2, DualPipe-V / ZB-V, one microbatch at a time) and one
microbatch's block repeated at a fixed interval (modulo scheduling: the order of least
memory, Qi et al. 2024's V-Min at chunks = 2). The greedy list scheduler's seeds are in
`greedy.py`.

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

from jaxpar.schedules import orders
from jaxpar.schedules.orders import Action
from jaxpar.schedules.search_problem import B, F, KINDS, TOLERANCE, Problem, fits


# ---- seeds: the published orders --------------------------------------------------


def published_seeds(problem: Problem) -> dict[str, list[list[int]]]:
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
        if all(fits(problem, program) for program in programs):
            seeds[name] = programs
    return seeds


def _one_at_a_time(problem: Problem) -> list[list[Action]]:
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


# ---- seeds: one microbatch's block, repeated (modulo scheduling) -----------------------


def repeated_block(problem: Problem) -> list[list[int]] | None:
    """Every microbatch runs the same block of actions, the next one `interval` later
    (Qi et al. 2024's building blocks; modulo scheduling): one microbatch's actions are
    placed in dependency order, each as early as its inputs allow where its device is
    free at that time modulo the interval, the F's and B's first, then each W at the first
    room after its B. The interval starts at the busiest device's work for one microbatch and grows until the
    block fits. Each microbatch's activations live only as long as its block, so this
    is the order of least memory (V-Min's, at chunks = 2); None if no interval up to twice the
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


def _place_block(problem: Problem, order: list[int], interval: float) -> dict[int, float] | None:
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
