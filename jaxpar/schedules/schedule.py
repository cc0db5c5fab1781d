"""Pipeline schedules as data (lecture section 2; its script 01_pipeline_schedules.py).

A `Schedule` is the table `actions[tick][device]`: the `Action(kind, microbatch, chunk)`
that *starts* on that device at that tick, or None. An action occupies `costs[kind]`
consecutive ticks (lecture default F=1, B=2; with the backward split of Qi et al. 2023,
B=1 for the input gradient and W=1 for the weight gradient), so `occupancy(device)`
gives what a device is busy with at every tick and `program(device)` its ordered
actions with their start ticks. Everything else is read from that table: the bubble,
the peak live activations, the sends between devices, the ASCII/PNG/Perfetto
timelines (`viz`) and the validator; the JAX runtime (`runtime.py`) executes
these tables. Pure Python: building a schedule never imports JAX.

The generators of `orders` give each device an ordered program and `simulate` places
every action at the earliest tick its device and its inputs allow, as a device with
blocking receives would run it. So no figure is ever taken from a formula.

    s = make("1f1b", stages=4, microbatches=8)
    s.bubble_fraction, s.peak_activations   # 3/11, [4, 3, 2, 1]
    print(s.ascii())                         # the lecture's rows, character for character
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence

from jaxpar import errors
from jaxpar.errors import ConfigError, is_whole
from jaxpar.schedules import orders, stats, viz
from jaxpar.schedules.orders import Action, find_deadlock
from jaxpar.schedules.stats import Send

__all__ = ["Action", "Schedule", "ScheduleError", "Send", "find_deadlock", "make", "simulate", "KNOWN", "SPLIT"]


class ScheduleError(ConfigError):
    """A table that cannot run: `tick` and `device` locate it (tick None: nowhere in time,
    e.g. a missing action); the message ends with the timeline and a `^` under the spot."""

    def __init__(self, message: str, schedule: Schedule, tick: int | None, device: int):
        self.tick, self.device = tick, device
        super().__init__(f"{message}\n{viz.mark(schedule, tick, device)}")


# F=1, B=2 is the lecture's time model; split backward halves B into B (input) and W (weights).
DEFAULT_COSTS = {"F": 1, "B": 2}
DEFAULT_SPLIT_COSTS = {"F": 1, "B": 1, "W": 1}
# Read off the one registry (orders.REGISTRY), for readers that want names only.
KNOWN = tuple(orders.REGISTRY)
SPLIT = tuple(n for n, k in orders.REGISTRY.items() if k.split_backward)  # backward split into B and W
# Sizes beyond any pipeline (Llama 3 405B: 16 stages, DeepSeek-V3: 16): past these a
# request is a typo, and building its table would only exhaust memory.
MAX_STAGES = 1024
MAX_MICROBATCHES = 1 << 16
MAX_CHUNKS = 64
MAX_ACTIONS = 1 << 21   # p * m * v * kinds: a table of about 2 million actions builds in seconds
MAX_CELLS = 1 << 23     # ticks x stages of the table: 8 million cells take about 10 s and 250 MB
# Where chunk c of device d sits in the model (its placement): "loop" (Megatron's interleaved
# schedule) stage c*p + d, each chunk one loop down the devices; "v" (ZB-V, DualPipeV;
# chunks=2) stage d going down the devices, 2p-1-d coming back up.
PLACEMENTS = ("loop", "v")

Key = tuple[str, int, int]  # (kind, microbatch, stage): one action, wherever it runs


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule(stats.Statistics):
    """A pipeline schedule: p = `stages` devices, m = `microbatches`, v = `chunks` per
    device, per-kind `costs` in ticks, `split_backward` (B is input-gradient only, W the
    weight gradient), `actions[tick][device]` = the Action starting there, or None, and
    the `placement` of the chunks over the model (`stage_of`; one of PLACEMENTS). Every reader
    of the table (and the runtime) maps (device, chunk) to a stage through it.

    Construction checks the shape of the table (ValueError, or ScheduleError when an entry
    is well formed but not an action of this schedule); `validate()` checks it can run.
    A chunk (chunks > 1) is 1/chunks of a device's model: `costs` are ticks per action on one chunk."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    costs: Mapping[str, int]
    split_backward: bool
    actions: Sequence[Sequence[Action | None]]
    placement: str = "loop"

    def __post_init__(self):
        check_sizes(self.stages, self.microbatches, self.chunks)
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement {self.placement!r}: one of {', '.join(PLACEMENTS)}")
        if self.placement == "v" and self.chunks != 2:
            raise ConfigError(f"placement 'v' has 2 chunks per device (down and back up), not {self.chunks}")
        kinds = "FBW" if self.split_backward else "FB"
        if not isinstance(self.costs, Mapping) or set(self.costs) != set(kinds) \
                or not all(is_whole(c) and c >= 1 for c in self.costs.values()):
            example = DEFAULT_SPLIT_COSTS if self.split_backward else DEFAULT_COSTS
            raise ConfigError(f"costs {self.costs!r}: whole ticks >= 1 for exactly the kinds "
                             f"{', '.join(kinds)} (split_backward={self.split_backward}), e.g. {example}")
        for t, row in enumerate(self.actions):
            if not isinstance(row, Sequence) or len(row) != self.stages:
                raise ConfigError(f"actions[{t}] = {row!r}: a row holds one entry per device, "
                                 f"{self.stages} here (None where the device starts nothing)")
            for d, a in enumerate(row):
                if a is not None and not (isinstance(a, Action) and a.kind in ("F", "B", "W")
                                          and is_whole(a.microbatch) and is_whole(a.chunk)):
                    raise ConfigError(f"actions[{t}][{d}] = {a!r}: an entry is None or Action(kind, "
                                     f"microbatch, chunk), kind F, B or W, whole numbers for the "
                                     f"others, e.g. Action('F', 0)")
        for d, prog in enumerate(self._programs):
            for t, a in prog:
                if a.kind not in kinds or not 0 <= a.microbatch < self.microbatches \
                        or not 0 <= a.chunk < self.chunks:
                    raise ScheduleError(f"tick {t}, device {d}: {a!r} is not an action of this "
                                        f"schedule (kinds {kinds}, microbatches < {self.microbatches}, "
                                        f"chunks < {self.chunks})", self, t, d)

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def stage_of(self, device: int, chunk: int) -> int:
        """The model stage that `chunk` of `device` holds: chunk*p + device (loop,
        Megatron's mapping), or device for chunk 0 and 2p-1-device for chunk 1 (v: device 0
        holds the first and the last stage, device p-1 the two around the turn)."""
        if self.placement == "v":
            return device if chunk == 0 else 2 * self.stages - 1 - device
        return chunk * self.stages + device

    def device_of(self, stage: int) -> tuple[int, int]:
        """(device, chunk) holding model `stage`; inverse of `stage_of`."""
        if self.placement == "v":
            return (stage, 0) if stage < self.stages else (2 * self.stages - 1 - stage, 1)
        return stage % self.stages, stage // self.stages

    def cost(self, action: Action) -> int:
        """Ticks `action` occupies (on one chunk: 1/chunks of a stage's work); a W without the
        split, which construction rejects, draws as one tick in the error's timeline."""
        return self.costs.get(action.kind, 1)

    # ---- the table, read three ways ----------------------------------------------

    @functools.cached_property
    def _programs(self) -> tuple[tuple[tuple[int, Action], ...], ...]:
        progs: list[list[tuple[int, Action]]] = [[] for _ in range(self.stages)]
        for t, row in enumerate(self.actions):
            for d, a in enumerate(row):
                if a is not None:
                    progs[d].append((t, a))
        return tuple(tuple(p) for p in progs)

    def program(self, device: int) -> tuple[tuple[int, Action], ...]:
        """`device`'s actions in the order it runs them, as (start tick, Action)."""
        return self._programs[device]

    @functools.cached_property
    def total_time(self) -> int:
        """Ticks from the first start to the last end (the lecture's timeline width)."""
        return max((t + self.cost(a) for p in self._programs for t, a in p), default=0)

    def occupancy(self, device: int) -> list[Action | None]:
        """What `device` is busy with at each tick (None: idle)."""
        busy: list[Action | None] = [None] * self.total_time
        for t, a in self.program(device):
            busy[t:t + self.cost(a)] = [a] * self.cost(a)
        return busy

    @functools.cached_property
    def _where(self) -> dict[Key, tuple[int, int, Action]]:
        """(kind, microbatch, stage) -> (start tick, device, action); last one wins."""
        return {(a.kind, a.microbatch, self.stage_of(d, a.chunk)): (t, d, a)
                for d, p in enumerate(self._programs) for t, a in p}

    def start(self, kind: str, microbatch: int, stage: int) -> int:
        return self._where[kind, microbatch, stage][0]

    def end(self, kind: str, microbatch: int, stage: int) -> int:
        t, _, a = self._where[kind, microbatch, stage]
        return t + self.cost(a)

    def inputs(self, device: int, action: Action) -> list[Key]:
        """The actions whose results `action` needs: F the previous stage's F; B its own
        F and the next stage's B; W its own B. The first two cross devices: receives."""
        k, i, last = self.stage_of(device, action.chunk), action.microbatch, self.virtual_stages - 1
        if action.kind == "F":
            return [("F", i, k - 1)] if k > 0 else []
        if action.kind == "B":
            return [("F", i, k)] + ([("B", i, k + 1)] if k < last else [])
        return [("B", i, k)]

    # ---- views --------------------------------------------------------------------

    def ascii(self) -> str:
        """Header (bubble, total time, peak activations) and one row per stage, in the
        lecture's alphabet; see `viz.LEGEND`."""
        return viz.render(self)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "stages": self.stages, "microbatches": self.microbatches,
            "chunks": self.chunks, "placement": self.placement, "costs": dict(self.costs),
            "split_backward": self.split_backward,
            "units": units(self.chunks),
            "total_time": self.total_time, "stage_time": self.total_time / self.chunks,
            "bubble_fraction": self.bubble_fraction,
            "steady_bubble_fraction": self.steady_bubble_fraction,
            "peak_activations": self.peak_activations, "peak_in_flight": self.peak_in_flight,
            "programs": [[{"tick": t, "kind": a.kind, "microbatch": a.microbatch, "chunk": a.chunk,
                           "stage": self.stage_of(d, a.chunk)} for t, a in p]
                         for d, p in enumerate(self._programs)],
            "sends": [s._asdict() for s in self.sends],
        }

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def chrome_trace(self) -> dict:
        """The schedule as Chrome-trace JSON (open in ui.perfetto.dev); 1 tick = 1 ms."""
        return viz.chrome_trace(self)

    def save_png(self, path: str) -> None:
        """A timeline figure (matplotlib, imported only here)."""
        viz.save_png(self, path)

    # ---- validation -----------------------------------------------------------------

    def validate(self) -> Schedule:
        """Raise ScheduleError unless the table can run: one action at a time per device,
        every action exactly once, no deadlock with blocking receives, and each action
        starting after the actions it needs ended (construction checked kinds and indices)."""
        kinds = "FBW" if self.split_backward else "FB"
        for d, prog in enumerate(self._programs):
            for (t0, a0), (t1, a1) in zip(prog, prog[1:]):
                if t0 + self.cost(a0) > t1:
                    raise ScheduleError(f"tick {t1}, device {d}: {a1} starts while {a0} "
                                        f"(ticks {t0}..{t0 + self.cost(a0) - 1}) still runs", self, t1, d)
        seen: dict[Key, int] = {}
        for d, prog in enumerate(self._programs):
            for t, a in prog:
                key = (a.kind, a.microbatch, self.stage_of(d, a.chunk))
                if key in seen:
                    raise ScheduleError(f"tick {t}, device {d}: {a} (stage {key[2]}) is done twice; "
                                        f"first at tick {seen[key]}", self, t, d)
                seen[key] = t
        for k in range(self.virtual_stages):
            d, c = self.device_of(k)
            for i in range(self.microbatches):
                for kind in kinds:
                    if (kind, i, k) not in seen:
                        raise ScheduleError(f"device {d}: {Action(kind, i, c)} of stage {k} is "
                                            f"missing", self, None, d)
        cycle = find_deadlock([[a for _, a in p] for p in self._programs], self)
        if cycle:
            t, d, a = min(self._where[self._key(d, a)] for d, a in cycle)
            chain = " -> ".join(f"{a} on device {d}" for d, a in cycle)
            raise ScheduleError(f"tick {t}, device {d}: deadlock with blocking receives; each "
                                f"waits for the next: {chain} -> (back to the first)", self, t, d)
        for d, prog in enumerate(self._programs):
            for t, a in prog:
                for key in self.inputs(d, a):
                    if self.end(*key) > t:
                        raise ScheduleError(f"tick {t}, device {d}: {a} starts before its input "
                                            f"{key[0]}{key[1]} of stage {key[2]} ends "
                                            f"(tick {self.end(*key)})", self, t, d)
        return self

    def _key(self, device: int, action: Action) -> Key:
        return action.kind, action.microbatch, self.stage_of(device, action.chunk)


