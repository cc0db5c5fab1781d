"""The static half of the pipeline runtime: a Schedule turned into integer tables.

`plan(schedule)` reads the schedule's table once, in Python, and writes for every step and
device what the SPMD program must do (a `Row`): which branch of the `lax.switch` runs
(idle, F of a chunk, F of the last stage with the loss, B, W), which microbatch, which
buffer slot holds its input, where its residuals go, and where its output lands on the
receiving device. It does so in four phases: place each action at a step (`_place`),
route each output to the device and buffer that consume it (`_route`), allocate the
buffers' slots (`_allocate_slots`) and write the table (`_write_table`). The program
(`program.py`) only indexes the table with `lax.axis_index("pp")`.

SPMD devices move in lockstep: a step lasts as long as its slowest device. A step therefore
has two lanes per device, a backward lane (B or W) and then a forward lane (F), so that in
1F1B's steady state every device does one B and one F per step, as the schedule has it,
rather than a step of B on one device waiting beside an F on the next. Each action goes,
in the order of the schedule's ticks, to the earliest step that respects
  * its inputs: produced at an earlier step (data moves at the end of a step);
  * its device's order: after the action before it, in the same step only when that one
    is a B or W and this an F (the backward lane runs first);
so every device runs exactly its program, in its order, and the residual slots follow.
At the end of every step each lane's output moves: to the device itself (the loss
gradient of the last stage, the turn of the V placement), to the next device (`right`: d ->
d + 1, wrapping for interleaved chunks) or to the previous one (`left`). The program is
ONE `lax.scan` over the steps, whatever p and m: its size does not grow with m. Each
(lane, direction) the schedule ever uses is a channel, a `ppermute` under a `lax.cond`
that the step's row of `flags` opens (the same on every device, so all take the same
branch): the collective-permutes that run are exactly the schedule's, one per step, lane
and direction in which some device sends (`permutes`); together they carry every one of
`Schedule.sends`. A channel's ppermute sits in the named scope `scope(lane, direction)`,
so the accounting (`runs`) can tell the compiled program which of its conditional
collectives run how often.

Buffers hold, per device, `slots + 1` entries; the last is the trash slot that writes with
nothing to write go to, so no step needs a conditional write. Slot counts are the most
entries a device ever holds at once:
  x   activations received, waiting for their F;
  g   output gradients received (or the loss gradient), waiting for their B;
  res the vjp residuals of an F, until its B (or W when the backward is split): the
      schedule's `peak_in_flight`, so the compiled memory follows the schedule.

How many layers each model stage holds when stages are uneven is `stage_layers.py`; here
`Plan.layer_runs` counts the layers a device runs in each branch of one step.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from jaxpar.schedules.schedule import Schedule

LANES = ("B", "F")  # run in this order within a step: B frees a slot that F may take
F_BRANCHES = ("idle", "F", "F_last")   # Row.f_branch: F_last is F of the last stage, with the loss
B_BRANCHES = ("idle", "B", "W")        # Row.b_branch
# the named scopes of the program's branches, innermost first (program.py; lane_runs)
LANE_SCOPES = ("pipeline_first", "pipeline_loss", "pipeline_first_backward", "pipeline_F", "pipeline_B", "pipeline_W")
# with uneven stages, the named scope of one real (not padding) layer inside a stage's scan:
# it runs as many times per F, B or W as the chunk holds layers (`layer_runs`)
LAYER_SCOPE = "pipeline_layer"


class Row(NamedTuple):
    """One entry of `Plan.table`: what one device does at one step. Each field is an int
    here and an int32 scalar in the program, which reads its device's row of the step's
    table with `lax.axis_index("pp")`. A slot indexes a buffer (`x`, `g`, `res`, `gw`),
    whose last slot is the trash slot: a write with nothing to write goes there."""

    # the forward lane
    f_branch: int       # F_BRANCHES index: idle, F, or F of the last stage and the loss
    f_chunk: int        # the chunk F runs
    f_microbatch: int   # the microbatch F runs
    from_batch: int     # 1: F's input is its microbatch of the batch (stage 0); 0: x[x_read]
    x_read: int         # the slot of x that holds F's input
    res_write: int      # the slot of res that F's residuals go to
    # the backward lane
    b_branch: int       # B_BRANCHES index: idle, B or W
    b_microbatch: int   # the microbatch B or W runs
    b_chunk: int        # the chunk B or W runs
    g_read: int         # the slot of g that holds B's output gradient
    res_read: int       # the slot of res that holds the residuals of B's (or W's) F
    gw_write: int       # the slot of gw where a split B keeps its output gradients for W
    dx_write: int       # the microbatch whose d loss / d inputs B gives (stage 0); m: none
    # deliveries, {lane}_{source}_{buffer}: the slot where that lane's output lands, by
    # source: local (this device's own), from_left (sent right by d - 1), from_right
    # (sent left by d + 1); buffer x (an activation) or g (an output gradient)
    F_local_x: int
    F_from_left_x: int
    F_from_right_x: int
    F_local_g: int      # the loss gradient of the last stage, for its own B
    B_local_g: int
    B_from_left_g: int
    B_from_right_g: int


FIELDS: dict[str, int] = {name: column for column, name in enumerate(Row._fields)}   # field -> table column
DELIVERY_FIELDS = Row._fields[FIELDS["F_local_x"]:]


def delivery_field(lane: str, direction: str | None, buffer: str) -> str:
    """The Row field where `lane`'s output lands in `buffer` when it moves `direction`
    (right, left, or None: it stays on the device)."""
    source = "local" if direction is None else "from_left" if direction == "right" else "from_right"
    return f"{lane}_{source}_{buffer}"


def scope(lane: str, direction: str) -> str:
    """The named scope of a channel's ppermute in the compiled program."""
    return f"pipeline_send_{lane}_{direction}"


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """schedule's tables: `table[step, device, column]` (a `Row` per step and device,
    columns `FIELDS`), slot counts, the schedule tick each step starts at; `channels` the
    (lane, direction) pairs the schedule sends on and `flags[step, channel]` whether that
    channel sends at that step; `pairs[lane, direction]` the (source, destination)
    devices of its ppermute; `deliveries` the delivery fields used; `n_sends` the sends
    (`Schedule.sends`) the channels carry."""

    schedule: Schedule
    table: np.ndarray
    ticks: tuple[int, ...]
    n_x: int
    n_g: int
    n_res: int
    channels: tuple[tuple[str, str], ...]
    flags: np.ndarray
    pairs: dict
    deliveries: frozenset
    n_sends: int

    @property
    def steps(self) -> int:
        return len(self.ticks)

    @property
    def scans(self) -> int:
        """`lax.scan`s over steps in the program: one, for every schedule, p and m."""
        return 1 if self.steps else 0

    @property
    def permutes(self) -> int:
        """collective-permute executions per pipeline step: one per (step, lane, direction)
        in which at least one device sends."""
        return int(self.flags.sum())

    def runs(self) -> dict[str, int]:
        """{scope of a channel's ppermute: steps in which it runs}."""
        return {scope(*ch): int(self.flags[:, j].sum()) for j, ch in enumerate(self.channels)}

    def lane_runs(self, device: int, chunk: int | None = None) -> dict[str, int]:
        """{scope of LANE_SCOPES: steps in which that branch runs on pp rank `device`}
        (on its chunk `chunk` only, if given)."""
        rows = Row(*self.table[:, device].T)   # each field: [steps]
        f, b, m = rows.f_branch, rows.b_branch, self.schedule.microbatches
        if chunk is not None:
            f, b = np.where(rows.f_chunk == chunk, f, 0), np.where(rows.b_chunk == chunk, b, 0)
        backward = b == B_BRANCHES.index("B")
        return {"pipeline_F": int((f > 0).sum()), "pipeline_first": int(((f > 0) & (rows.from_batch > 0)).sum()),
                "pipeline_loss": int((f == F_BRANCHES.index("F_last")).sum()),
                "pipeline_B": int(backward.sum()), "pipeline_W": int((b == B_BRANCHES.index("W")).sum()),
                "pipeline_first_backward": int((backward & (rows.dx_write < m)).sum())}

    def layer_runs(self, device: int, layers_per_stage: tuple[int, ...]) -> dict[str, int]:
        """{scope of LANE_SCOPES: the layers pp rank `device` runs in that branch in one
        step}: each run of a branch on chunk c runs its stage's layers_per_stage count."""
        out = dict.fromkeys(LANE_SCOPES, 0)
        for c in range(self.schedule.chunks):
            held = layers_per_stage[self.schedule.stage_of(device, c)]
            for name, n in self.lane_runs(device, c).items():
                out[name] += held * n
        return out


