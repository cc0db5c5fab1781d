"""Schedules exchanged with torch.pipelining (jaxpar.schedules.interchange).

* every named schedule (orders.REGISTRY at a few p, m, v) written by to_csv and read back
  by from_csv is the same table, both timings;
* torch's own files (tests/pipeline/data/torch, written by torch's schedule classes; see
  the README there) import with the facts the file names say, pass Schedule.validate()
  and an independent reading of the table (oracles.check_dependencies), keep each rank's
  order as torch lists it, and the timelines give torch's text back, byte for byte;
* a sample of them runs in the pipeline runtime exactly: loss, input gradient and every
  parameter gradient equal the unsharded model's (float32, and float64 to ~1e-12), and the
  compiled collective-permutes are the oracle's for that table;
* a file that is not a schedule raises ConfigError naming the row and column.

Each runtime case compiles one program (a few seconds), once per process (`_compare`).
"""

import functools
import pathlib
import re

import jax.numpy as jnp
import pytest

from jaxpar.errors import ConfigError
from jaxpar.schedules import interchange, orders, schedule
from jaxpar.schedules.schedule import Action
from tests import oracles
from tests.pipeline import exact

DATA = pathlib.Path(__file__).parent / "data" / "torch"


def read(stem: str) -> str:
    """A torch file's text, line endings kept ("\\r\\n", as torch's csv.writer wrote them)."""
    with open(DATA / f"{stem}.csv", newline="") as f:
        return f.read()


def device_orders(s: schedule.Schedule) -> list[list[Action]]:
    return [[a for _, a in s.program(d)] for d in range(s.stages)]


# ---- jaxpar -> torch -> jaxpar: every named schedule ------------------------------------------

def _named_cases() -> list:
    out = []
    for name, kind in orders.REGISTRY.items():
        for p in (1, 2, 4):
            for m in (1, 3, 8):
                for chunks in ((2, 3) if kind.takes_chunks else (None,)):
                    try:
                        schedule.make(name, stages=p, microbatches=m, chunks=chunks)
                    except ConfigError:
                        continue  # a size this schedule refuses (test_schedule covers those)
                    label = f"{name}-{p}-{m}" + (f"-v{chunks}" if chunks else "")
                    out.append(pytest.param(name, p, m, chunks, id=label))
    return out


NAMED = _named_cases()


def test_named_cases_cover_every_schedule():
    assert {c.values[0] for c in NAMED} == set(orders.REGISTRY)
    assert len(NAMED) >= 40


@pytest.mark.parametrize("name,p,m,chunks", NAMED)
def test_every_named_schedule_round_trips(name, p, m, chunks):
    s = schedule.make(name, stages=p, microbatches=m, chunks=chunks)
    text = interchange.to_csv(s)
    assert text.count("\r\n") == p and text.endswith("\r\n")   # one row per device, torch's line ends
    for line in text.splitlines():
        action = r"\d+(F|I|W)\d+" if s.split_backward else r"\d+(F|B)\d+"
        assert all(re.fullmatch(action, cell) for cell in line.split(",") if cell)
    same = ("name", "stages", "microbatches", "chunks", "placement", "split_backward", "costs", "actions")
    # the earliest ticks with jaxpar's default costs: schedule.make's own table
    # (one device: loop and v hold the same stages, the file cannot say which)
    placement = s.placement if p == 1 else None
    back = interchange.from_csv(text, name=name, placement=placement)
    assert all(getattr(back, f) == getattr(s, f) for f in same), name
    # the columns as ticks, with the schedule's costs: the same table
    back = interchange.from_csv(text, name=name, timing="columns", costs=s.costs, placement=placement)
    assert all(getattr(back, f) == getattr(s, f) for f in same), name
    assert interchange.to_csv(back) == text
    # the columns at one tick each: the same device orders
    assert device_orders(interchange.from_csv(text, timing="columns")) == device_orders(s)


def test_to_csv_by_hand():
    """1F1B at p=2, m=2 with F=1, B=2 ticks: device 1 runs F0 B0 F1 B1 from tick 1; device 0
    waits for each of its backward's input gradient (ticks 4 and 7). A B's second tick is
    an empty cell, and each row ends at its last action."""
    assert interchange.to_csv(schedule.make("1f1b", stages=2, microbatches=2)) == (
        "0F0,0F1,,,0B0,,,0B1\r\n"
        ",1F0,1B0,,1F1,1B1\r\n")
    # split backward: jaxpar's B is torch's I (input gradient); chunks carry their model stage
    text = interchange.to_csv(schedule.make("dualpipe-v", stages=2, microbatches=3))
    assert text.startswith("0F0,0F1,0F2,3F0,3I0,3W0,") and ",2F0," in text and "B" not in text