def check_sizes(stages, microbatches, chunks) -> None:
    """Refuse p, m or v that are not whole numbers >= 1 (True, 2.0 and "4" are not), or
    sizes no machine has."""
    errors.whole("stages", stages, maximum=MAX_STAGES)
    errors.whole("microbatches", microbatches, maximum=MAX_MICROBATCHES)
    errors.whole("chunks", chunks, maximum=MAX_CHUNKS)
    actions = stages * microbatches * chunks * 3
    if actions > MAX_ACTIONS:
        raise ConfigError(f"stages={stages} x microbatches={microbatches} x chunks={chunks} is {actions:,} actions, "
                          f"more than the {MAX_ACTIONS:,} a table holds here; use fewer stages or microbatches")


def check(name: str, stages, microbatches, chunks=None, *, table: bool = True) -> tuple[orders.Kind, int]:
    """What `make` refuses before it builds a table, for every figure of a named schedule
    (a closed form included): an unknown name, sizes that are not whole numbers >= 1 (with
    `table`, also past what a table holds: `check_sizes`; a closed form has no such bound),
    sizes the schedule cannot run (`Kind.requires`). Returns the registry entry and the
    chunks (the schedule's default for None)."""
    kind = orders.lookup(name)
    chunks = kind.chunks if chunks is None else chunks
    if table:
        check_sizes(stages, microbatches, chunks)
    else:
        for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
            errors.whole(what, value)
    kind.requires(name, stages, microbatches, chunks)
    return kind, chunks