def plan(s: Schedule) -> Plan:
    """The tables for schedule `s` (validated first: a table that cannot run raises
    ScheduleError, a ValueError), in four phases: place each action at a step, route each
    output to the device and buffer that consume it, allocate the buffers' slots, and
    write the table."""
    s.validate()
    at, ticks = _place(s)
    deliveries, sends = _route(s, at)
    slots = _allocate_slots(s, at, deliveries)
    table = _write_table(s, at, deliveries, slots, steps=len(ticks))
    channels, flags, pairs = _channels(sends, steps=len(ticks))
    return Plan(schedule=s, table=table, ticks=tuple(ticks), n_x=slots.counts["x"], n_g=slots.counts["g"],
                n_res=slots.counts["res"], channels=channels, flags=flags, pairs=pairs,
                deliveries=frozenset(d.field for d in deliveries), n_sends=len(sends))


# ---- the four phases ----------------------------------------------------------------------

def _lane(kind: str) -> str:
    return "F" if kind == "F" else "B"


def _place(s: Schedule) -> tuple[dict, list[int]]:
    """Phase 1: the step of every action, {(kind, microbatch, stage): step}, and the tick
    each step starts at. Actions are taken in tick order; each goes to the earliest step
    after its inputs' (data moves at the end of a step) and after the action before it on
    its device, or beside it when that one is a B or W and this an F."""
    step: dict = {}
    previous: dict[int, tuple[str, int]] = {}   # device -> (lane, step) of its last action
    ticks: dict[int, int] = {}
    for t, d, a in sorted((t, d, a) for d in range(s.stages) for t, a in s.program(d)):
        lane = _lane(a.kind)
        j = 1 + max((step[key] for key in s.inputs(d, a)), default=-1)
        if d in previous:
            prev_lane, prev_step = previous[d]
            j = max(j, prev_step if (prev_lane, lane) == ("B", "F") else prev_step + 1)
        step[s._key(d, a)] = j
        previous[d] = (lane, j)
        ticks.setdefault(j, t)
    return step, [ticks[j] for j in range(max(ticks) + 1)] if ticks else []