# ---- torch -> jaxpar: torch's own files --------------------------------------------------------

# stem: (p, m, chunks, placement, split_backward), as torch's class and the file name say
TORCH = {
    "gpipe_p2_m4": (2, 4, 1, "loop", False),
    "gpipe_p4_m4": (4, 4, 1, "loop", False),
    "interleaved_1f1b_p2_m4": (2, 4, 2, "loop", False),
    "interleaved_1f1b_p4_m8": (4, 8, 2, "loop", False),
    "interleaved_1f1b_p2_m4_comms": (2, 4, 2, "loop", False),
    "looped_bfs_p2_m4": (2, 4, 2, "loop", False),
    "interleaved_zero_bubble_p2_m4": (2, 4, 2, "loop", True),
    "interleaved_zero_bubble_p4_m8": (4, 8, 2, "loop", True),
    "zbv_zero_bubble_p2_m4": (2, 4, 2, "v", True),
    "zbv_zero_bubble_p4_m8": (4, 8, 2, "v", True),
    "dualpipe_v_p2_m4": (2, 4, 2, "v", True),
    "dualpipe_v_p4_m8": (4, 8, 2, "v", True),
}
# the files torch draws as timelines that jaxpar runs as drawn (one action per column)
TIMELINES = ("interleaved_1f1b_p2_m4", "interleaved_1f1b_p4_m8", "looped_bfs_p2_m4", "interleaved_zero_bubble_p2_m4",
             "interleaved_zero_bubble_p4_m8", "zbv_zero_bubble_p2_m4", "zbv_zero_bubble_p4_m8")


def test_data_holds_every_torch_file():
    assert {p.stem for p in DATA.glob("*.csv")} == set(TORCH) | {"1f1b_p2_m4", "1f1b_p4_m8"}


def torch_orders(text: str, split: bool) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute actions as (jaxpar kind, microbatch, model stage), read from the
    text as torch's format defines it: communication cells dropped, an OVERLAP_F_B cell's
    actions in order, I -> B, and a full B -> B, W where the file splits backwards."""
    out = []
    for line in text.splitlines():
        row = []
        for stage_index, kind, mb in re.findall(r"(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|"
                                                r"REDUCE_GRAD)(\d*)", line):
            if kind in "FIBW":
                row += [(k, int(mb), int(stage_index)) for k in {"I": "B", "B": "BW" if split else "B"}.get(kind, kind)]
        out.append(row)
    return out


@pytest.mark.parametrize("stem", TORCH)
def test_torch_file_imports_in_its_order(stem):
    text = read(stem)
    s = interchange.from_csv(text, microbatches=TORCH[stem][1])
    assert (s.stages, s.microbatches, s.chunks, s.placement, s.split_backward) == TORCH[stem]
    s.validate()
    oracles.check_dependencies(s)
    got = [[(a.kind, a.microbatch, oracles.model_stage(s, d, a.chunk)) for a in row]
           for d, row in enumerate(device_orders(s))]
    assert got == torch_orders(text, s.split_backward)
    # the earliest ticks: exported and read back, the same table
    assert interchange.from_csv(interchange.to_csv(s), name=s.name).actions == s.actions


@pytest.mark.parametrize("stem", TIMELINES)
def test_torch_timeline_imports_as_drawn_and_gives_the_same_text_back(stem):
    text = read(stem)
    s = interchange.from_csv(text, timing="columns")
    assert (s.stages, s.microbatches, s.chunks, s.placement, s.split_backward) == TORCH[stem]
    s.validate()
    oracles.check_dependencies(s)
    assert interchange.to_csv(s) == text
    for d, line in enumerate(text.splitlines()):   # column t of row d is tick t of device d
        for t, cell in enumerate(line.split(",")):
            a = s.actions[t][d] if t < len(s.actions) else None
            assert (cell == "") == (a is None)


def test_torch_files_that_match_jaxpars_schedules():
    """torch's GPipe and interleaved 1F1B are jaxpar's gpipe and interleaved: the same
    device orders, so the same table at the earliest ticks."""
    for stem, name, p, m in (("gpipe_p2_m4", "gpipe", 2, 4), ("gpipe_p4_m4", "gpipe", 4, 4),
                             ("interleaved_1f1b_p2_m4", "interleaved", 2, 4),
                             ("interleaved_1f1b_p4_m8", "interleaved", 4, 8)):
        assert interchange.from_csv(read(stem)).actions == schedule.make(name, stages=p, microbatches=m).actions
    # the comms file is the same schedule with torch's sends, receives and FSDP actions
    assert interchange.from_csv(read("interleaved_1f1b_p2_m4_comms")).actions == \
        interchange.from_csv(read("interleaved_1f1b_p2_m4")).actions
    # ZB-V's timeline is already at the earliest ticks
    for stem in ("zbv_zero_bubble_p2_m4", "zbv_zero_bubble_p4_m8"):
        assert interchange.from_csv(read(stem)).actions == interchange.from_csv(read(stem), timing="columns").actions


def test_torch_1f1b_table_is_refused_where_its_last_rank_is_off_by_one():
    """Schedule1F1B's table starts the last rank's forwards at microbatch 1 and ends them at
    m (see the data README); torch's own validator refuses it too."""
    with pytest.raises(ConfigError, match=r"row 1 \(rank 1\), column 6: 1F4 is microbatch 4, but microbatches=4"):
        interchange.from_csv(read("1f1b_p2_m4"), microbatches=4)
    with pytest.raises(ConfigError, match=r"row 0 \(rank 0\): 0F8 is missing.*microbatches=9 read off the largest, "
                                          r"3F8 at row 3 \(rank 3\), column 14"):
        interchange.from_csv(read("1f1b_p4_m8"))