def units(chunks: int) -> dict[str, str]:
    """What the figures count: with several chunks per device, an action runs on one chunk,
    1/chunks of a stage, so ticks and live activations are chunk-sized; divide by chunks for
    stages."""
    if chunks == 1:
        return {"time": "ticks (costs per action on a whole stage)", "peaks": "microbatches"}
    return {"time": f"ticks (costs per action on one chunk, 1/{chunks} of a stage; stage_time = "
                    f"total_time / {chunks})",
            "peaks": f"microbatch-chunks (each 1/{chunks} of a stage's activations)"}


def place(shape: Schedule, programs: Sequence[Sequence[Action]], duration, *, latency: float = 0, zero=0):
    """(start, end) of every action of each device's program, in its order: each at the
    earliest time its device is free and the actions it needs (`shape.inputs`) have ended,
    plus `latency` for an input from another device (a device with blocking receives).
    duration(device, action) is its length; `zero` the time the step starts. None where the
    programs deadlock (some action never gets its inputs). `simulate` places in whole
    ticks, `timing.timed` in measured times with comm."""
    ended: dict[Key, tuple[int, float]] = {}    # action -> (device, end)
    times: list[list[tuple]] = [[] for _ in programs]
    progress = True
    while progress:
        progress = False
        for d, prog in enumerate(programs):
            while len(times[d]) < len(prog):
                a = prog[len(times[d])]
                needs = shape.inputs(d, a)
                if any(k not in ended for k in needs):
                    break
                ready = [end + (latency if src != d else 0) for src, end in (ended[k] for k in needs)]
                start = max([times[d][-1][1] if times[d] else zero] + ready)
                times[d].append((start, start + duration(d, a)))
                ended[shape._key(d, a)] = (d, times[d][-1][1])
                progress = True
    return times if all(len(t) == len(p) for t, p in zip(times, programs)) else None


