"""The static half of the pipeline runtime: a Schedule turned into integer tables.

`plan(schedule)` reads the schedule's table once, in Python, and writes for every step and
device what the SPMD program must do: which branch of the `lax.switch` runs (idle, F of a
chunk, F of the last stage with the loss, B, W), which microbatch, which buffer slot holds
its input, where its residuals go, and where its output lands on the receiving device.
The runtime (`runtime.py`) only indexes these tables with `lax.axis_index("pp")`.

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
gradient of the last stage, the turn of the V layout), to the next device (`right`: d ->
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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.pipeline.schedule import Schedule

LANES = ("B", "F")  # run in this order within a step: B frees a slot that F may take
# fields of one table entry (step, device). A receive field {lane}_{channel}_{buffer} is the
# slot where that lane's output lands: channel local (the device's own), from_left (sent
# right by d - 1) or from_right (sent left by d + 1), buffer x or g.
FIELDS = ("f_branch", "f_chunk", "f_microbatch", "from_batch", "x_read", "res_write",
          "b_branch", "b_microbatch", "b_chunk", "g_read", "res_read", "gw_write", "dx_write",
          "F_local_x", "F_from_left_x", "F_from_right_x", "F_local_g",
          "B_local_g", "B_from_left_g", "B_from_right_g")
F = {name: i for i, name in enumerate(FIELDS)}
F_BRANCHES = ("idle", "F", "F_last")   # f_branch: F_last is F of the last stage, with the loss
B_BRANCHES = ("idle", "B", "W")        # b_branch; the chunk is f_chunk / b_chunk
# the named scopes of the program's branches, innermost first (program.py; lane_runs)
LANE_SCOPES = ("pipeline_first", "pipeline_loss", "pipeline_first_backward", "pipeline_F", "pipeline_B", "pipeline_W")


def scope(lane: str, direction: str) -> str:
    """The named scope of a channel's ppermute in the compiled program."""
    return f"pipeline_send_{lane}_{direction}"


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """schedule's tables: `table[step, device, field]` (FIELDS), slot counts, the schedule
    tick each step starts at; `sends` the (lane, direction) channels the schedule uses and
    `flags[step, channel]` whether that channel sends at that step; `pairs[lane,
    direction]` the (source, destination) devices of its ppermute; `channels` the
    receive fields used."""

    schedule: Schedule
    table: np.ndarray
    ticks: tuple[int, ...]
    n_x: int
    n_g: int
    n_res: int
    sends: tuple[tuple[str, str], ...]
    flags: np.ndarray
    pairs: dict
    channels: frozenset
    transfers: int

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
        return {scope(*ch): int(self.flags[:, j].sum()) for j, ch in enumerate(self.sends)}

    def lane_runs(self, device: int) -> dict[str, int]:
        """{scope of LANE_SCOPES: steps in which that branch runs on pp rank `device`}."""
        rows = self.table[:, device]
        f, b = rows[:, F["f_branch"]], rows[:, F["b_branch"]]
        m = self.schedule.microbatches
        return {"pipeline_F": int((f > 0).sum()), "pipeline_first": int(((f > 0) & (rows[:, F["from_batch"]] > 0)).sum()),
                "pipeline_loss": int((f == F_BRANCHES.index("F_last")).sum()),
                "pipeline_B": int((b == B_BRANCHES.index("B")).sum()), "pipeline_W": int((b == B_BRANCHES.index("W")).sum()),
                "pipeline_first_backward": int(((b == B_BRANCHES.index("B")) & (rows[:, F["dx_write"]] < m)).sum())}



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


def _lane(kind: str) -> str:
    return "F" if kind == "F" else "B"


def _steps(s: Schedule) -> tuple[dict, list[int]]:
    """Step of every action (kind, microbatch, stage), and the tick each step starts at."""
    step: dict = {}
    prev: dict[int, tuple[str, int]] = {}
    order = sorted((t, d, a) for d in range(s.stages) for t, a in s.program(d))
    ticks: dict[int, int] = {}
    for t, d, a in order:
        lane = _lane(a.kind)
        j = 1 + max((step[key] for key in s.inputs(d, a)), default=-1)
        if d in prev:
            p_lane, p_step = prev[d]
            j = max(j, p_step if (p_lane, lane) == ("B", "F") else p_step + 1)
        step[s._key(d, a)] = j
        prev[d] = (lane, j)
        ticks.setdefault(j, t)
    return step, [ticks[j] for j in range(max(ticks) + 1)] if ticks else []