# ---- imported torch schedules run exactly ------------------------------------------------------

@functools.cache
def _compare(stem: str, timing: str, dtype=jnp.float32) -> dict:
    """The imported schedule run against the unsharded model (tests/pipeline/exact.py)."""
    return exact.run(interchange.from_csv(read(stem), name=stem, timing=timing), dtype)


# p=2 and p=4, both placements, split and whole backwards, both timings
RUNS = [("zbv_zero_bubble_p2_m4", "columns"), ("interleaved_1f1b_p2_m4", "columns"),
        ("interleaved_zero_bubble_p4_m8", "columns"), ("dualpipe_v_p4_m8", "order")]


@pytest.mark.parametrize("stem,timing", RUNS)
def test_imported_torch_schedule_runs_exactly(stem, timing):
    exact.assert_exact(_compare(stem, timing))


@pytest.mark.parametrize("stem,timing", [("dualpipe_v_p2_m4", "order"), ("looped_bfs_p2_m4", "columns")])
def test_imported_torch_schedule_runs_exactly_in_float64(x64, stem, timing):
    c = _compare(stem, timing, jnp.float64)
    exact.assert_exact(c)
    assert c["tolerance"] == (1e-12, 1e-12)


# ---- files that are not schedules ---------------------------------------------------------------

