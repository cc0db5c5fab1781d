"""Searched schedules (jaxpar.schedules.search) executed by the pipeline runtime.

A searched schedule is a table like any other; these tests hold that the runtime runs it
as searched:

* a sample at p = 2 and 4 (caps p and 2p, loop and v placements, three cost settings)
  runs with loss, input gradient and every parameter gradient equal to the unsharded
  model's (float32; one case in float64 to ~1e-12);
* its plan carries exactly the table's sends, in the permutes and between the device pairs
  the oracles read off the placement (tests/oracles.py), and the compiled step runs those
  collective-permutes; the plan keeps as many residual slots as the table's peak in flight,
  and the search kept its memory under the cap; its table goes to torch's CSV format and
  back unchanged;
* the compiled temp memory tracks the searched peak: with transformer blocks as stages
  (jaxpar.memory.verify's tagged blocks), the microbatches the compiled step holds equal
  the searched schedule's peak in flight at a tight cap and a loose one (within 10%, as
  `jaxpar verify memory` checks the named schedules).

Each search is one call of a second at most and each runtime case one compile, both cached
per process; the memory check compiles four programs (two GPipe references, two searched).
"""

import dataclasses
import functools

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar import reference
from jaxpar.memory import activations
from jaxpar.memory import verify as memory_verify
from jaxpar.pipeline import plan as plan_lib
from jaxpar.schedules import interchange, schedule, search
from jaxpar.schedules.timing import Costs
from tests import oracles
from tests.pipeline import exact

UNIT = "F=1,B=1,W=1"
UNEQUAL = "F=1,B=2,W=1,comm=0.5"          # a backward twice the forward, and a send's latency
PUBLISHED = "F=18.522,B=18.086,W=9.337,comm=0.601"   # Qi et al. 2023, Table 3, 1.5B model on 8 GPUs
TIME_LIMIT = 0.3    # seconds of search: the orders only need to be valid, not the best

# (p, m, chunks, placement, costs, memory_cap in M_B units)
CASES = [
    (2, 4, 1, "loop", UNIT, 2),          # cap p: 1F1B's memory
    (2, 4, 1, "loop", UNEQUAL, 4),       # cap 2p
    (4, 8, 1, "loop", PUBLISHED, 4),
    (4, 8, 1, "loop", UNEQUAL, 8),
    (2, 4, 2, "v", UNEQUAL, 2),
    (4, 8, 2, "v", UNEQUAL, 8),
    (4, 8, 2, "loop", PUBLISHED, 8),
]


def case_id(case) -> str:
    p, m, chunks, placement, costs, cap = case
    label = {UNIT: "unit", UNEQUAL: "unequal", PUBLISHED: "published"}[costs]
    return f"p{p}-m{m}-v{chunks}-{placement}-{label}-cap{cap}"


@functools.cache
def searched(p, m, chunks, placement, costs, cap) -> search.Searched:
    return search.search(p, m, Costs.parse(costs), memory_cap=cap, chunks=chunks, placement=placement,
                         time_limit=TIME_LIMIT)


def oracle_name(s: schedule.Schedule) -> str:
    """The oracles read a schedule's placement from its name: a named schedule with s's."""
    return "dualpipe-v" if s.placement == "v" else "interleaved"


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in CASES])
def test_searched_plan_carries_its_sends_in_peak_slots(case):
    s = searched(*case)
    s.validate()
    oracles.check_dependencies(s)
    assert s.split_backward and (s.stages, s.microbatches, s.chunks, s.placement) == case[:4]
    assert max(s.timing.peak_memory) <= s.memory_cap == case[5]
    plan = plan_lib.plan(s)
    name = oracle_name(s)
    assert plan.n_sends == len(s.sends) == oracles.sends(name, s.stages, s.microbatches, s.chunks)
    assert plan.permutes == oracles.lockstep_permutes(dataclasses.replace(s, name=name))
    assert {k: set(v) for k, v in plan.pairs.items()} == oracles.channel_pairs(name, s.stages, s.chunks)
    assert plan.n_res == max(s.peak_in_flight)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in CASES])
def test_searched_schedule_goes_to_torch_and_back(case):
    """Its table in torch.pipelining's CSV format reads back as the same table."""
    s = searched(*case)
    back = interchange.from_csv(interchange.to_csv(s), costs=s.costs)
    assert (back.actions, back.placement, back.chunks) == (s.actions, s.placement, s.chunks)


# ---- the runtime runs them exactly ----------------------------------------------------------------

@functools.cache
def _compare(case, dtype=jnp.float32) -> dict:
    """The searched schedule run against the unsharded model (tests/pipeline/exact.py)."""
    return exact.run(searched(*case), dtype)


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c)) for c in CASES])
def test_searched_schedule_runs_exactly(case):
    exact.assert_exact(_compare(case))


def test_searched_schedule_runs_exactly_in_float64(x64):
    c = _compare(CASES[4], jnp.float64)
    exact.assert_exact(c)
    assert c["tolerance"] == (1e-12, 1e-12)


