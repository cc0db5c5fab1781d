"""The pipeline's closed forms: bubble fractions, microbatches in flight, and the
collectives of one step.

Pure Python (the planner reads it; no JAX). Every figure here is checked against what
the schedule's table gives (bubbles) or what the compiled program runs (collectives).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError
from jaxpar.schedules import orders
from jaxpar.pipeline import plan as plan_lib
from jaxpar.schedules import schedule as schedule_lib
from jaxpar.schedules.schedule import Schedule
from jaxpar.schedules.timing import Costs


# Closed forms by the shape of the timeline; `orders.Kind.bubble` and `Kind.in_flight`
# name each schedule's (the tests hold every one against the tables).
BUBBLES: dict[str, Callable[[int, int, int], float]] = {
    # idle / total time with the default costs
    "one at a time": lambda p, m, v: (p - 1) / p,     # m > 1 is gradient accumulation
    "fill-drain": lambda p, m, v: (p - 1) / (m + p - 1),  # lecture 2.2, 2.3; any F and B costs
    # total time (v m + p - 1)(F + B), so idle/busy = (p - 1)/(v m): Narayanan et al.'s figure
    # (they divide by the ideal time)
    "interleaved": lambda p, m, v: (p - 1) / (v * m + p - 1),
    # F = B = W = 1 per chunk, m >= 2p - 1: each device works 6m ticks without a gap from
    # tick d; back to back, 0
    "v": lambda p, m, v: (p - 1) / (6 * m + p - 1),
}
IN_FLIGHT: dict[str, Callable[[int, int, int], float]] = {
    # microbatches whose activations the first stage holds at its peak, in whole stages
    "one": lambda p, m, v: 1,
    "all": lambda p, m, v: m,
    "p": lambda p, m, v: min(m, p),            # p warm-up forwards (the V: 2p chunks of half a stage)
    "2p-1": lambda p, m, v: min(m, 2 * p - 1),  # 2p - 1 warm-up forwards
    # Narayanan et al. 2021: at most mv chunks of 1/v stage
    "interleaved": lambda p, m, v: min(p * (1 + (p - 1) / (p * v)), m),
}


def bubble(name: str, p: int, m: int, chunks: int | None = None) -> float:
    """Idle time / total time of jaxpar's `name` table with the default costs: the form
    of BUBBLES its registry entry names (`orders.Kind.bubble`). The zero-bubble schedules
    have none: their figures are read off their tables. Sizes the schedule refuses
    (`schedule.check`) raise ConfigError, as building its table would."""
    kind, chunks = schedule_lib.check(name, p, m, chunks, table=False)
    form = kind.bubble
    if form is None:
        with_form = [n for n, kind in orders.REGISTRY.items() if kind.bubble]
        raise ConfigError(f"no closed-form bubble for {name!r}: one of {', '.join(with_form)} (the others are "
                          "read off their tables: schedule.make(name, ...).bubble_fraction)")
    return BUBBLES[form](p, m, chunks)


# Bubble time, cost - m(F+B+W), of the named schedule timed with float costs and comm
# (timing.timed; cost = the longest device span, Qi et al.'s): (form, its domain, what the
# domain says). Qi et al.'s Table 2 gives the comm-free forms; the comm terms are what the
# timed tables give: ZB-H2's 2 comm (the first microbatch's round trip, once per stage),
# ZB-H1's 4 comm (its round trip in the warm-up and again in the drain). 1F1B's comm term
# grows with m (each steady-state round trip waits), so its form holds without comm only.
# The domains are sufficient conditions, checked on random float costs by the tests.
TIMED_BUBBLES: dict[str, tuple[Callable[..., float], Callable[..., bool], str]] = {
    "1f1b": (lambda p, m, F, B, W, comm: (p - 1) * (F + B + W),
             lambda p, m, F, B, W, comm: comm == 0,
             "comm = 0"),
    "zb-h1": (lambda p, m, F, B, W, comm: (p - 1) * (F + B - W + 4 * comm),
              lambda p, m, F, B, W, comm: W <= F and (comm == 0 or (2 * comm <= W and m > p)),
              "W <= F, and with comm > 0 also 2 comm <= W and microbatches > stages"),
    "zb-h2": (lambda p, m, F, B, W, comm: (p - 1) * (F + B + 2 * comm - 2 * W),
              lambda p, m, F, B, W, comm: m >= 2 * p - 1 and W <= F and 2 * W <= B + 2 * comm,
              "microbatches >= 2 stages - 1, W <= F and 2W <= B + 2 comm"),
}


def bubble_time(name: str, p: int, m: int, costs: Costs) -> float:
    """Bubble time of `name` (1f1b, zb-h1, zb-h2) with p stages, m microbatches and equal
    stages' float `costs`: the longest device span minus m(F+B+W), as `timing.timed` gives
    it, by closed form (TIMED_BUBBLES). ConfigError outside the form's domain."""
    if name not in TIMED_BUBBLES:
        raise ConfigError(f"no closed form with float costs for {name!r}: one of {', '.join(TIMED_BUBBLES)} "
                          "(time the others: timing.timed(schedule.make(name, ...), costs))")
    errors.whole("p", p)
    errors.whole("m", m)
    if not isinstance(costs, Costs) or any(isinstance(getattr(costs, k), tuple) for k in "FBW"):
        raise ConfigError(f"costs={costs!r}: the closed forms take equal stages, one number each for F, B "
                          "and W (Costs(F=1.0, B=1.0, W=1.0)); time uneven stages with timing.timed")
    form, domain, said = TIMED_BUBBLES[name]
    values = (p, m, costs.F, costs.B, costs.W, costs.comm)
    if not domain(*values):
        raise ConfigError(f"{name} with p={p}, m={m}, F={costs.F}, B={costs.B}, W={costs.W}, comm={costs.comm}: "
                          f"its closed form holds for {said}; time it instead: timing.timed(schedule.make(...), costs)")
    return form(*values)


