"""A schedule's device orders timed with measured costs and communication: float start
and end of every action, the makespan, the bubble rate in Qi et al.'s sense, and each
device's peak activation memory.

`Schedule` places actions in whole ticks (F=1, B=2 or F=B=W=1), which fixes only the
ORDER in which each device runs its actions. `timed(schedule, costs)` keeps that order
and times it again with `Costs`: float F, B, W per action (one value for every stage,
or one per model stage for uneven stages) and `comm`, the latency of every activation
(F -> F) and input gradient (B -> B) that crosses devices. Each action starts at the
earliest time its device is free and every input it needs has ended, plus `comm` when
the input was made on another device; a send occupies neither device (Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", arXiv 2401.10241, model it so in their schedule
search and in the bubble rates of their Table 5, which `published.py` holds and this
timing reproduces).

With more than one chunk per device, each action runs on one chunk, and the costs given are
per action on one chunk (1/chunks of a device's share of the model when stages are even).

The bubble rate is Qi et al.'s (section 5.3): (cost - m(F+B+W)) / cost, where cost is
"the largest execution time of all stages", each device from its first start to its
last end (with their optimizer post-validation a device starts its next step as soon as
its own last action ends). With uneven stages the busiest device's work stands for
m(F+B+W). `Timing.makespan_bubble` counts from time 0 instead (one step on its own).

Memory, in units of M_B, one microbatch's activations on one device's whole share of
the model (Qi et al.'s M_B): an F adds `activation` (split over the chunks: `activation
/ v` per chunk when one number is given); without the backward split, B frees all of
it; with the split, B frees all but the fraction `weight_memory` (M_W / M_B: the inputs
of the linear layers and the output gradients that the weight gradient still reads),
and W frees the rest. Qi et al.'s Table 1 gives, per transformer layer with sequence s,
microbatch b, hidden h and a heads, M_B = sb(34h + 5as) and M_W = 32sbh, so M_W / M_B
= 32h / (34h + 5as) (`weight_memory_fraction`); the default 32/34 drops the 5as^2b of
the attention scores, which FlashAttention never stores.

    costs = Costs.parse("F=18.522,B=18.086,W=9.337,comm=0.601")  # Qi et al.'s 1.5B model
    t = timed(schedule.make("zb-h1", 8, 24), costs)
    t.makespan, t.bubble, t.peak_memory

Pure Python: no JAX, no numpy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

from jaxpar.errors import ConfigError
from jaxpar.schedules.orders import Action
from jaxpar.schedules.schedule import Key, Schedule, place

__all__ = ["Costs", "Timing", "timed", "weight_memory_fraction", "DEFAULT_WEIGHT_MEMORY"]

# Qi et al.'s Table 1 without the attention scores (FlashAttention keeps none): 32sbh / 34sbh.
DEFAULT_WEIGHT_MEMORY = 32 / 34
# The keys of Costs.parse, in their order of mention in the CLI's help.
KEYS = ("F", "B", "W", "comm", "activation", "weight_memory")
EXAMPLE = "F=18.522,B=18.086,W=9.337,comm=0.601"

Value = float | tuple[float, ...]


def weight_memory_fraction(hidden: int, heads: int, sequence: int) -> float:
    """M_W / M_B of one transformer layer (Qi et al. 2023, Table 1): 32h / (34h + 5as),
    the part of a microbatch's activations that B (input gradient) keeps for W."""
    for name, value in (("hidden", hidden), ("heads", heads), ("sequence", sequence)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r}: a whole number >= 1, e.g. {name}=1024")
    return 32 * hidden / (34 * hidden + 5 * heads * sequence)


