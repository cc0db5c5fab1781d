"""Schedules searched under a memory cap (schedules/search.py): the V-shape orders (ZB-V;
Qi et al. 2024's V-Half and V-Min), uneven stages, random problems, the validator, the
cap and timing.timed, and the proven optimum of small problems from an integer program
written here from the schedules' definitions. Table 5's searched columns (ZB-1p, ZB-2p)
on all 12 rows: tests/schedules/test_published.py. How long a search takes is a
benchmark's figure (`python -m benchmarks.schedule_search`), not a test's."""

from __future__ import annotations

import random

import pytest

from jaxpar.errors import ConfigError
from jaxpar.schedules import published, schedule, search
from jaxpar.schedules.schedule import Schedule, ScheduleError
from jaxpar.schedules.timing import Costs, timed

UNIT = Costs(F=1.0, B=1.0, W=1.0, weight_memory=0.0)   # activations freed at B: the schedules' peak_activations


def _checked(found: search.Searched, costs: Costs, cap: float) -> search.Searched:
    """What every searched schedule must be: valid, under the cap, timed as timed() times it."""
    assert isinstance(found, Schedule) and found.split_backward
    found.validate()
    search.validate_memory(found, costs, cap)
    again = timed(found, costs)
    assert found.timing.bubble == again.bubble and found.timing.cost == again.cost
    assert max(found.timing.peak_memory) <= cap + 1e-9
    assert found.memory_cap == cap and found.search_seconds > 0 and found.method
    return found


# ---- the V placement -------------------------------------------------------------------------

ZB_V_ROWS = [("6.2B", 16, 48), ("28.3B", 32, 96)]
ZB_V_CLOSENESS = {"6.2B": 0.023, "28.3B": 0.004}   # how near Table 6's times time Table 8's other columns


@pytest.mark.parametrize("model,p,m", ZB_V_ROWS, ids=[f"{row[0]}-p{row[1]}-m{row[2]}" for row in ZB_V_ROWS])
def test_v_at_1f1b_memory_no_worse_than_zb_v(model, p, m):
    """The V placement at 1F1B's memory against the arXiv version's Table 8 (ZB-V), timed
    with the same model's Table 6 times (the paper does not print the ZB-V settings' own),
    halved per chunk: no worse than ZB-V's order (DualPipe-V's) nor the paper's ZB-V rate,
    and under a quarter of 1F1B's. The stand-in times are checked first: they time
    1F1B, ZB-H1 and ZB-H2 near Table 8's columns."""
    paper = published.ZB_V_BUBBLES[model, p, m]
    whole = published.zb_v_proxy_costs(model, p, m)
    half = published.zb_v_proxy_costs(model, p, m, chunks=2)
    for name, published_rate in (("1f1b", paper.one_f_one_b), ("zb-h1", paper.zb_h1), ("zb-h2", paper.zb_h2)):
        assert timed(schedule.make(name, p, m), whole).bubble == pytest.approx(published_rate,
                                                                             abs=ZB_V_CLOSENESS[model])
    found = _checked(search.search(p, m, half, p, chunks=2, placement="v"), half, p)
    assert found.placement == "v" and found.stage_of(0, 1) == 2 * p - 1
    zb_v = timed(schedule.make("dualpipe-v", p, m), half).bubble
    one_f_one_b = timed(schedule.make("1f1b", p, m), whole).bubble
    assert found.timing.bubble <= zb_v + 1e-12
    assert round(found.timing.bubble, 4) <= paper.zb_v and found.timing.bubble < one_f_one_b / 4


def test_zb_v_stand_in_times_cover_table_8():
    assert set(published.ZB_V_PROXY) == set(published.ZB_V_BUBBLES)
    assert published.zb_v_proxy_costs("28.3B", 32, 96, chunks=2).F == published.PROFILED["28.3B", 96].F / 2
    with pytest.raises(ConfigError, match="Table 8's settings are"):
        published.zb_v_proxy_costs("14.6B", 16, 48)


