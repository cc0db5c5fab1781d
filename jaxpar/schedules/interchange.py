"""Schedules exchanged with torch.pipelining, in its CSV schedule format.

torch.distributed.pipelining writes a schedule (`_PipelineScheduleRuntime._dump_csv`) as
one CSV row per rank and one cell per step: an action `{stage}{type}{microbatch}` (`0F0`,
`3I2`) or an empty cell where the rank idles. Its computation types map to jaxpar's kinds:

    torch   meaning                         jaxpar
    F       forward                         F
    B       full backward                   B  (split_backward=False), or B then W when split
    I       backward, input gradient        B  (split_backward=True)
    W       backward, weight gradient       W
    (0F3;3B1)OVERLAP_F_B                    its actions in order (DualPipeV runs them together)
    SEND_F RECV_F SEND_B RECV_B UNSHARD     skipped: jaxpar's plan derives its sends from
    RESHARD REDUCE_GRAD                     the table, and reduces gradients once per step

The stage in a cell is the model stage; jaxpar's table holds (device, chunk), so the import
reads each rank's set of stages back into chunks per device and their placement (`loop`:
stage c*p + d, Megatron's; `v`: d and 2p-1-d, ZB-V's and DualPipeV's).

    text = to_csv(schedule.make("zb-h1", stages=4, microbatches=8))     # torch's `_load_csv` reads it
    s = from_csv(open("schedule.csv").read())                            # a torch file, checked
    s = from_csv(text, timing="columns")                                 # keep its columns as ticks

A torch file is an order per rank (torch's runtime ignores the empty cells). `timing="order"`
(the default) keeps only that order and places every action at the earliest tick its device
and inputs allow (`schedule.simulate`, as `schedule.make` does); `timing="columns"` takes
each column as a tick, as the file draws it, so that `to_csv` writes the same text back.
Pure Python: never imports JAX.
"""

from __future__ import annotations

import csv
import io
import operator
import re
from collections.abc import Mapping

from jaxpar.errors import ConfigError
from jaxpar.schedules import schedule as schedule_lib
from jaxpar.schedules.orders import Action, find_deadlock
from jaxpar.schedules.schedule import Schedule, ScheduleError

__all__ = ["to_csv", "from_csv", "TIMINGS", "SKIPPED"]