def simulate(name: str, stages: int, microbatches: int, chunks: int, costs: Mapping[str, int],
             split_backward: bool, programs: Sequence[Sequence[Action]],
             placement: str = "loop") -> Schedule:
    """Place each device's program in order, every action at the earliest tick at which
    its device is free and its inputs have ended (a device with blocking receives)."""
    shape = Schedule(name, stages, microbatches, chunks, dict(costs), split_backward, (), placement)
    times = place(shape, programs, lambda device, action: costs[action.kind])
    if times is None:
        chain = " -> ".join(f"{a} on device {d}" for d, a in find_deadlock(programs, shape))
        raise ConfigError(f"{name}: the device programs deadlock: {chain} -> (back to the first)")
    total = max((t[-1][1] for t in times if t), default=0)
    if total * stages > MAX_CELLS:
        raise ConfigError(f"{name} with stages={stages}, microbatches={microbatches} and costs "
                          f"{', '.join(f'{k}={c}' for k, c in costs.items())} spans {total:,} ticks: a table of "
                          f"{total * stages:,} cells, more than the {MAX_CELLS:,} one holds here. Costs are ticks "
                          "per action, small ratios such as F=1,B=2; time measured costs instead "
                          "(timing.timed with Costs(F=18.5, B=18.1, W=9.3), jaxpar schedule --costs with fractions)")
    table: list[list[Action | None]] = [[None] * stages for _ in range(total)]
    for d, (prog, starts) in enumerate(zip(programs, times)):
        for a, (t, _) in zip(prog, starts):
            table[t][d] = a
    return dataclasses.replace(shape, actions=tuple(tuple(r) for r in table))


