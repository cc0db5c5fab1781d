"""The pipeline's closed forms: bubble fractions and the collectives of one step.

Pure Python (the planner reads it; no JAX). Every figure here is checked against what
the schedule's table gives (bubbles) or what the compiled program runs (collectives).
"""

from __future__ import annotations

import numpy as np

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline.schedule import Schedule


def bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle time / total time of jaxpar's `name` table with the default costs:
      naive        (p-1)/p: one microbatch at a time, m > 1 is gradient accumulation;
      gpipe, 1f1b  (p-1)/(m+p-1) (lecture 2.2, 2.3), for any F and B costs;
      interleaved  (p-1)/(v*m+p-1): total time (v*m+p-1)(F+B), i.e. idle/busy = (p-1)/(v*m),
                   Narayanan et al.'s figure (they divide by the ideal time);
      dualpipe-v   (p-1)/(6m+p-1) at F=B=W=1, m >= 2p-1: each device works 6m ticks without
                   a gap from tick d; back to back, 0."""
    forms = {"naive": lambda: (p - 1) / p, "gpipe": lambda: (p - 1) / (m + p - 1),
             "1f1b": lambda: (p - 1) / (m + p - 1), "interleaved": lambda: (p - 1) / (v * m + p - 1),
             "dualpipe-v": lambda: (p - 1) / (6 * m + p - 1)}
    if name not in forms:
        raise ConfigError(f"no closed-form bubble for {name!r}: one of {', '.join(forms)} (the others are read "
                          "off their tables: schedule.make(name, ...).bubble_fraction)")
    return forms[name]()


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