TIMINGS = ("order", "columns")
# torch's communication and FSDP actions: jaxpar derives the sends from the table itself
SKIPPED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")
_ACTION = re.compile(r"(\d+)(F|I|B|W)(\d+)")
_SKIPPED = re.compile(r"(\d+)(" + "|".join(SKIPPED) + r")(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_EXAMPLE = "write [stage][F|I|B|W][microbatch], e.g. 0F0 or 3I2, or leave the cell empty"


def to_csv(schedule: Schedule) -> str:
    """`schedule` as torch.pipelining's CSV: row d is device d, column t is tick t, each
    action `{stage}{type}{microbatch}` with type F, B (full backward) or, when the backward is
    split, I (input gradient, jaxpar's B) and W; an empty cell where the device starts
    nothing (an action of several ticks leaves the cells after it empty). Rows end at their
    last action and lines end in "\\r\\n", as torch's csv.writer writes them: write the text
    with `open(path, "w", newline="")` and torch's `_load_csv` reads it."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"to_csv takes a Schedule, not a {type(schedule).__name__}: "
                          "to_csv(schedule.make('1f1b', stages=4, microbatches=8))")
    backward = "I" if schedule.split_backward else "B"
    rows = []
    for device in range(schedule.stages):
        cells = [""] * schedule.total_time
        for tick, action in schedule.program(device):
            kind = backward if action.kind == "B" else action.kind
            cells[tick] = f"{schedule.stage_of(device, action.chunk)}{kind}{action.microbatch}"
        while cells and not cells[-1]:
            cells.pop()
        rows.append(cells)
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


class _Cell:
    """One compute action of the file: where it is (row = rank, column = step), the stage
    it runs, torch's type (F, I, B, W) and its microbatch."""

    __slots__ = ("row", "column", "stage", "kind", "microbatch")

    def __init__(self, row: int, column: int, stage: int, kind: str, microbatch: int):
        self.row, self.column, self.stage, self.kind, self.microbatch = row, column, stage, kind, microbatch

    @property
    def where(self) -> str:
        return f"row {self.row} (rank {self.row}), column {self.column}"


def _parse(text: str) -> list[list[_Cell]]:
    """The compute actions of each row, in order (an OVERLAP_F_B cell gives its actions, in
    the order written); communication actions skipped. Unknown cells raise ConfigError."""
    if not isinstance(text, str):
        raise ConfigError(f"from_csv takes the file's text (a str), not a {type(text).__name__}: "
                          f"from_csv(open(path).read())")
    lines = list(csv.reader(io.StringIO(text)))
    while lines and not any(cell.strip() for cell in lines[-1]):
        lines.pop()
    if not lines:
        raise ConfigError("the CSV has no rows: torch writes one row per rank, e.g. \"0F0,0B0\"")
    rows = []
    for row, line in enumerate(lines):
        cells = []
        for column, text_cell in enumerate(line):
            cells += _cells(text_cell.strip(), row, column)
        if not cells:
            raise ConfigError(f"row {row} (rank {row}) has no compute action: every rank runs at least one "
                              f"stage; remove the row or give it its stage's actions")
        rows.append(cells)
    return rows


def _cells(text: str, row: int, column: int) -> list[_Cell]:
    """The compute actions of one cell (none for an empty or communication cell)."""
    if not text or _SKIPPED.fullmatch(text):
        return []
    overlap = _OVERLAP.fullmatch(text)
    parts = overlap.group(1).split(";") if overlap else [text]
    out = []
    for part in parts:
        match = _ACTION.fullmatch(part.strip())
        if match is None:
            raise ConfigError(f"row {row} (rank {row}), column {column}: {text!r} is not a torch.pipelining "
                              f"action; {_EXAMPLE} (communication actions {', '.join(SKIPPED)} are skipped)")
        stage, kind, microbatch = match.groups()
        out.append(_Cell(row, column, int(stage), kind, int(microbatch)))
    return out


def _placement(rows: list[list[_Cell]], placement: str | None) -> tuple[int, str]:
    """(chunks per device, placement) read off the stages each row holds (`placement`, when
    given, is checked instead; at p = 1 or chunks = 1 `loop` and `v` hold the same stages, and loop is
    read); a stage on two rows, a missing stage or a mapping jaxpar does not place raises
    ConfigError."""
    first: dict[int, _Cell] = {}
    for cells in rows:
        for cell in cells:
            seen = first.setdefault(cell.stage, cell)
            if seen.row != cell.row:
                raise ConfigError(f"{cell.where}: stage {cell.stage} is on rank {cell.row} and on rank {seen.row} "
                                  f"({seen.where}); a stage lives on one rank: renumber one of them")
    p, total = len(rows), max(first) + 1
    if total % p:
        raise ConfigError(f"{total} stages over {p} ranks: each rank holds the same number of stages (chunks); "
                          f"use a multiple of {p} stages")
    chunks = total // p
    schedule_lib.check_sizes(p, 1, chunks)
    for stage in range(total):
        if stage not in first:
            raise ConfigError(f"stage {stage} appears in no row, but stage {total - 1} does: stages are "
                              f"0..{total - 1} with every one on a rank; renumber the stages")
    held = [sorted({cell.stage for cell in cells}) for cells in rows]
    if placement is not None and placement not in schedule_lib.PLACEMENTS:
        raise ConfigError(f"placement={placement!r}: one of {', '.join(schedule_lib.PLACEMENTS)}, or None to read it "
                          f"off the file")
    if placement == "v" and chunks != 2:
        raise ConfigError(f"placement='v' holds 2 stages per rank, but this file has {chunks}: drop placement")
    candidates = (placement,) if placement else ("loop", "v") if chunks == 2 else ("loop",)
    expected = {candidate: _held_by(p, chunks, candidate) for candidate in candidates}
    for candidate, stages in expected.items():
        if held == stages:
            return chunks, candidate
    row = next(d for d in range(p) if held[d] != expected[candidates[0]][d])
    wanted = " or ".join(f"{stages[row]} ({candidate})" for candidate, stages in expected.items())
    raise ConfigError(f"row {row} (rank {row}) holds stages {held[row]}, but jaxpar places {wanted} there (loop: "
                      f"stage c*p + rank for chunk c; v: rank and 2p-1-rank); renumber the stages")


def _held_by(p: int, chunks: int, placement: str) -> list[list[int]]:
    """The stages each of p devices holds under `placement` (Schedule.stage_of), sorted."""
    shape = Schedule("placement", p, 1, chunks, dict(schedule_lib.DEFAULT_COSTS), False, (), placement)
    return [sorted(shape.stage_of(device, chunk) for chunk in range(chunks)) for device in range(p)]


def from_csv(text: str, *, name: str = "imported", microbatches: int | None = None, timing: str = "order",
             costs: Mapping[str, int] | None = None, placement: str | None = None) -> Schedule:
    """A torch.pipelining CSV schedule (the file's text) as a validated jaxpar Schedule.

    Read off the file: p = its rows, the chunks per device and their placement (from the
    stages of each row), whether the backward is split (any I or W; a full B in such a file
    becomes B then W), m = the largest microbatch + 1.
    name: the Schedule's name. microbatches: m, checked against the file (default: read off it).
    timing: "order" (each row's order, placed at the earliest ticks as `schedule.make` does)
      or "columns" (column t is tick t; one action per cell).
    costs: ticks per kind, as `schedule.make` takes them; default jaxpar's (F=1, B=2; F=B=W=1
      when split) for "order", one tick per column for "columns".
    placement: "loop" or "v", checked against the file (default: read off it; with one rank
      both hold the same stages, and a file gives no sign which one it meant: loop is read).
    A file that is not a schedule (an unknown action, a stage on two ranks, an action missing
    or done twice, a deadlock, a column that starts an action before its input ends) raises
    ConfigError naming the row and column and the fix."""
    if timing not in TIMINGS:
        raise ConfigError(f"timing={timing!r}: use 'order' (each rank's order, placed at the earliest ticks) or "
                          f"'columns' (the file's columns as ticks)")
    rows = _parse(text)
    chunks, placement = _placement(rows, placement)
    cells = [cell for row in rows for cell in row]
    split = any(cell.kind in "IW" for cell in cells)
    last = max(cells, key=operator.attrgetter("microbatch"))
    m = last.microbatch + 1 if microbatches is None else microbatches
    schedule_lib.check_sizes(len(rows), m, chunks)
    shape = Schedule(name, len(rows), m, chunks, _costs(costs, split, timing), split, (), placement)
    programs = [_program(shape, row, timing) for row in rows]
    read_off = "" if microbatches is not None else (
        f" (microbatches={m} read off the largest, {last.stage}{last.kind}{last.microbatch} at {last.where}; "
        f"pass microbatches= to check the file against the count you meant)")
    _check_complete(shape, programs, read_off)
    if timing == "columns":
        return _validated(_columns(shape, programs), programs)
    cycle = find_deadlock([[action for _, action in program] for program in programs], shape)
    if cycle:
        chain = " -> ".join(f"{action} ({_where(programs, device, action)})" for device, action in cycle)
        raise ConfigError(f"the rows deadlock with blocking receives, each action waiting for the next: {chain} -> "
                          f"(back to the first); reorder a row so that every action comes after what it receives")
    table = schedule_lib.simulate(name, shape.stages, m, chunks, shape.costs, split,
                                  [[action for _, action in program] for program in programs], placement)
    return _validated(table, programs)


def _costs(costs, split: bool, timing: str) -> dict[str, int]:
    kinds = "FBW" if split else "FB"
    if costs is None:
        if timing == "columns":
            return dict.fromkeys(kinds, 1)
        return dict(schedule_lib.DEFAULT_SPLIT_COSTS if split else schedule_lib.DEFAULT_COSTS)
    if not isinstance(costs, Mapping) or set(costs) != set(kinds):
        raise ConfigError(f"costs={costs!r}: give ticks for exactly the kinds {', '.join(kinds)} of this file "
                          f"(its backward is {'split: it has I or W' if split else 'whole: no I or W'}), "
                          f"e.g. {dict.fromkeys(kinds, 1)}")
    return dict(costs)


def _program(shape: Schedule, cells: list[_Cell], timing: str) -> list[tuple[int, Action]]:
    """One row as (column, jaxpar Action) in order; a full B of a split file becomes B, W."""
    out: list[tuple[int, Action]] = []
    for cell in cells:
        if cell.microbatch >= shape.microbatches:
            raise ConfigError(f"{cell.where}: {cell.stage}{cell.kind}{cell.microbatch} is microbatch "
                              f"{cell.microbatch}, but microbatches={shape.microbatches}: use microbatches 0.."
                              f"{shape.microbatches - 1} or pass microbatches={cell.microbatch + 1}")
        _, chunk = shape.device_of(cell.stage)
        if cell.kind == "B" and shape.split_backward:
            if timing == "columns":
                raise ConfigError(f"{cell.where}: a full backward {cell.stage}B{cell.microbatch} in a file with "
                                  f"split backwards (I, W) is two of jaxpar's actions, B then W, which one column "
                                  f"cannot hold; pass timing='order', or write it as I and W")
            out += [(cell.column, Action(kind, cell.microbatch, chunk)) for kind in "BW"]
            continue
        if timing == "columns" and out and out[-1][0] == cell.column:
            raise ConfigError(f"{cell.where}: several actions overlap in one column; jaxpar runs one action per "
                              f"tick: pass timing='order' to run them one after another")
        out.append((cell.column, Action("B" if cell.kind == "I" else cell.kind, cell.microbatch, chunk)))
    return out


def _check_complete(shape: Schedule, programs: list[list[tuple[int, Action]]], read_off: str) -> None:
    """Every (kind, microbatch, stage) exactly once: a duplicate names both cells, a missing
    action its rank (and, `read_off`, where m came from)."""
    seen: dict[tuple, tuple[int, int]] = {}
    for device, program in enumerate(programs):
        for column, action in program:
            key = shape._key(device, action)
            if key in seen:
                raise ConfigError(f"row {device} (rank {device}), column {column}: {_torch(shape, device, action)} "
                                  f"is done twice (first at column {seen[key][1]}); remove one")
            seen[key] = (device, column)
    for stage in range(shape.virtual_stages):
        device, chunk = shape.device_of(stage)
        for microbatch in range(shape.microbatches):
            for kind in "FBW" if shape.split_backward else "FB":
                if (kind, microbatch, stage) not in seen:
                    missing = _torch(shape, device, Action(kind, microbatch, chunk))
                    raise ConfigError(f"row {device} (rank {device}): {missing} is missing; every stage runs "
                                      f"F, {'I and W' if shape.split_backward else 'B'} of microbatches "
                                      f"0..{shape.microbatches - 1}{read_off}: add it to the row")


def _columns(shape: Schedule, programs: list[list[tuple[int, Action]]]) -> Schedule:
    """The table with each action at its column."""
    ticks = max(column + shape.costs[action.kind] for program in programs for column, action in program)
    table: list[list[Action | None]] = [[None] * shape.stages for _ in range(ticks)]
    for device, program in enumerate(programs):
        for column, action in program:
            table[column][device] = action
    return Schedule(shape.name, shape.stages, shape.microbatches, shape.chunks, shape.costs, shape.split_backward,
                    tuple(tuple(row) for row in table), shape.placement)


def _validated(table: Schedule, programs: list[list[tuple[int, Action]]]) -> Schedule:
    """table.validate(), its error located in the file."""
    try:
        return table.validate()
    except ScheduleError as error:
        action = table.actions[error.tick][error.device] if error.tick is not None else None
        where = _where(programs, error.device, action) if action else f"row {error.device}"
        raise ConfigError(f"{where}: not a schedule jaxpar can run: {error}\nWith timing='columns' each column is "
                          f"a tick: move the action to a later column, or pass timing='order'") from error


def _where(programs: list[list[tuple[int, Action]]], device: int, action: Action) -> str:
    column = next(c for c, a in programs[device] if a == action)
    return f"row {device} (rank {device}), column {column}"


def _torch(shape: Schedule, device: int, action: Action) -> str:
    """`action` of `device` written as torch writes it."""
    kind = {"B": "I" if shape.split_backward else "B"}.get(action.kind, action.kind)
    return f"{shape.stage_of(device, action.chunk)}{kind}{action.microbatch}"