def make(name: str, stages: int, microbatches: int, chunks: int | None = None,
         costs: Mapping[str, int] | None = None) -> Schedule:
    """Build, simulate and validate a named schedule (a name of `orders.REGISTRY`).

    chunks: model chunks per device, for a schedule that takes them (`Kind.takes_chunks`;
    default `Kind.chunks`).
    costs: ticks per kind, overriding F=1, B=2 (F=B=W=1 for the split ones, SPLIT).
    Bad input (p, m or v not a whole number >= 1 (True, 2.0, "4") or past any machine, sizes
    the schedule refuses (`Kind.requires`), an unknown name, a bad cost) raises ConfigError
    naming the value and how to fix it."""
    kind, chunks = check(name, stages, microbatches, chunks)
    full = dict(DEFAULT_SPLIT_COSTS if kind.split_backward else DEFAULT_COSTS)
    errors.mapping("costs", {} if costs is None else costs, "{'F': 1, 'B': 2}")
    for k, c in (costs or {}).items():
        if k not in full:
            raise ConfigError(f"cost {k}={c}: {name} has kinds {', '.join(full)} only"
                              + ("" if kind.split_backward
                                 else f" (W exists only with the split backward: {', '.join(SPLIT)})"))
        if not is_whole(c) or c < 1:
            raise ConfigError(f"cost {k}={c}: costs are whole ticks >= 1, e.g. {k}=1")
        full[k] = c
    programs = kind.order(stages, microbatches, chunks)
    return simulate(name, stages, microbatches, chunks, full, kind.split_backward, programs,
                    kind.placement).validate()