def in_flight(name: str, *, p: int, m: int, chunks: int | None = None) -> float:
    """Microbatches whose activations the first stage holds at its peak, in units of a
    whole stage's activations: the form of IN_FLIGHT its registry entry names
    (`orders.Kind.in_flight`). `memory.activations.first_stage_bytes` takes it. Sizes the
    schedule refuses (`schedule.check`; chunks: its default for None) raise ConfigError."""
    kind, chunks = schedule_lib.check(name, p, m, chunks, table=False)
    return float(IN_FLIGHT[kind.in_flight](p, m, chunks))


# Past 4p microbatches no device's peak grows (the warm-up and the drain are fixed and the
# steady state repeats; tests/pipeline/test_formulas.py holds it for random stage weights),
# except where every forward runs before any backward (GPipe: m times one microbatch's).
PEAK_MICROBATCHES = 4


def device_peaks(name: str, *, p: int, m: int, chunks: int | None = None, stage_weights) -> list[float]:
    """Per pipeline device, the most activations it holds at once, with each model stage's
    activations per microbatch weighing its entry of `stage_weights` (one per virtual stage:
    its layers, say): read off the schedule's own table (`Schedule.weighted_peaks`), so exact
    where stages differ and a device's chunks differ in size. Built with at most
    PEAK_MICROBATCHES x p microbatches, beyond which the peaks are the same."""
    kind, chunks = schedule_lib.check(name, p, m, chunks, table=False)
    if kind.in_flight == "all":
        one = schedule_lib.make(name, p, 1, chunks).weighted_peaks(stage_weights)
        return [float(m * w) for w in one]
    table = schedule_lib.make(name, p, min(m, PEAK_MICROBATCHES * p), chunks)
    return [float(w) for w in table.weighted_peaks(stage_weights)]


def _rows(batch_size, features, dp, m) -> int:
    """Rows of one microbatch on one device; refuses sizes that are not whole or do not split."""
    for name, value in (("batch_size", batch_size), ("features", features), ("dp", dp)):
        errors.whole(name, value)
    errors.divisible("batch_size", batch_size, "dp x microbatches", dp * m,
                     why="each device runs batch_size/(dp*m) rows per microbatch", fix=f"a multiple of {dp * m}")
    return batch_size // (dp * m)


def pipeline_collectives(*, schedule: Schedule, batch_size: int, features: int, dtype, dp: int = 1,
                         param_bytes: int = 0) -> Collectives:
    """The collectives of one compiled step of `runtime.pipeline` (forward and backward are
    one program) on a dp x pp mesh, for a batch of `batch_size` rows whose activation has
    `features` elements per row in `dtype`:
      collective-permute  plan.permutes executions (one per step, lane and direction in
                          which some device sends), each one microbatch's activation on one
                          device: batch_size/(dp*m) rows;
      all-reduce          dp > 1 only: the stage's parameter gradients and the loss, summed
                          over dp once (XLA combines them: param_bytes/p + one loss scalar);
      nothing else."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule is a {type(schedule).__name__}, not a Schedule: schedule.make(...)")
    item = np.dtype(dtype).itemsize
    m = schedule.microbatches
    act = _rows(batch_size, features, dp, m) * features * item
    permutes = plan_lib.plan(schedule).permutes
    out = {"collective-permute": (permutes, permutes * act)}
    if dp > 1:
        out["all-reduce"] = (1, param_bytes // schedule.stages + item)
    return Collectives(out)


def baseline_collectives(*, stages: int, microbatches: int, batch_size: int, features: int, dtype,
                         dp: int = 1, param_bytes: int = 0) -> Collectives:
    """The collectives of one step of the GPipe baseline (`baseline.gpipe_baseline`):
    m+p-1 forward steps, each a ppermute of one microbatch's activation, and autodiff's
    transpose of each, 2(m+p-1) in all; with dp > 1 one all-reduce of the stage's parameter
    gradients and the loss."""
    errors.whole("stages", stages)
    errors.whole("microbatches", microbatches)
    item = np.dtype(dtype).itemsize
    act = _rows(batch_size, features, dp, microbatches) * features * item
    n = 2 * (microbatches + stages - 1) if stages > 1 else 0
    out = {"collective-permute": (n, n * act)}
    if dp > 1:
        out["all-reduce"] = (1, param_bytes // stages + item)
    return Collectives(out)


# The lecture's section 2.1-2.3 timelines as it prints them (p=4, F=1, B=2), with its bubble
# figures (rounded to 0.1%) and 1F1B's peak activations: what `jaxpar verify schedule` and
# examples/01 hold the schedules' tables against.
LECTURE_TIMELINES: dict[str, dict] = {
    "naive": {"microbatches": 1, "bubble": 0.75, "peak": None, "rows": [
        "0.........aa", ".0......aa..", "..0...aa....", "...0aa......"]},
    "gpipe": {"microbatches": 8, "bubble": 0.273, "peak": None, "rows": [
        "01234567.........aabbccddeeffgghh", ".01234567......aabbccddeeffgghh..",
        "..01234567...aabbccddeeffgghh....", "...01234567aabbccddeeffgghh......"]},
    "1f1b": {"microbatches": 8, "bubble": 0.273, "peak": [4, 3, 2, 1], "rows": [
        "0123......aa4bb5cc6dd7ee.ff.gg.hh", ".012....aa3bb4cc5dd6ee7ff.gg.hh..",
        "..01..aa2bb3cc4dd5ee6ff7gg.hh....", "...0aa1bb2cc3dd4ee5ff6gg7hh......"]},
}