class Delivery(NamedTuple):
    """A lane's output landing in a buffer of the device that consumes it."""
    device: int              # the receiving device
    buffer: str              # x (an activation, for F) or g (an output gradient, for B)
    key: tuple[int, int]     # (microbatch, stage) of the action that consumes it
    arrives: int             # the step at whose end it lands
    consumed: int            # the step at whose start it is read
    field: str               # the Row field that names its slot


class Send(NamedTuple):
    """One device's output moving to a neighbour at the end of a step: one of
    `Schedule.sends`, placed at its step and on its channel (lane, direction)."""
    step: int
    lane: str
    direction: str           # right: d -> d + 1 (wrapping); left: d -> d - 1
    source: int
    destination: int


def _route(s: Schedule, at: dict) -> tuple[list[Delivery], set[Send]]:
    """Phase 2: where every output goes. F's activation goes to the next stage's F (the
    last stage's loss gradient stays for its own B); B's input gradient to the previous
    stage's B (stage 0's goes nowhere: it is d loss / d inputs); W sends nothing. An
    output for another device is a send to a neighbour."""
    last = s.virtual_stages - 1
    deliveries, sends = [], set()
    for d in range(s.stages):
        for _, a in s.program(d):
            k, i = s.stage_of(d, a.chunk), a.microbatch
            j = at[a.kind, i, k]
            if a.kind == "F" and k == last:
                deliveries.append(Delivery(d, "g", (i, k), j, at["B", i, k], delivery_field("F", None, "g")))
                continue
            if a.kind == "F":
                target, buffer, lane = k + 1, "x", "F"
            elif a.kind == "B" and k > 0:
                target, buffer, lane = k - 1, "g", "B"
            else:
                continue
            receiver, direction = s.device_of(target)[0], None
            if receiver != d:
                right, left = receiver == (d + 1) % s.stages, receiver == (d - 1) % s.stages
                # p = 2: both neighbours are one device; activations go right, gradients left
                direction = "right" if right and (lane == "F" or not left) else "left"
                sends.add(Send(j, lane, direction, d, receiver))
            consumed = at["F" if buffer == "x" else "B", i, target]
            deliveries.append(Delivery(receiver, buffer, (i, target), j, consumed,
                                       delivery_field(lane, direction, buffer)))
    return deliveries, sends