def plan(s: Schedule) -> Plan:
    """The tables for schedule `s` (validated first: a table that cannot run raises
    ScheduleError, a ValueError)."""
    s.validate()
    p, m, last = s.stages, s.microbatches, s.virtual_stages - 1
    at, ticks = _steps(s)

    # Deliveries: (receiver, buffer, key (i, stage), arrival step, consume step, field)
    deliveries, sends = [], set()  # sends: (step, lane, direction, src, dst)
    for d in range(p):
        for _, a in s.program(d):
            k, i = s.stage_of(d, a.chunk), a.microbatch
            j = at["F" if a.kind == "F" else a.kind, i, k]
            if a.kind == "F" and k == last:  # the loss gradient stays here for this stage's B
                deliveries.append((d, "g", (i, k), j, at["B", i, k], "F_local_g"))
                continue
            if a.kind == "F":
                target, buf, lane = k + 1, "x", "F"
            elif a.kind == "B" and k > 0:
                target, buf, lane = k - 1, "g", "B"
            else:
                continue
            consume = at["F" if buf == "x" else "B", i, target]
            dd = s.device_of(target)[0]
            if dd == d:
                ch = "local"
            else:
                right, left = dd == (d + 1) % p, dd == (d - 1) % p
                # p = 2: both neighbours are one device; activations go right, gradients left
                direction = "right" if right and (lane == "F" or not left) else "left"
                sends.add((j, lane, direction, d, dd))
                ch = "from_left" if direction == "right" else "from_right"
            deliveries.append((dd, buf, (i, target), j, consume, f"{lane}_{ch}_{buf}"))

    slots, n = {}, {}
    for buf in ("x", "g"):
        n[buf] = 0
        for d in range(p):
            where, c = _allocate([(a, c, key) for dd, b, key, a, c, _ in deliveries if dd == d and b == buf])
            slots.update({(d, buf, key): w for key, w in where.items()})
            n[buf] = max(n[buf], c)
    res_slot, n_res = {}, 0
    for d in range(p):
        ivs = [(at["F", a.microbatch, s.stage_of(d, a.chunk)],
                at["W" if s.split_backward else "B", a.microbatch, s.stage_of(d, a.chunk)],
                (a.microbatch, s.stage_of(d, a.chunk))) for _, a in s.program(d) if a.kind == "F"]
        where, c = _allocate(ivs)
        res_slot.update({(d, key): w for key, w in where.items()})
        n_res = max(n_res, c)

    table = np.zeros((len(ticks), p, len(FIELDS)), np.int32)
    for name in FIELDS[FIELDS.index("F_local_x"):]:
        table[:, :, F[name]] = n[name[-1]]              # the trash slot
    table[:, :, F["res_write"]] = table[:, :, F["gw_write"]] = n_res
    table[:, :, F["dx_write"]] = m
    for d in range(p):
        for _, a in s.program(d):
            i, c = a.microbatch, a.chunk
            k = s.stage_of(d, c)
            row = table[at[a.kind, i, k], d]
            if a.kind == "F":
                row[F["f_branch"]] = F_BRANCHES.index("F_last" if k == last else "F")
                row[F["f_chunk"]], row[F["f_microbatch"]], row[F["res_write"]] = c, i, res_slot[d, (i, k)]
                if k == 0:
                    row[F["from_batch"]] = 1
                else:
                    row[F["x_read"]] = slots[d, "x", (i, k)]
                continue
            row[F["b_branch"]] = B_BRANCHES.index(a.kind)
            row[F["b_microbatch"]], row[F["b_chunk"]], row[F["res_read"]] = i, c, res_slot[d, (i, k)]
            if a.kind == "B":
                row[F["g_read"]] = slots[d, "g", (i, k)]
                if s.split_backward:
                    row[F["gw_write"]] = res_slot[d, (i, k)]
                if k == 0:
                    row[F["dx_write"]] = i
    for dd, buf, key, j, _, field in deliveries:
        table[j, dd, F[field]] = slots[dd, buf, key]

    used = tuple(sorted({(lane, direction) for _, lane, direction, _, _ in sends}))
    flags = np.zeros((len(ticks), len(used)), bool)
    pairs = {}
    for j, lane, direction, src, dst in sends:
        flags[j, used.index((lane, direction))] = True
        pairs.setdefault((lane, direction), set()).add((src, dst))
    return Plan(schedule=s, table=table, ticks=tuple(ticks), n_x=n["x"], n_g=n["g"], n_res=n_res,
                sends=used, flags=flags, pairs={k: tuple(sorted(v)) for k, v in pairs.items()},
                channels=frozenset(field for *_, field in deliveries), transfers=len(sends))


def ascii_steps(pl: Plan) -> str:
    """The SPMD steps the runtime executes, one row per device, one cell per step: the
    backward lane then the forward lane ("B0F4": B of microbatch 0, then F of 4; W for
    the weight gradient; chunk c > 0 as ".c"; "." idle). Arrows mark the steps that send."""
    s, t = pl.schedule, pl.table

    def cell(j: int, d: int) -> str:
        e = t[j, d]
        out = ""
        kind, c = B_BRANCHES[e[F["b_branch"]]], e[F["b_chunk"]]
        if kind != "idle":
            out += f"{kind}{e[F['b_microbatch']]}" + (f".{c}" if c else "")
        kind, c = F_BRANCHES[e[F["f_branch"]]], e[F["f_chunk"]]
        if kind != "idle":
            out += f"F{e[F['f_microbatch']]}" + (f".{c}" if c else "")
        return out or "."

    cells = [[cell(j, d) for j in range(pl.steps)] for d in range(s.stages)]
    width = max(len(c) for row in cells for c in row)
    lines = [f"{s.name}: p={s.stages} m={s.microbatches}" + (f" v={s.chunks}" if s.chunks > 1 else "")
             + f", {pl.steps} SPMD steps for {s.total_time} schedule ticks, {pl.permutes} collective-permutes"]
    for d, row in enumerate(cells):
        lines.append(f"device {d}: " + " ".join(c.ljust(width) for c in row))
    return "\n".join(lines)