@pytest.mark.parametrize("p,m", [(4, 16), (4, 32), (8, 32)])
def test_controllable_memory_v_half_and_v_min(p, m):
    """Qi et al. 2024 with F = B = W: at peak activations of (p+2)//2 microbatches (V-Half)
    the bubble is about p/(2m), at (p+4)//3 (V-Min) about 2p/(3m); the search does no worse
    than either (tolerance 0), and better than 1F1B's (p-1)/(m+p-1) at p M_B."""
    for cap, bound in (((p + 2) // 2, p / (2 * m)), ((p + 4) // 3, 2 * p / (3 * m))):
        found = _checked(search.search(p, m, UNIT, cap, chunks=2, placement="v"), UNIT, cap)
        assert found.timing.bubble <= bound, (cap, found.method)
        assert max(found.peak_activations) <= 2 * cap   # microbatch-chunks, half a stage each
    assert _checked(search.search(p, m, UNIT, p, chunks=2, placement="v"), UNIT, p).timing.bubble \
        < (p - 1) / (m + p - 1)


# ---- uneven stages, small and random problems ----------------------------------------------

def test_uneven_stages_per_stage_costs():
    """Per-stage tuples (the middle stages twice as long): valid, under the cap, and no
    worse than ZB-H1's order at 1F1B's memory."""
    costs = Costs(F=(1.0, 2.0, 2.0, 1.0), B=(2.0, 4.0, 4.0, 2.0), W=(1.0, 2.0, 2.0, 1.0), comm=0.1)
    found = _checked(search.search(4, 8, costs, 4), costs, 4)
    assert found.timing.bubble <= timed(schedule.make("zb-h1", 4, 8), costs).bubble + 1e-12
    assert max(found.timing.busy) == pytest.approx(8 * 8.0)


def test_random_small_problems_are_valid_and_under_the_cap():
    """Random sizes, placements, per-stage costs and caps from the smallest feasible one
    up: every searched schedule validates and stays under its cap."""
    rng = random.Random(0)
    for _ in range(12):
        p, m = rng.randint(1, 4), rng.randint(1, 6)
        chunks, placement = rng.choice([(1, "loop"), (2, "loop"), (2, "v")])
        total = p * chunks
        costs = Costs(F=tuple(rng.uniform(0.5, 2) for _ in range(total)),
                      B=tuple(rng.uniform(0.5, 3) for _ in range(total)),
                      W=tuple(rng.uniform(0, 1.5) for _ in range(total)),
                      comm=rng.uniform(0, 0.5), weight_memory=rng.random())
        cap = search.minimum_cap(p, chunks, costs, placement) * rng.uniform(1, 3)
        _checked(search.search(p, m, costs, cap, chunks=chunks, placement=placement, time_limit=0.05), costs, cap)


def test_deterministic_given_seed():
    costs = published.profiled_costs("1.5B", 24)
    first, second = (search.search(8, 24, costs, 12, seed=3) for _ in range(2))
    assert first.actions == second.actions and first.method == second.method


def test_searched_is_a_schedule_the_runtime_runs_in_its_order():
    """The table keeps each device's searched order (unit ticks); to_dict reports the search."""
    costs = published.profiled_costs("1.5B", 24)
    found = search.search(4, 8, costs, 4)
    again = schedule.simulate("again", 4, 8, 1, {"F": 1, "B": 1, "W": 1}, True,
                              [[a for _, a in found.program(d)] for d in range(4)])
    assert again.actions == found.actions
    report = found.to_dict()["search"]
    assert report["memory_cap"] == 4 and report["bubble"] == found.timing.bubble


# ---- an independent oracle: the exact optimum of a mixed-integer program ----------------------

def _problem(p: int, m: int, v: int, placement: str, costs: Costs) -> dict:
    """The actions of one step from the schedules' definitions, written here without
    jaxpar's search tables: action (kind, model stage, microbatch); model stage s on
    device s mod p (loop: Megatron's interleaving), or s for s < p and 2p - 1 - s after
    (the V); F(s, i) waits for F(s-1, i), B(s, i) for F(s, i) and B(s+1, i), W(s, i) for
    B(s, i), each input that crosses devices `comm` later; memory by Qi et al.'s Table 1,
    in M_B of a whole device's share of the model (a chunk holds 1/chunks of it): F adds
    M_B, B adds M_W - M_B, W frees M_W, with M_W = weight_memory * M_B."""
    stages = p * v
    device = (lambda s: s % p) if placement == "loop" else (lambda s: s if s < p else 2 * p - 1 - s)
    per = lambda value, s: value[s] if isinstance(value, tuple) else value
    actions = [(kind, s, i) for kind in "FBW" for s in range(stages) for i in range(m)]
    m_b = 1.0 / v
    m_w = costs.weight_memory * m_b
    inputs = {}
    for kind, s, i in actions:
        needs = {"F": [("F", s - 1)] if s else [], "B": [("F", s)] + ([("B", s + 1)] if s < stages - 1 else []),
                 "W": [("B", s)]}[kind]
        inputs[kind, s, i] = [((k, t, i), costs.comm if device(t) != device(s) else 0.0) for k, t in needs]
    return {"actions": actions, "device": {a: device(a[1]) for a in actions},
            "duration": {a: per(getattr(costs, a[0]), a[1]) for a in actions},
            "memory": {a: {"F": m_b, "B": m_w - m_b, "W": -m_w}[a[0]] for a in actions}, "inputs": inputs,
            "stages_of": {d: sorted(s for s in range(stages) if device(s) == d) for d in range(p)}, "m": m}


def _implied(a, b) -> bool:
    """Whether a runs before b on their device in every order that keeps each kind's
    microbatches in order (Qi et al.'s graph): by a dependency chain, or by that order."""
    (ka, sa, ia), (kb, sb, ib) = a, b
    rank = "FBW".index
    if sa == sb:
        return (ka == kb and ia < ib) or (rank(ka) <= rank(kb) and ia <= ib and a != b)
    return ia == ib and ka == kb and (sa < sb if ka == "F" else sa > sb and ka == "B")


def _optimal_cost(problem: dict, cap: float) -> float:
    """Qi et al.'s integer program (section 3.2), solved by HiGHS (scipy.optimize.milp): end
    time E[x] of every action, a binary for the order of every pair of actions on a device
    whose order is not implied, the live memory at every F's start under the cap; minimise
    the longest device span (first start to last end)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    actions, duration, memory = problem["actions"], problem["duration"], problem["memory"]
    column = {a: n for n, a in enumerate(actions)}
    devices = [[a for a in actions if problem["device"][a] == d] for d in sorted(problem["stages_of"])]
    free_pairs = [(a, b) for nodes in devices for i, a in enumerate(nodes) for b in nodes[i + 1:]
                  if not _implied(a, b) and not _implied(b, a)]
    span = len(actions)
    order = {pair: span + 1 + k for k, pair in enumerate(free_pairs)}     # 1: the pair's first runs first
    big = 2 * sum(duration.values()) + 10
    rows: list[tuple[dict, float, float]] = []
    for x in actions:
        rows += [({column[x]: 1, column[y]: -1}, delay + duration[x], np.inf) for y, delay in problem["inputs"][x]]
    for nodes in devices:
        rows += [({column[b]: 1, column[a]: -1}, duration[b], np.inf) for a in nodes for b in nodes
                 if a != b and _implied(a, b)]
    for (a, b), var in order.items():
        rows += [({column[b]: 1, column[a]: -1, var: -big}, duration[b] - big, np.inf),
                 ({column[a]: 1, column[b]: -1, var: big}, duration[a], np.inf)]
    for nodes in devices:
        for f in (x for x in nodes if x[0] == "F"):
            coefficients, live = {}, memory[f]
            for x in (x for x in nodes if x != f and not _implied(f, x)):
                if _implied(x, f):
                    live += memory[x]
                elif (x, f) in order:
                    coefficients[order[x, f]] = memory[x]
                else:
                    live += memory[x]
                    coefficients[order[f, x]] = -memory[x]
            rows.append((coefficients, -np.inf, cap + 1e-9 - live))
        held = problem["stages_of"][problem["device"][nodes[0]]]
        first = ("F", held[0], 0)
        for s in held:
            rows.append(({span: 1, column["W", s, problem["m"] - 1]: -1, column[first]: 1}, duration[first], np.inf))
    matrix = lil_matrix((len(rows), span + 1 + len(order)))
    for r, (coefficients, _, _) in enumerate(rows):
        for c, value in coefficients.items():
            matrix[r, c] = value
    objective = np.zeros(matrix.shape[1])
    objective[span] = 1
    integrality = np.r_[np.zeros(span + 1), np.ones(len(order))]
    upper = np.r_[np.full(span + 1, np.inf), np.ones(len(order))]
    result = milp(objective, constraints=LinearConstraint(matrix.tocsr(), [r[1] for r in rows], [r[2] for r in rows]),
                  integrality=integrality, bounds=Bounds(np.zeros(matrix.shape[1]), upper))
    assert result.status == 0, result.message
    return result.fun


SMALL = [(2, 3, 1, "loop", 1.0), (2, 3, 1, "loop", 2.0), (2, 4, 1, "loop", 4.0), (3, 3, 1, "loop", 1.5),
         (3, 4, 1, "loop", 2.0), (3, 4, 1, "loop", 3.0), (2, 2, 2, "loop", 1.5), (2, 2, 2, "v", 1.0)]


@pytest.mark.parametrize("p,m,chunks,placement,cap", SMALL)
def test_small_problems_reach_the_proven_optimum(p, m, chunks, placement, cap):
    """Where HiGHS proves the optimum within a second (p m v <= 12), the search finds it:
    its step time equals the integer program's (over orders that keep each kind's
    microbatches in order; the search is not held to that, so it could only do better)."""
    costs = Costs(F=(1.0, 2.0, 1.5, 1.0)[:p * chunks], B=(2.0, 3.0, 2.5, 2.0)[:p * chunks],
                  W=(0.5, 1.0, 1.0, 0.5)[:p * chunks], comm=0.1, weight_memory=0.5)
    found = _checked(search.search(p, m, costs, cap, chunks=chunks, placement=placement), costs, cap)
    assert found.timing.cost == pytest.approx(_optimal_cost(_problem(p, m, chunks, placement, costs), cap), abs=1e-6)


# ---- refusals -----------------------------------------------------------------------------------

def test_impossible_cap_names_the_smallest_feasible_one():
    costs = Costs(F=1.0, B=1.0, W=1.0)
    with pytest.raises(ConfigError, match="smallest feasible cap is 1 M_B; use memory_cap=1 or more"):
        search.search(4, 8, costs, 0.5)
    with pytest.raises(ConfigError, match="smallest feasible cap is 0.75"):
        search.search(4, 8, Costs(F=1.0, B=1.0, activation=(0.5, 0.75, 0.5, 0.25)), 0.6)
    assert search.minimum_cap(4, 2, costs, "v") == 1.0
    found = _checked(search.search(4, 8, costs, 1.0, chunks=2, placement="v"), costs, 1.0)
    assert max(found.timing.peak_memory) == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs,message", [
    ({"stages": 0}, "stages=0"),
    ({"microbatches": 2.0}, "microbatches=2.0"),
    ({"placement": "w"}, "placement='w'"),
    ({"chunks": 3, "placement": "v"}, "placement 'v' has 2 chunks"),
    ({"costs": {"F": 1}}, "not a Costs"),
    ({"costs": Costs(F=(1.0, 2.0), B=1.0)}, "F has 2 values"),
    ({"memory_cap": float("inf")}, "memory_cap=inf"),
    ({"time_limit": -1}, "time_limit=-1"),
    ({"seed": 1.5}, "seed=1.5"),
])
def test_bad_input_is_refused(kwargs, message):
    arguments = {"stages": 4, "microbatches": 8, "costs": Costs(F=1.0, B=1.0, W=1.0), "memory_cap": 4, **kwargs}
    with pytest.raises(ConfigError, match=message):
        search.search(**arguments)


def test_validate_memory_locates_the_action_over_the_cap():
    """ZB-H2 keeps up to 2p-1 microbatches on the first device: over 1F1B's memory."""
    costs = Costs(F=1.0, B=1.0, W=1.0)
    zb_h2 = schedule.make("zb-h2", 4, 8)
    with pytest.raises(ScheduleError, match=r"device 0: F4 brings the live activations to .* over the cap 4"):
        search.validate_memory(zb_h2, costs, 4)
    assert search.validate_memory(zb_h2, costs, 7) is zb_h2
