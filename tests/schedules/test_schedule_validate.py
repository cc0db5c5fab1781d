"""Schedule.validate() on broken tables, and the bad-input errors of make() and the CLI."""

from __future__ import annotations

import json
import re

import pytest

from jaxpar.cli.main import main
from jaxpar.errors import ConfigError
from jaxpar.schedules import schedule as S
from jaxpar.pipeline.verify import check_schedules
from jaxpar.schedules.schedule import Action as A


def table(p: int, m: int, placed, split: bool = False, chunks: int = 1) -> S.Schedule:
    """A hand-written table: placed = [(tick, device, Action), ...]; F=1, B=2 (or 1 split)."""
    costs = {"F": 1, "B": 1, "W": 1} if split else {"F": 1, "B": 2}
    rows = [[None] * p for _ in range(max(t for t, _, _ in placed) + 1)]
    for t, d, a in placed:
        rows[t][d] = a
    return S.Schedule("hand", p, m, chunks, costs, split, rows)


def program_table(p, m, programs):
    """Lay programs out back to back per device, ignoring dependencies."""
    placed = []
    for d, prog in enumerate(programs):
        t = 0
        for a in prog:
            placed.append((t, d, a))
            t += 1 if a.kind == "F" else 2
    return table(p, m, placed)


def error(s: S.Schedule) -> S.ScheduleError:
    with pytest.raises(S.ScheduleError) as e:
        s.validate()
    return e.value


def test_valid_hand_table():
    s = table(2, 1, [(0, 0, A("F", 0)), (1, 1, A("F", 0)), (2, 1, A("B", 0)), (4, 0, A("B", 0))])
    assert s.validate() is s and s.total_time == 6 and s.bubble_fraction == 0.5


def test_two_devices_that_receive_before_sending_deadlock():
    # device 0 waits for microbatch 0's gradient before sending microbatch 1 forward;
    # device 1 wants microbatch 1's activation before sending that gradient back.
    s = program_table(2, 2, [[A("F", 0), A("B", 0), A("F", 1), A("B", 1)],
                             [A("F", 0), A("F", 1), A("B", 0), A("B", 1)]])
    e = error(s)
    msg = str(e)
    assert "deadlock" in msg and "F1 on device 0" in msg and "B0 on device 1" in msg
    assert (e.tick, e.device) in {(1, 0), (1, 1), (3, 0), (2, 1)}
    marker = next(line for line in msg.splitlines() if "^" in line)
    assert marker.index("^") == len("  stage 0: ") + e.tick


def test_backward_before_its_forward():
    e = error(table(1, 1, [(0, 0, A("B", 0)), (2, 0, A("F", 0))]))
    assert "deadlock" in str(e) and e.device == 0 and e.tick == 0


def test_missing_action():
    e = error(table(2, 1, [(0, 0, A("F", 0)), (1, 1, A("F", 0)), (2, 1, A("B", 0))]))
    assert "B0 of stage 0 is missing" in str(e) and e.device == 0 and e.tick is None
    assert "^ missing here" in str(e)


def test_duplicated_action():
    e = error(table(2, 1, [(0, 0, A("F", 0)), (1, 0, A("F", 0)), (1, 1, A("F", 0)), (2, 1, A("B", 0)),
                           (4, 0, A("B", 0))]))
    assert "done twice" in str(e) and (e.tick, e.device) == (1, 0)


def test_two_actions_overlap_on_one_device():
    e = error(table(1, 2, [(0, 0, A("F", 0)), (1, 0, A("B", 0)), (2, 0, A("F", 1)), (3, 0, A("B", 1))]))
    assert "starts while B0" in str(e) and (e.tick, e.device) == (2, 0)
    assert "#" in str(e)


def test_forward_before_previous_stage_finished():
    e = error(table(2, 1, [(0, 0, A("F", 0)), (0, 1, A("F", 0)), (1, 1, A("B", 0)), (3, 0, A("B", 0))]))
    assert "before its input F0 of stage 0" in str(e) and (e.tick, e.device) == (0, 1)


def test_weight_gradient_before_its_backward():
    # W0 waits for B0, which its device runs only after W0: a cycle on one device.
    e = error(table(1, 1, [(0, 0, A("F", 0)), (1, 0, A("W", 0)), (2, 0, A("B", 0))], split=True))
    assert "deadlock with blocking receives" in str(e)
    assert "W0 on device 0 -> B0 on device 0" in str(e) or "B0 on device 0 -> W0 on device 0" in str(e)
    assert (e.tick, e.device) == (1, 0)


