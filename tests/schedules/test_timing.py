"""Schedules timed with float costs and communication (schedules/timing.py), held against
Qi et al.'s published bubble rates (schedules/published.py), their memory formulas, the
closed forms (pipeline/formulas.py) and hand-timed small cases."""

from __future__ import annotations

import math
import random

import pytest

from jaxpar.errors import ConfigError
from jaxpar.pipeline import formulas
from jaxpar.schedules import published, schedule
from jaxpar.schedules.timing import Costs, timed, weight_memory_fraction

# ---- Qi et al. 2023, Table 5 (every column on every row: tests/schedules/test_published.py) ---------

def test_table5_zb_h2_needs_the_papers_cost_not_the_makespan():
    """The paper's cost is the longest device span (post-validated optimizer: each device
    starts its next step as soon as it is done). One step on its own is longer for ZB-H2
    when 2W > B + comm, where the last stage, starting (p-1)(F+comm) late, ends last."""
    t = timed(schedule.make("zb-h2", 8, 24), published.profiled_costs("6.2B", 24))
    assert round(t.bubble, 4) == 0.0698
    assert round(t.makespan_bubble, 4) == 0.1003
    assert t.cost == max(t.spans) < t.makespan


def test_published_data_is_whole():
    assert set(published.PROFILED) == set(published.BUBBLES)
    for (model, m), rates in published.BUBBLES.items():
        assert published.MODELS[model].stages in (8, 16, 32) and m % published.MODELS[model].stages == 0
        assert all(0 < r < 1 for r in rates)
    with pytest.raises(ConfigError, match="microbatches 24, 32, 64 only"):
        published.profiled_costs("1.5B", 48)
    with pytest.raises(ConfigError, match="Table 3's models"):
        published.profiled_costs("7B", 24)


# ---- memory: Qi et al.'s Table 2 -----------------------------------------------------------

@pytest.mark.parametrize("weight_memory", [0.0, 0.25, 32 / 34])
def test_peak_memory_matches_qi_table2(weight_memory):
    """Worker d (from 0) holds (p-d) M_B + d M_W under ZB-H1 and (2p-2d-1) M_B + 2d M_W under
    ZB-H2; 1F1B p-d M_B; the V (two half-stage chunks) p M_B on every device."""
    p, m = 4, 8
    costs = Costs(1.0, 1.0, 1.0, weight_memory=weight_memory)
    peaks = {name: timed(schedule.make(name, p, m), costs).peak_memory
             for name in ("1f1b", "zb-h1", "zb-h2", "dualpipe-v")}
    assert peaks["1f1b"] == [p - d for d in range(p)]
    assert peaks["zb-h1"] == pytest.approx([(p - d) + d * weight_memory for d in range(p)])
    assert peaks["zb-h2"] == pytest.approx([(2 * p - 2 * d - 1) + 2 * d * weight_memory for d in range(p)])
    assert peaks["dualpipe-v"] == [p] * p


def test_peak_memory_per_stage_activation_and_interleaved_units():
    s = schedule.make("1f1b", 3, 6)
    assert timed(s, Costs(1.0, 2.0, activation=(2.0, 1.0, 0.5))).peak_memory == [6.0, 2.0, 0.5]
    inter = schedule.make("interleaved", 4, 8, chunks=2)
    # a chunk's activation is 1/chunks of a stage's: the table's microbatch-chunks over chunks
    assert timed(inter, Costs(1.0, 2.0)).peak_memory == [k / 2 for k in inter.peak_activations]


def test_weight_memory_fraction_is_table1():
    assert weight_memory_fraction(2304, 24, 1024) == pytest.approx(32 * 2304 / (34 * 2304 + 5 * 24 * 1024))
    assert published.weight_memory("1.5B") == weight_memory_fraction(2304, 24, 1024)


# ---- times, by hand --------------------------------------------------------------------------

def test_unit_costs_give_the_tables_ticks():
    """With the table's own costs and no comm, timed() places every action where
    schedule.simulate did."""
    for name, costs in (("1f1b", Costs(1.0, 2.0)), ("zb-h1", Costs(1.0, 1.0, 1.0)),
                        ("dualpipe-v", Costs(1.0, 1.0, 1.0)), ("interleaved", Costs(1.0, 2.0))):
        s = schedule.make(name, 4, 8)
        t = timed(s, costs)
        for d in range(s.stages):
            assert list(t.starts[d]) == [tick for tick, _ in s.program(d)]
        assert t.makespan == s.total_time
        assert t.bubble == pytest.approx(s.steady_bubble_fraction, abs=1e-12)


