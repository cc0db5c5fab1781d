"""Schedules searched under a memory cap (pipeline/search.py), held against Qi et al.'s
published bubble rates (pipeline/published.py, Table 5: ZB-1p at p M_B, ZB-2p at 2p M_B),
the V-shape orders (ZB-V; Qi et al. 2024's V-Half and V-Min), the validator, the cap and
timing.timed.

Table 5's p = 8 and p = 16 rows are searched here with the default time limit (about half
a second each); the p = 32 rows take 1-3 s each, so `benchmarks/schedule_search.py` runs
the whole table."""

from __future__ import annotations

import random
import time

import pytest

from jaxpar.errors import ConfigError
from jaxpar.pipeline import published, schedule, search
from jaxpar.pipeline.schedule import Schedule, ScheduleError
from jaxpar.pipeline.timing import Costs, timed

ROWS = [row for row in sorted(published.BUBBLES) if published.MODELS[row[0]].stages <= 8] + [("14.6B", 48)]
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


# ---- Qi et al. 2023, Table 5 ------------------------------------------------------------------

@pytest.mark.parametrize("model,microbatches", ROWS, ids=[f"{m}-m{n}" for m, n in ROWS])
def test_table5_no_worse_than_zb_1p_and_zb_2p(model, microbatches):
    """At 1F1B's memory (p M_B) the searched bubble is no worse than the paper's ZB-1p, at
    2p M_B no worse than ZB-2p (both to the four decimals the paper prints), with Table 6's
    times and Table 1's M_W / M_B."""
    costs = published.profiled_costs(model, microbatches)
    p = published.MODELS[model].stages
    paper = published.BUBBLES[model, microbatches]
    for cap, published_rate in ((p, paper.zb_1p), (2 * p, paper.zb_2p)):
        found = _checked(search.search(p, microbatches, costs, cap), costs, cap)
        assert round(found.timing.bubble, 4) <= published_rate, (cap, found.method)


def test_table5_zb_2p_on_the_first_row():
    """1.5B, p = 8, m = 24: the paper's ZB-1p and ZB-2p are 0.1585 and 0.0433; 1F1B's 0.2431."""
    costs = published.profiled_costs("1.5B", 24)
    assert round(search.search(8, 24, costs, 8).timing.bubble, 4) == 0.1585
    assert round(search.search(8, 24, costs, 16).timing.bubble, 4) == 0.0433


# ---- the V placement -------------------------------------------------------------------------

def test_v_at_1f1b_memory_no_worse_than_zb_v():
    """ZB-V (DualPipe-V's order) at 1F1B's memory, 6.2B's Table 6 times halved per chunk
    (a chunk is half a stage), p = 16, m = 48: no worse than ZB-V's order, about a fifth
    of 1F1B's bubble (the paper's row for this setting: 0.0697 against 1F1B's 0.2668,
    with times profiled at p = 16 that the paper does not print)."""
    t = published.PROFILED["6.2B", 24]
    half = Costs(F=t.F / 2, B=t.B / 2, W=t.W / 2, comm=t.comm, weight_memory=published.weight_memory("6.2B"))
    whole = Costs(F=t.F, B=t.B, W=t.W, comm=t.comm, weight_memory=published.weight_memory("6.2B"))
    found = _checked(search.search(16, 48, half, 16, chunks=2, placement="v"), half, 16)
    assert found.placement == "v" and found.stage_of(0, 1) == 31
    zb_v = timed(schedule.make("dualpipe-v", 16, 48), half).bubble
    one_f_one_b = timed(schedule.make("1f1b", 16, 48), whole).bubble
    assert found.timing.bubble <= zb_v + 1e-12
    assert found.timing.bubble < 0.0697 and found.timing.bubble < one_f_one_b / 4


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


def test_search_time_p8_m32_under_a_second():
    """p = 8, m = 32 with the default time limit: about a third of a second here; the
    bound is generous for a shared machine."""
    costs = published.profiled_costs("1.5B", 32)
    began = time.perf_counter()
    found = search.search(8, 32, costs, 16)
    assert time.perf_counter() - began < 3.0 and found.search_seconds < 3.0


def test_searched_is_a_schedule_the_runtime_runs_in_its_order():
    """The table keeps each device's searched order (unit ticks); to_dict reports the search."""
    costs = published.profiled_costs("1.5B", 24)
    found = search.search(4, 8, costs, 4)
    again = schedule.simulate("again", 4, 8, 1, {"F": 1, "B": 1, "W": 1}, True,
                              [[a for _, a in found.program(d)] for d in range(4)])
    assert again.actions == found.actions
    report = found.to_dict()["search"]
    assert report["memory_cap"] == 4 and report["bubble"] == found.timing.bubble


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