@pytest.mark.parametrize("placed", [
    [(0, 0, A("F", 0)), (1, 0, A("B", 0)), (3, 0, A("W", 0))],  # W without the split
    [(0, 0, A("F", 1))],                                          # microbatch >= m
    [(0, 0, A("F", -1))],
    [(0, 0, A("F", 0, chunk=1))],                                 # chunk >= v
])
def test_w_without_split_and_bad_indices(placed):
    # construction refuses them already, pointing at the tick in the timeline
    t, _, a = placed[-1]
    with pytest.raises(S.ScheduleError, match=re.escape(f"tick {t}, device 0: {a!r} is not an action of "
                                                        f"this schedule (kinds FB")) as e:
        table(1, 1, placed)
    assert (e.value.tick, e.value.device) == (t, 0) and f"^ tick {t}" in str(e.value)


# ---- malformed tables, refused on construction ------------------------------------------


def test_rows_must_have_one_entry_per_device():
    with pytest.raises(ValueError, match=r"actions\[1\] = \(None, None, None\): a row holds one entry "
                                         r"per device, 2 here"):
        S.Schedule("hand", 2, 1, 1, {"F": 1, "B": 2}, False, [(A("F", 0), None), (None, None, None)])
    with pytest.raises(ValueError, match=r"actions\[0\] = \[Action.*one entry per device, 2 here"):
        S.Schedule("hand", 2, 1, 1, {"F": 1, "B": 2}, False, [[A("F", 0)]])