@st.composite
def problems(draw):
    """A search problem the API accepts: 2 <= p <= 4 (one stage has nothing to order), m <=
    6, two chunks in a V, one chunk, or two in a loop (derandomized hypothesis starts from
    the first choices: the V first), different costs per stage, a send latency, a cap
    between the smallest feasible one and three times it, and even or uneven layers per
    stage (1 to 3)."""
    p, m = draw(st.integers(2, 4)), draw(st.integers(1, 6))
    chunks, placement = draw(st.sampled_from([(2, "v"), (1, "loop"), (2, "loop")]))
    per_stage = lambda low, high: st.tuples(*[st.floats(low, high) for _ in range(p * chunks)])
    costs = Costs(F=draw(per_stage(0.5, 2)), B=draw(per_stage(0.5, 3)), W=draw(per_stage(0.1, 1.5)),
                  comm=draw(st.floats(0, 0.5)), weight_memory=draw(st.floats(0, 1)))
    cap = search.minimum_cap(p, chunks, costs, placement) * draw(st.floats(1, 3))
    counts = draw(st.none() | st.tuples(*[st.integers(1, 3) for _ in range(p * chunks)]))
    return p, m, chunks, placement, costs, cap, counts


@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_drawn_searched_schedules_run_exactly(problem):
    """Whatever the search accepts, the runtime runs exactly: drawn sizes, placements,
    costs, caps and layer splits, each one compile."""
    p, m, chunks, placement, costs, cap, counts = problem
    s = search.search(p, m, costs, cap, chunks=chunks, placement=placement, time_limit=0.05)
    search.validate_memory(s, costs, cap)
    exact.assert_exact(exact.run(s.validate(), layers_per_stage=counts))


# ---- compiled memory tracks the searched peak ---------------------------------------------------

MEMORY_P, MEMORY_M, MICROBATCH_SIZE, SEQ_LEN = 2, 4, 2, 64
MEMORY_CFG = reference.ModelConfig(**{**vars(memory_verify.CFG), "n_layers": 2 * MEMORY_P})


def memory_schedule(name: str, m: int, cap: float | None = None) -> schedule.Schedule:
    """GPipe ("gpipe") or the searched schedule ("searched", under `cap`) at p = MEMORY_P."""
    if name == "searched":
        return searched(MEMORY_P, m, 1, "loop", UNIT, cap)
    return schedule.make(name, stages=MEMORY_P, microbatches=m)


def compiled_temp(name: str, m: int, cap: float | None = None) -> int:
    """Compiled temp bytes per device of the runtime's step for memory_schedule(name, m,
    cap), with two tagged transformer blocks per stage (the memory model's storage), measured
    as jaxpar.memory.verify measures the named schedules; GPipe's compiles are the ones its
    check compiles (the same configuration, cached per process)."""
    if name == "searched":
        return _searched_temp(m, cap)
    return memory_verify.named_schedule_temp(name, MEMORY_P, m, cfg=MEMORY_CFG, microbatch_size=MICROBATCH_SIZE,
                                             seq_len=SEQ_LEN)[0]


@functools.cache
def _searched_temp(m: int, cap: float) -> int:
    s = memory_schedule("searched", m, cap)
    return memory_verify.schedule_temp(s, cfg=MEMORY_CFG, microbatch_size=MICROBATCH_SIZE, seq_len=SEQ_LEN)[0]


def one_more_in_flight() -> float:
    """Bytes of one more microbatch in flight: GPipe at 2m against GPipe at m, over m."""
    return (compiled_temp("gpipe", 2 * MEMORY_M) - compiled_temp("gpipe", MEMORY_M)) / MEMORY_M


def held_in_flight(cap: float) -> float:
    """Microbatches the compiled step of the searched schedule holds, measured as
    check_pipeline_memory does for the named ones: m minus what it saves against GPipe at
    m, in units of one more in flight, after its output-gradient buffer for W (one per
    residual slot and one more, each two layers' output) is taken out."""
    act = MICROBATCH_SIZE * SEQ_LEN * MEMORY_CFG.d_model * 4
    kept = (plan_lib.plan(memory_schedule("searched", MEMORY_M, cap)).n_res + 1) * 2 * act
    saved = compiled_temp("gpipe", MEMORY_M) - (compiled_temp("searched", MEMORY_M, cap) - kept)
    return MEMORY_M - saved / one_more_in_flight()


def test_one_more_in_flight_costs_what_the_model_says():
    """The reference the next test measures with: GPipe at m and 2m differ by m times two
    layers' activations and the waiting output gradient (the memory model's bytes)."""
    model = (2 * activations.layer_bytes(memory_verify.block_of(MEMORY_CFG), seq_len=SEQ_LEN,
                                         batch_size=MICROBATCH_SIZE)
             + MICROBATCH_SIZE * SEQ_LEN * MEMORY_CFG.d_model * 4)
    assert one_more_in_flight() == pytest.approx(model, rel=0.10)


@pytest.mark.parametrize("cap", [MEMORY_P, 2 * MEMORY_P])
def test_compiled_memory_tracks_the_searched_peak(cap):
    peak = max(memory_schedule("searched", MEMORY_M, cap).peak_in_flight)
    assert held_in_flight(cap) == pytest.approx(peak, rel=0.10)


def test_a_looser_cap_keeps_more_in_flight():
    """The two caps above give different peaks, so the memory check tells them apart."""
    tight, loose = (max(memory_schedule("searched", MEMORY_M, cap).peak_in_flight)
                    for cap in (MEMORY_P, 2 * MEMORY_P))
    assert tight <= MEMORY_P < loose