class Slots(NamedTuple):
    """Phase 3's result: the slot of every buffered value and each buffer's slot count."""
    where: dict    # (device, buffer, (microbatch, stage)) -> slot; buffer x, g or res
    counts: dict   # buffer -> slots: the most entries one device ever holds at once


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Lowest-free slot for each (written at the end of step `a`, read at the start of step
    `c`, key); a slot read at step c can be written again at the end of step c."""
    free_at: list[int] = []  # per slot, the step from whose end it may be written again
    where = {}
    for a, c, key in sorted(intervals, key=lambda t: (t[0], t[1])):
        slot = next((j for j, f in enumerate(free_at) if f <= a), len(free_at))
        if slot == len(free_at):
            free_at.append(0)
        free_at[slot] = c
        where[key] = slot
    return where, len(free_at)


def _allocate_slots(s: Schedule, at: dict, deliveries: list[Delivery]) -> Slots:
    """Phase 3: slots for x and g (from the step a delivery lands to the step it is read)
    and res (from F to its B, or to its W when the backward is split), on each device."""
    where, counts = {}, {"x": 0, "g": 0, "res": 0}
    for buffer in ("x", "g"):
        for d in range(s.stages):
            slot, n = _allocate([(delivery.arrives, delivery.consumed, delivery.key) for delivery in deliveries
                                 if delivery.device == d and delivery.buffer == buffer])
            where.update({(d, buffer, key): j for key, j in slot.items()})
            counts[buffer] = max(counts[buffer], n)
    freed_by = "W" if s.split_backward else "B"
    for d in range(s.stages):
        keys = [(a.microbatch, s.stage_of(d, a.chunk)) for _, a in s.program(d) if a.kind == "F"]
        slot, n = _allocate([(at["F", i, k], at[freed_by, i, k], (i, k)) for i, k in keys])
        where.update({(d, "res", key): j for key, j in slot.items()})
        counts["res"] = max(counts["res"], n)
    return Slots(where=where, counts=counts)


def _write_table(s: Schedule, at: dict, deliveries: list[Delivery], slots: Slots, *, steps: int) -> np.ndarray:
    """Phase 4: the table [step, device, column]. Every entry starts idle, its writes to
    the trash slots (and dx_write = m: no input gradient); then each action fills its
    lane's fields at its step, and each delivery its slot on the receiving device."""
    table = np.zeros((steps, s.stages, len(FIELDS)), np.int32)
    for name in DELIVERY_FIELDS:
        table[:, :, FIELDS[name]] = slots.counts[name[-1]]
    table[:, :, FIELDS["res_write"]] = table[:, :, FIELDS["gw_write"]] = slots.counts["res"]
    table[:, :, FIELDS["dx_write"]] = s.microbatches
    last = s.virtual_stages - 1
    for d in range(s.stages):
        for _, a in s.program(d):
            i, c = a.microbatch, a.chunk
            k = s.stage_of(d, c)
            row, res = table[at[a.kind, i, k], d], slots.where[d, "res", (i, k)]
            if a.kind == "F":
                _set(row, f_branch=F_BRANCHES.index("F_last" if k == last else "F"), f_chunk=c, f_microbatch=i,
                     res_write=res)
                _set(row, **({"from_batch": 1} if k == 0 else {"x_read": slots.where[d, "x", (i, k)]}))
                continue
            _set(row, b_branch=B_BRANCHES.index(a.kind), b_microbatch=i, b_chunk=c, res_read=res)
            if a.kind == "B":
                _set(row, g_read=slots.where[d, "g", (i, k)])
                if s.split_backward:
                    _set(row, gw_write=res)
                if k == 0:
                    _set(row, dx_write=i)
    for delivery in deliveries:
        table[delivery.arrives, delivery.device, FIELDS[delivery.field]] = \
            slots.where[delivery.device, delivery.buffer, delivery.key]
    return table


def _set(row: np.ndarray, **fields: int) -> None:
    for name, value in fields.items():
        row[FIELDS[name]] = value


def _channels(sends: set[Send], *, steps: int) -> tuple[tuple, np.ndarray, dict]:
    """The (lane, direction) channels the sends use, sorted; flags[step, channel]:
    whether any device sends on it at that step; each channel's (source, destination) pairs."""
    channels = tuple(sorted({(t.lane, t.direction) for t in sends}))
    flags = np.zeros((steps, len(channels)), bool)
    pairs: dict = {}
    for t in sends:
        flags[t.step, channels.index((t.lane, t.direction))] = True
        pairs.setdefault((t.lane, t.direction), set()).add((t.source, t.destination))
    return channels, flags, {k: tuple(sorted(v)) for k, v in pairs.items()}


def ascii_steps(pl: Plan) -> str:
    """The SPMD steps the runtime executes, one row per device, one cell per step: the
    backward lane then the forward lane ("B0F4": B of microbatch 0, then F of 4; W for
    the weight gradient; chunk c > 0 as ".c"; "." idle). Arrows mark the steps that send."""
    s, t = pl.schedule, pl.table

    def cell(j: int, d: int) -> str:
        row, out = Row(*t[j, d]), ""
        if row.b_branch:
            out += f"{B_BRANCHES[row.b_branch]}{row.b_microbatch}" + (f".{row.b_chunk}" if row.b_chunk else "")
        if row.f_branch:
            out += f"F{row.f_microbatch}" + (f".{row.f_chunk}" if row.f_chunk else "")
        return out or "."

    cells = [[cell(j, d) for j in range(pl.steps)] for d in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    lines = [f"{s.name}: p={s.stages} m={s.microbatches}" + (f" v={s.chunks}" if s.chunks > 1 else "")
             + f", {pl.steps} SPMD steps for {s.total_time} schedule ticks, {pl.permutes} collective-permutes"]
    for d, row in enumerate(cells):
        lines.append(f"device {d}: " + " ".join(c.ljust(width) for c in row))
    return "\n".join(lines)
