"""Pipeline schedules searched under a memory cap (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241, section 3; Qi et al. 2024, "Pipeline Parallelism with
Controllable Memory", arXiv 2405.15362).

Given measured costs (`timing.Costs`: F, B, W per model stage, the latency `comm` of a
send, the memory an F leaves and the part B keeps for W) and a cap on each device's live
activation memory (M_B units: p is 1F1B's memory), `search` finds device orders, the
backward split into B and W, with a small bubble:

  seeds     (`seeds.py`) the published orders that fit the cap (1F1B with W after B,
            ZB-H1, ZB-H2, DualPipe-V / ZB-V) and one microbatch's block repeated at a
            fixed interval (the order of least memory: Qi et al. 2024's V-Min at chunks = 2);
  greedy    (`greedy.py`) a list scheduler after Qi et al.'s heuristic, under several
            policies: the device free first takes a B whose input has arrived, else an F
            if memory allows and its warm-up wants it, else a W that fills the gap,
            holding some W's back for the drain; two policies keep the warm-up's
            microbatches in flight through the steady state (Qi et al.'s ZB-2p at large
            m, where the first device's wait for its first B is the whole bubble);
  local     (`annealing.py`) simulated annealing from the best of them: one action of
            one device's order moves at a time (half the moves on the device that sets
            the step time), under the cap; the best orders seen are returned.

The problem's flat tables and the timing the search scores orders by are in
`search_problem.py`.

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
import math
import numbers
import random
import time

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.schedules.annealing import anneal
from jaxpar.schedules.greedy import greedy_seeds
from jaxpar.schedules.orders import Action
from jaxpar.schedules.schedule import PLACEMENTS, Schedule, ScheduleError, check_sizes, simulate
from jaxpar.schedules.search_problem import KINDS, TOLERANCE, UNIT_COSTS, Budget, Problem, evaluate, fits, make_problem
from jaxpar.schedules.seeds import published_seeds, repeated_block
from jaxpar.schedules.timing import Costs, Timing, timed

__all__ = ["Searched", "search", "minimum_cap", "validate_memory"]

MAX_TIME_LIMIT = 3600.0


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


def minimum_cap(stages: int, chunks: int, costs: Costs, placement: str = "loop") -> float:
    """The smallest memory cap any order fits in (M_B units): a microbatch's forward reaches
    every chunk of a device before its backward frees the first, so each device holds at
    least one microbatch's activations on all its chunks at once."""
    shape = Schedule("search", stages, 1, chunks, UNIT_COSTS, True, (), placement)

    def size(stage: int) -> float:
        return costs.of("activation", stage) if isinstance(costs.activation, tuple) else costs.activation / chunks

    return max(math.fsum(size(shape.stage_of(d, c)) for c in range(chunks)) for d in range(stages))


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
    problem = make_problem(stages, microbatches, chunks, placement, costs, cap)
    budget = Budget(time_limit)
    candidates = {**published_seeds(problem), **greedy_seeds(problem, budget)}
    block = repeated_block(problem)
    if block is not None and all(fits(problem, program) for program in block):
        candidates["repeated block"] = block
    scored = {name: evaluate(problem, programs) for name, programs in candidates.items()}
    scored = {name: score for name, score in scored.items() if score is not None}   # "one at a time" always fits
    method = min(scored, key=lambda name: (scored[name], name))
    programs, score = candidates[method], scored[method]
    improved, better = anneal(problem, programs, score, budget, random.Random(seed))
    if better < score:
        programs, score, method = improved, better, f"{method}+local"
    return _searched(problem, programs, costs, method, time.perf_counter() - began)


def _searched(problem: Problem, programs: list[list[int]], costs: Costs, method: str, seconds: float) -> Searched:
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