BAD = [
    ("0F0,0X0\r\n", {}, r"row 0 \(rank 0\), column 1: '0X0' is not a torch.pipelining action; write "
                        r"\[stage\]\[F\|I\|B\|W\]\[microbatch\]"),
    ("F0,0B0\r\n", {}, r"row 0 \(rank 0\), column 0: 'F0' is not a torch.pipelining action"),
    ("0F0,0B\r\n", {}, r"row 0 \(rank 0\), column 1: '0B' is not"),
    ("0F0,(0F1;0Q0)OVERLAP_F_B\r\n", {}, r"column 1: '\(0F1;0Q0\)OVERLAP_F_B' is not"),
    ("0F0,0B0\r\n0F1,1F0,1B0\r\n", {}, r"row 1 \(rank 1\), column 0: stage 0 is on rank 1 and on rank 0 "
                                       r"\(row 0 \(rank 0\), column 0\).*renumber"),
    ("0F0,0F1,0B0\r\n,1F0,1B0,1F1,1B1\r\n", {}, r"row 0 \(rank 0\): 0B1 is missing; every stage runs F, B of "
                                                r"microbatches 0..1 \(microbatches=2 read off"),
    ("0F0,0F1,0I0,0I1,0W0\r\n", {"microbatches": 2}, r"row 0 \(rank 0\): 0W1 is missing; every stage runs F, I and W"),
    ("0F0,0F0,0B0\r\n,1F0,1B0\r\n", {}, r"row 0 \(rank 0\), column 1: 0F0 is done twice \(first at column 0\)"),
    ("0F0,0B0,0F1,0B1\r\n1F1,1B1,1F0,1B0\r\n", {}, r"the rows deadlock.*B0 \(row 0 \(rank 0\), column 1\).*"
                                                   r"reorder a row"),
    ("0F0,,0B0\r\n1F0,1B0\r\n", {"timing": "columns"},
     r"(?s)row 1 \(rank 1\), column 0: not a schedule jaxpar can run: .*F0 starts before its input F0 of stage 0 "
     r"ends.*timing='order'"),
    ("0F0,1F0,1B0,0B0\r\n2F0,3F0,3B0,2B0\r\n", {}, r"row 0 \(rank 0\) holds stages \[0, 1\], but jaxpar places "
                                                   r"\[0, 2\] \(loop\) or \[0, 3\] \(v\) there"),
    ("0F0,3F0,3B0,0B0\r\n1F0,2F0,2B0,1B0\r\n", {"placement": "loop"}, r"row 0 \(rank 0\) holds stages \[0, 3\], "
                                                                       r"but jaxpar places \[0, 2\] \(loop\) there"),
    ("0F0,0B0\r\n", {"placement": "v"}, r"placement='v' holds 2 stages per rank, but this file has 1"),
    ("0F0,0B0\r\n", {"placement": "zigzag"}, r"placement='zigzag': one of loop, v"),
    ("0F0,2F0,2B0,0B0\r\n1F0,1B0\r\n", {}, r"3 stages over 2 ranks: each rank holds the same number"),
    ("0F0,0B0\r\n1F0,3F0,3B0,1B0\r\n", {}, r"stage 2 appears in no row"),
    ("", {}, r"the CSV has no rows"),
    ("0F0,0B0\r\n\r\n1F0,1B0\r\n", {}, r"row 1 \(rank 1\) has no compute action"),
    ("0F0,0SEND_F0,0B0\r\n1RECV_F0\r\n", {}, r"row 1 \(rank 1\) has no compute action"),
    ("0F0,0B0\r\n", {"timing": "ticks"}, r"timing='ticks': use 'order'"),
    ("0F0,0B0\r\n", {"costs": {"F": 1}}, r"costs=\{'F': 1\}: give ticks for exactly the kinds F, B"),
    ("0F0,0I0,0W0\r\n", {"costs": {"F": 1, "B": 1}}, r"kinds F, B, W of this file \(its backward is split"),
    ("0F0,0F1,0B0,0B1\r\n", {"microbatches": 1}, r"row 0 \(rank 0\), column 1: 0F1 is microbatch 1, but "
                                                  r"microbatches=1.*pass microbatches=2"),
    ("0F0,0B70000\r\n", {}, r"microbatches=70001 is more than 65,536"),
    ("0F0,0B0\r\n", {"microbatches": "1"}, r"microbatches='1' is a str, not a whole number"),
    (b"0F0,0B0\r\n", {}, r"from_csv takes the file's text \(a str\), not a bytes"),
    ("0F0,(0F1;0B0)OVERLAP_F_B,0B1\r\n", {"timing": "columns"}, r"row 0 \(rank 0\), column 1: several actions "
                                                                 r"overlap in one column.*timing='order'"),
    ("0F0,0B0,0F1,0I1,0W1\r\n", {"timing": "columns"}, r"row 0 \(rank 0\), column 1: a full backward 0B0 in a file "
                                                        r"with split backwards"),
]


@pytest.mark.parametrize("text,options,match", [pytest.param(*b, id=str(i)) for i, b in enumerate(BAD)])
def test_bad_csv_raises_config_error_naming_the_cell(text, options, match):
    with pytest.raises(ConfigError, match=match):
        interchange.from_csv(text, **options)


def test_to_csv_takes_a_schedule():
    with pytest.raises(ConfigError, match=r"to_csv takes a Schedule, not a str"):
        interchange.to_csv("1f1b")


def test_what_torch_writes_beyond_jaxpars_actions_is_read():
    """Overlapped cells run in order, a full B in a split file is B then W, communication
    cells are skipped, and a blank line at the end is no rank."""
    s = interchange.from_csv("0F0,(0F1;0B0)OVERLAP_F_B,0SEND_B0,0I1,0W1,0REDUCE_GRAD\r\n\r\n")
    assert device_orders(s) == [[Action("F", 0), Action("F", 1), Action("B", 0), Action("W", 0), Action("B", 1),
                                 Action("W", 1)]]
    assert s.split_backward and s.costs == schedule.DEFAULT_SPLIT_COSTS