def _checked(name: str, value, *, positive: bool) -> Value:
    """`value` (a real number or a tuple of them) as floats, or ConfigError: finite, and > 0
    (`positive`) or >= 0."""
    items = tuple(value) if isinstance(value, (tuple, list)) else None
    if items is not None and not items:
        raise ConfigError(f"{name}=(): give one number for every stage, or a tuple with one per model stage")
    for item in items if items is not None else (value,):
        bound = "> 0" if positive else ">= 0"
        if isinstance(item, bool) or not isinstance(item, numbers.Real) or not math.isfinite(item) \
                or (item <= 0 if positive else item < 0):
            raise ConfigError(f"{name}={value!r}: each cost is a finite real number {bound} (time per action), "
                              f"e.g. {name}={1.0 if positive else 0.0}")
    return tuple(float(i) for i in items) if items is not None else float(value)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time per action and memory per action, for `timed`.

    F, B, W      time of one forward, input-gradient backward and weight-gradient action
                 on one model stage (on one chunk when chunks > 1): one float for every stage,
                 or a tuple with one float per model stage (p * chunks of them, in model order)
                 for uneven stages. For a schedule that does not split the backward, a
                 B action computes both gradients and takes B + W.
    comm         latency of every activation and input gradient that crosses devices; it
                 occupies neither device (a hand-over between chunks of one device is free).
    activation   memory one microbatch's forward leaves on a device's whole share of the
                 model, in M_B units (1.0: Qi et al.'s M_B); one number is split evenly
                 over the chunks (1/chunks per chunk), a tuple gives each model stage its own.
    weight_memory  M_W / M_B: the fraction of an F's activation that B keeps for W (the
                 rest B frees); between 0 and 1. Without the backward split B frees all."""

    F: Value
    B: Value
    W: Value = 0.0
    comm: float = 0.0
    activation: Value = 1.0
    weight_memory: float = DEFAULT_WEIGHT_MEMORY

    def __post_init__(self):
        for name in ("F", "B"):
            object.__setattr__(self, name, _checked(name, getattr(self, name), positive=True))
        for name in ("W", "activation"):
            object.__setattr__(self, name, _checked(name, getattr(self, name), positive=False))
        for name in ("comm", "weight_memory"):
            value = getattr(self, name)
            if isinstance(value, (tuple, list)):
                raise ConfigError(f"{name}={value!r}: one number for every device pair, not a tuple")
            object.__setattr__(self, name, _checked(name, value, positive=False))
        if self.weight_memory > 1:
            raise ConfigError(f"weight_memory={self.weight_memory}: a fraction of the activation (M_W / M_B) "
                              f"between 0 and 1, e.g. weight_memory={DEFAULT_WEIGHT_MEMORY:.3f}")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """'F=18.522,B=18.086,W=9.337,comm=0.601' -> Costs; a per-stage value is written
        with slashes, F=10/20/20/10. Keys: F, B, W, comm, activation, weight_memory."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"costs {text!r}: write key=value pairs, e.g. {EXAMPLE}")
        fields: dict[str, Value] = {}
        spelled = {k.lower(): k for k in KEYS}   # keys in any case: f=1 is F=1
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            key = spelled.get(key.lower(), key)
            if key not in KEYS:
                raise ConfigError(f"costs {text!r}: unknown key {key!r}; keys are {', '.join(KEYS)}, "
                                  f"e.g. {EXAMPLE}")
            if not sep or key in fields:
                raise ConfigError(f"costs {text!r}: give each key once as key=value, e.g. {EXAMPLE}")
            try:
                values = tuple(float(v) for v in value.split("/"))
            except ValueError:
                raise ConfigError(f"costs {text!r}: {key}={value!r} is not a number (a per-stage value is "
                                  f"written with slashes, F=10/20/20/10); e.g. {EXAMPLE}") from None
            fields[key] = values[0] if len(values) == 1 else values
        for needed in ("F", "B"):
            if needed not in fields:
                raise ConfigError(f"costs {text!r}: {needed} is missing; F and B are needed, e.g. {EXAMPLE}")
        return cls(**fields)

    def of(self, name: str, stage: int) -> float:
        """`name`'s value (F, B, W or activation) on model `stage`."""
        value = getattr(self, name)
        return value[stage] if isinstance(value, tuple) else value

    def check_stages(self, virtual_stages: int) -> None:
        """Refuse a per-stage tuple whose length is not the schedule's model stages (p * chunks)."""
        for name in ("F", "B", "W", "activation"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != virtual_stages:
                raise ConfigError(f"{name} has {len(value)} values: the schedule has {virtual_stages} model "
                                  f"stages (stages x chunks); give one value per model stage, or one number")

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True, eq=False)
class Timing:
    """A schedule's device orders timed with `costs`: `starts[d][j]` and `ends[d][j]` are
    the times of device d's j-th action (`schedule.program(d)[j]`), from 0.

    makespan      the last end (every device starts at 0)
    spans         each device's execution time, from its first start to its last end
    cost          the longest span: Qi et al.'s "cost", "the largest execution time of all
                  stages". With their optimizer post-validation a device starts its next
                  step as soon as its own last action ends, so the span, not the makespan,
                  is the period of steps run back to back.
    busy          each device's busy time (the sum of its actions' costs)
    bubble        Qi et al.'s bubble rate, (cost - busy time of the busiest device) / cost:
                  (cost - m(F+B+W)) / cost when stages are even; with uneven stages the
                  busiest device's busy time is the ideal (no device can finish sooner).
    makespan_bubble  the same with the makespan for the cost: one step on its own.
    peak_memory   each device's most live activation memory, in M_B units (module doc)."""

    schedule: Schedule
    costs: Costs
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]

    @functools.cached_property
    def makespan(self) -> float:
        return max((e for ends in self.ends for e in ends), default=0.0)

    @functools.cached_property
    def spans(self) -> list[float]:
        return [ends[-1] - starts[0] if ends else 0.0 for starts, ends in zip(self.starts, self.ends)]

    @functools.cached_property
    def cost(self) -> float:
        return max(self.spans, default=0.0)

    @functools.cached_property
    def busy(self) -> list[float]:
        return [math.fsum(e - s for s, e in zip(starts, ends)) for starts, ends in zip(self.starts, self.ends)]

    @functools.cached_property
    def bubble(self) -> float:
        return (self.cost - max(self.busy)) / self.cost if self.cost else 0.0

    @functools.cached_property
    def makespan_bubble(self) -> float:
        return (self.makespan - max(self.busy)) / self.makespan if self.makespan else 0.0

    @functools.cached_property
    def peak_memory(self) -> list[float]:
        return [_peak(self.schedule, self.costs, d, self.starts[d], self.ends[d])
                for d in range(self.schedule.stages)]

    @functools.cached_property
    def _index(self) -> dict[Key, tuple[int, int]]:
        s = self.schedule
        return {s._key(d, a): (d, j) for d in range(s.stages) for j, (_, a) in enumerate(s.program(d))}

    def start(self, kind: str, microbatch: int, stage: int) -> float:
        d, j = self._index[kind, microbatch, stage]
        return self.starts[d][j]

    def end(self, kind: str, microbatch: int, stage: int) -> float:
        d, j = self._index[kind, microbatch, stage]
        return self.ends[d][j]

    def to_dict(self) -> dict:
        s = self.schedule
        return {
            "name": s.name, "stages": s.stages, "microbatches": s.microbatches, "chunks": s.chunks,
            "placement": s.placement, "costs": self.costs.to_dict(),
            "makespan": self.makespan, "cost": self.cost, "bubble": self.bubble,
            "makespan_bubble": self.makespan_bubble, "spans": self.spans, "busy": self.busy, "peak": self.peak_memory,
            "units": {"time": "the costs' unit (per action on one chunk when chunks > 1)",
                      "peak": "M_B: one microbatch's activations on a device's whole share of the model"},
            "programs": [[{"kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk,
                           "stage": s.stage_of(d, a.chunk), "start": t0, "end": t1}
                          for (_, a), t0, t1 in zip(s.program(d), self.starts[d], self.ends[d])]
                         for d in range(s.stages)],
        }


