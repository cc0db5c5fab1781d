"""The schedule search's local search (`search.py`): simulated annealing over moves of one
action of one device's order, scored by the longest device span, then the sum of spans.

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from jaxpar.schedules.search_problem import F, TOLERANCE, W, Budget, Problem, device_spans, fits


def _same_device_order_kept(problem: Problem, program: Sequence[int], index: int) -> bool:
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


def anneal(problem: Problem, programs: list[list[int]], score: tuple[float, float],
                  budget: Budget, rng: random.Random) -> tuple[list[list[int]], tuple[float, float]]:
    """Simulated annealing over single moves: one action of one device's order (half the
    moves on the device with the longest span) goes up to 2 p chunks places away, if its own
    F-B-W order holds and the device stays under the cap. A move that does not lengthen the
    step time (then the sum of spans) is kept; a longer one with probability
    exp(-increase / temperature), the temperature falling from 3% of the step time to 0 as
    the budget runs out. Returns the best orders seen."""
    programs = [list(program) for program in programs]
    best, best_score = [list(program) for program in programs], score
    p = problem.stages
    reach = max(2, 2 * p * problem.chunks)
    spans = device_spans(problem, programs)
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
        if _same_device_order_kept(problem, program, target) and fits(problem, program):
            moved = device_spans(problem, programs)
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