def test_comm_delays_only_cross_device_inputs():
    """p=2, m=1, 1F1B: F0 on device 0 [0, 1), F0 on device 1 from 1 + comm, its B (3, W added)
    right after, device 0's B once the gradient has arrived, another comm later."""
    c = 0.25
    t = timed(schedule.make("1f1b", 2, 1), Costs(1.0, 2.0, 1.0, comm=c))
    assert t.starts == ((0.0, 1 + c + 1 + 3 + c), (1 + c, 1 + c + 1))
    assert t.makespan == 1 + c + 1 + 3 + c + 3
    # the V's turn (device p-1 hands chunk 0 to its own chunk 1) costs no comm
    v = timed(schedule.make("dualpipe-v", 2, 3), Costs(1.0, 1.0, 1.0, comm=c))
    assert v.start("F", 0, 2) == v.end("F", 0, 1)


def test_uneven_stages_bubble_uses_the_busiest_device():
    s = schedule.make("1f1b", 3, 6)
    t = timed(s, Costs(F=(1.0, 2.0, 1.0), B=(2.0, 4.0, 2.0)))
    assert t.busy == [18.0, 36.0, 18.0]
    assert t.bubble == pytest.approx((t.cost - 36.0) / t.cost)
    assert t.to_dict()["bubble"] == t.bubble and len(t.to_dict()["programs"]) == 3


# ---- closed forms ------------------------------------------------------------------------------

def test_closed_forms_equal_timed_on_random_costs():
    """cost - m(F+B+W) of the timed table equals the closed form exactly (to rounding) on
    random float costs inside each form's domain (formulas.bubble_time says which)."""
    rng = random.Random(0)
    checked = {name: 0 for name in formulas.TIMED_BUBBLES}
    for _ in range(60):
        p = rng.randint(2, 6)
        m = rng.randint(2 * p - 1, 4 * p)
        F, B, W = (rng.uniform(0.2, 2.0) for _ in range(3))
        comm = rng.choice([0.0, rng.uniform(0.0, 0.3)])
        costs = Costs(F, B, W, comm)
        for name in formulas.TIMED_BUBBLES:
            try:
                form = formulas.bubble_time(name, p, m, costs)
            except ConfigError:      # outside the form's domain
                continue
            t = timed(schedule.make(name, p, m), costs)
            assert t.cost - m * (F + B + W) == pytest.approx(form, rel=1e-12, abs=1e-9), (name, p, m, costs)
            checked[name] += 1
    assert all(n >= 10 for n in checked.values()), checked


def test_closed_form_domains_refused():
    with pytest.raises(ConfigError, match="comm"):
        formulas.bubble_time("1f1b", 4, 8, Costs(1.0, 1.0, comm=0.1))
    with pytest.raises(ConfigError, match="W <= F"):
        formulas.bubble_time("zb-h1", 4, 8, Costs(1.0, 1.0, 2.0))
    with pytest.raises(ConfigError, match="microbatches"):
        formulas.bubble_time("zb-h2", 4, 6, Costs(1.0, 1.0, 1.0))
    with pytest.raises(ConfigError, match="one number"):
        formulas.bubble_time("1f1b", 2, 4, Costs((1.0, 2.0), 1.0))
    with pytest.raises(ConfigError, match="no closed form"):
        formulas.bubble_time("gpipe", 2, 4, Costs(1.0, 1.0))


# ---- input checks ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"F": -1.0, "B": 1.0}, "F=-1.0"), ({"F": math.nan, "B": 1.0}, "finite"),
    ({"F": 1.0, "B": math.inf}, "finite"), ({"F": 0.0, "B": 1.0}, "> 0"),
    ({"F": 1.0, "B": 1.0, "W": -0.5}, ">= 0"), ({"F": 1.0, "B": 1.0, "comm": -1.0}, "comm"),
    ({"F": 1.0, "B": 1.0, "weight_memory": 1.5}, "between 0 and 1"),
    ({"F": True, "B": 1.0}, "F=True"), ({"F": (), "B": 1.0}, "one per model stage"),
    ({"F": 1.0, "B": 1.0, "comm": (1.0, 2.0)}, "not a tuple"),
])
def test_bad_costs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Costs(**kwargs)


def test_tuple_length_must_match_model_stages():
    with pytest.raises(ConfigError, match="F has 3 values: the schedule has 8 model stages"):
        timed(schedule.make("interleaved", 4, 8), Costs(F=(1.0, 1.0, 1.0), B=1.0))
    with pytest.raises(ConfigError, match="not a Costs"):
        timed(schedule.make("1f1b", 2, 2), {"F": 1, "B": 2})


def test_parse():
    assert Costs.parse("F=18.522,B=18.086,W=9.337,comm=0.601") == Costs(18.522, 18.086, 9.337, 0.601)
    assert Costs.parse("f=1, b=2/3, Comm=0.5").B == (2.0, 3.0)
    for text, match in (("F=1,B=2,X=3", "unknown key 'X'"), ("F=1", "B is missing"), ("F=a,B=1", "not a number"),
                        ("F=1,B=2,F=3", "each key once"), ("", "key=value"), ("F=1,B=-2", "B=-2.0")):
        with pytest.raises(ConfigError, match=match):
            Costs.parse(text)