def duration(schedule: Schedule, costs: Costs, device: int, action: Action) -> float:
    """Time `action` takes on `device` under `costs`; B without the split includes W."""
    stage = schedule.stage_of(device, action.chunk)
    if action.kind == "B" and not schedule.split_backward:
        return costs.of("B", stage) + costs.of("W", stage)
    return costs.of(action.kind, stage)


def timed(schedule: Schedule, costs: Costs) -> Timing:
    """Time `schedule`'s device orders with `costs`: each action, in its device's order,
    starts at the earliest time its device is free and its inputs have ended (plus
    `costs.comm` for an input from another device). ConfigError for a per-stage tuple of
    the wrong length or device orders that deadlock."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule is a {type(schedule).__name__}, not a Schedule: schedule.make(...)")
    if not isinstance(costs, Costs):
        raise ConfigError(f"costs is a {type(costs).__name__}, not a Costs: Costs(F=1.0, B=1.0, W=1.0) "
                          f"or Costs.parse('{EXAMPLE}')")
    costs.check_stages(schedule.virtual_stages)
    programs = [[a for _, a in schedule.program(d)] for d in range(schedule.stages)]
    times = place(schedule, programs, functools.partial(duration, schedule, costs), latency=costs.comm, zero=0.0)
    if times is None:
        raise ConfigError(f"{schedule.name}: the device orders deadlock with blocking receives; "
                          f"schedule.validate() names the cycle")
    starts = [[start for start, _ in t] for t in times]
    ends = [[end for _, end in t] for t in times]
    return Timing(schedule, costs, tuple(map(tuple, starts)), tuple(map(tuple, ends)))


def _peak(schedule: Schedule, costs: Costs, device: int, starts: Sequence[float], ends: Sequence[float]) -> float:
    """Most activation memory live on `device` at once, in M_B units: an F adds its
    activation at its start; B frees it (all of it, or all but `weight_memory` with the
    split) at its end, W the rest at its end. At equal times frees come first."""
    events: list[tuple[float, int, float]] = []   # (time, 0 free / 1 allocate, amount)
    for (_, action), start, end in zip(schedule.program(device), starts, ends):
        stage = schedule.stage_of(device, action.chunk)
        activation = costs.activation
        size = activation[stage] if isinstance(activation, tuple) else activation / schedule.chunks
        kept = costs.weight_memory * size if schedule.split_backward else 0.0
        if action.kind == "F":
            events.append((start, 1, size))
        elif action.kind == "B":
            events.append((end, 0, -(size - kept)))
        else:
            events.append((end, 0, -kept))
    live = peak = 0.0
    for _, _, amount in sorted(events):
        live += amount
        peak = max(peak, live)
    return round(peak, 12)