@pytest.mark.parametrize("p, m, v, message", [
    (0, 1, 1, "stages=0: need at least 1; use stages=1 or more"),
    (1, 0, 1, "microbatches=0: need at least 1; use microbatches=1 or more"),
    (1, 1, 0, "chunks=0: need at least 1; use chunks=1 or more"),
    (True, 1, 1, "stages=True is a bool, not a whole number: give an int >= 1, e.g. stages=4"),
    (1, 2.0, 1, "microbatches=2.0 is a float, not a whole number"),
    (2000, 1, 1, "stages=2000 is more than 1,024, larger than any machine runs"),
    (1, 1 << 20, 1, "microbatches=1048576 is more than 65,536"),
    (512, 60000, 1, "stages=512 x microbatches=60000 x chunks=1 is 92,160,000 actions"),
])
def test_sizes_are_whole_numbers_at_least_one(p, m, v, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        S.Schedule("hand", p, m, v, {"F": 1, "B": 2}, False, ())


@pytest.mark.parametrize("entry, shown", [
    (("F", 0, 0), "('F', 0, 0)"),  # a plain tuple, not an Action
    ("F0", "'F0'"),
    (A("X", 0), "Action(kind='X', microbatch=0, chunk=0)"),
    (A("F", "0"), "Action(kind='F', microbatch='0', chunk=0)"),
    (A("F", 0, 0.0), "Action(kind='F', microbatch=0, chunk=0.0)"),
])
def test_entries_are_actions(entry, shown):
    with pytest.raises(ValueError, match=re.escape(f"actions[0][0] = {shown}: ") + r".*e\.g\. Action\('F', 0\)"):
        S.Schedule("hand", 1, 1, 1, {"F": 1, "B": 2}, False, [[entry]])


@pytest.mark.parametrize("costs", [{"F": 1}, {"F": 1, "B": 0}, {"F": 1, "B": 2, "W": 1}, {"F": 1, "B": 1.5}])
def test_costs_cover_the_kinds(costs):
    with pytest.raises(ValueError, match=re.escape(f"costs {costs!r}: whole ticks >= 1 for exactly the "
                                                   f"kinds F, B (split_backward=False), e.g. ")):
        S.Schedule("hand", 1, 1, 1, costs, False, ())


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("args, value, fix", [
    (("gpipe", 0, 4), "stages=0", "stages=1 or more"),
    (("1f1b", 4, 0), "microbatches=0", "microbatches=1 or more"),
    (("interleaved", 4, 6, 2), "microbatches=6, stages=4", "nearest valid microbatches=4 or 8"),
    (("interleaved", 4, 9, 2), "microbatches=9, stages=4", "nearest valid microbatches=8"),
    (("interleaved", 4, 2, 2), "microbatches=2, stages=4", "nearest valid microbatches=4"),
    (("interleaved", 4, 8, 1), "chunks=1", "use chunks=2 or more"),
    (("1f1b", 4, 8, 2), "chunks=2", "drop chunks for 1f1b"),
    (("zb-h1", 4, 3), "microbatches=3 < stages=4", "use microbatches=4 or more"),
    (("zb-h2", 8, 7), "microbatches=7 < stages=8", "use microbatches=8 or more"),
    (("dualpipe", 4, 8), "'dualpipe'", "known: naive, gpipe, 1f1b, interleaved, zb-h1, zb-h2, dualpipe-v"),
    (("1f1b", True, 8), "stages=True is a bool", "e.g. stages=4"),
    (("1f1b", 4.0, 8), "stages=4.0 is a float", "e.g. stages=4"),
    (("gpipe", "4", 8), "stages='4' is a str", "e.g. stages=4"),
    (("1f1b", 4, 8.0), "microbatches=8.0 is a float", "e.g. microbatches=4"),
    (("interleaved", 4, 8, True), "chunks=True is a bool", "e.g. chunks=4"),
    (("1f1b", 4, 8, None, [1, 2]), "costs=[1, 2] is a list, not a mapping", "e.g. costs={'F': 1, 'B': 2}"),
])
def test_bad_input(args, value, fix):
    # the message names the offending value, then how to fix it, in Python's words
    with pytest.raises(ConfigError, match=re.escape(value) + ".*" + re.escape(fix)):
        S.make(*args)


def test_bad_costs():
    with pytest.raises(ValueError, match="W exists only with the split backward"):
        S.make("1f1b", 4, 8, costs={"W": 1})
    with pytest.raises(ValueError, match="whole ticks >= 1"):
        S.make("gpipe", 4, 8, costs={"B": 0})
    with pytest.raises(ValueError, match="cost F=True: costs are whole ticks >= 1"):
        S.make("gpipe", 4, 8, costs={"F": True})


# ---- the command ---------------------------------------------------------------------------


def test_cli_timeline(capsys):
    assert main(["schedule", "1f1b", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 27.3%" in out and "  stage 3: ...0aa1bb2cc3dd4ee5ff6gg7hh......" in out


def test_cli_errors_without_traceback(capsys):
    assert main(["schedule", "interleaved", "-p", "4", "-m", "6"]) == 2
    err = capsys.readouterr().err
    assert "nearest valid -m 4 or 8" in err and "-m 6, -p 4" in err and "Traceback" not in err
    assert main(["schedule", "nope"]) == 2
    assert "known: naive" in capsys.readouterr().err
    assert main(["schedule", "gpipe", "--costs", "F1"]) == 2


def test_cli_all_and_outputs(capsys, tmp_path):
    assert main(["schedule", "--all", "-p", "8", "-m", "64"]) == 0
    out = capsys.readouterr().out
    assert "[64, 64, 64, 64, 64, 64, 64, 64]" in out and "[8, 7, 6, 5, 4, 3, 2, 1]" in out
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["schedule", "zb-h1", "--costs", "F=1,B=1,W=1", "--png", str(png), "--trace", str(trace)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and b"traceEvents" in trace.read_bytes()
    assert main(["schedule", "gpipe", "-p", "2", "-m", "2", "--json"]) == 0
    assert '"total_time": 9' in capsys.readouterr().out


def test_cli_all_states_its_units(capsys):
    # chunked schedules count chunk-sized ticks and activations; time/v and peak/v put every
    # row in stage units (p=8, m=64: interleaved 405 ticks = 202.5 stage ticks, 23 chunks = 11.5)
    assert main(["schedule", "--all", "-p", "8", "-m", "64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "F=1, B=2" in out[0] and "split backward (B = input gradient only) F=1, B=1, W=1" in out[0]
    assert "time/v" in out[3] and "peak/v" in out[3]
    row = {line.split()[0]: line for line in out[4:]}
    assert row["interleaved"].split()[4:8] == ["405", "202.5", "1920", "11.5"]
    assert row["interleaved"].endswith("microbatch-chunks") and row["dualpipe-v"].endswith("microbatch-chunks")
    assert row["dualpipe-v"].split()[4:8] == ["391", "195.5", "1792", "8"]
    assert row["1f1b"].split()[3:7] == ["213", "213", "896", "8"] and "chunks" not in row["1f1b"]
    assert main(["schedule", "--all", "-p", "4", "-m", "8", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["interleaved"]["units"]["peaks"].startswith("microbatch-chunks")
    assert rows["interleaved"]["stage_time"] == rows["interleaved"]["total_time"] / 2
    assert rows["1f1b"]["units"]["peaks"] == "microbatches" and rows["1f1b"]["peak_stage_equivalent"] == 4


def test_cli_costs_help_says_what_b_and_w_are(capsys):
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "B is the input gradient only" in help_text and "F=1,B=2 means B=2 plus W=1" in help_text
    assert "Qi et al.'s handcrafted orders, designed for F=B=W" in help_text


def test_tour_rows_all_ok():
    rows = check_schedules()
    assert len(rows) >= 7 and all(r.passed for r in rows), [r for r in rows if not r.passed]
