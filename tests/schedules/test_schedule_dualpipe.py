"""The dualpipe-v schedule (DualPipeV / ZB-V): the V placement of the chunks, its sends, and the
bubble and memory its tables give, checked against expressions written here."""

from __future__ import annotations

import dataclasses
import json
import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxpar.cli.main import main
from jaxpar.schedules import schedule as S
from jaxpar.pipeline import formulas
from tests.oracles import FAST, check_dependencies, v_stage

# ---- the placement ---------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
def test_v_mapping_and_its_inverse(p):
    s = S.make("dualpipe-v", p, 2 * p - 1)
    assert s.placement == "v" and s.chunks == 2
    for d in range(p):
        for c in range(2):
            assert s.stage_of(d, c) == v_stage(p, d, c)
            assert s.device_of(s.stage_of(d, c)) == (d, c)
    assert s.device_of(0) == (0, 0) and s.device_of(2 * p - 1) == (0, 1)  # loss on device 0
    assert s.device_of(p - 1) == (p - 1, 0) and s.device_of(p) == (p - 1, 1)  # the turn


def test_interleaved_mapping_unchanged():
    s = S.make("interleaved", 4, 8, 3)
    assert s.placement == "loop"
    assert [s.stage_of(d, c) for c in range(3) for d in range(4)] == list(range(12))


def test_placement_must_fit_the_chunks():
    with pytest.raises(ValueError, match="2 chunks"):
        S.Schedule("hand", 2, 1, 3, {"F": 1, "B": 2}, False, (), "v")
    with pytest.raises(ValueError, match="one of loop, v"):
        S.Schedule("hand", 2, 1, 2, {"F": 1, "B": 2}, False, (), "zigzag")


def test_validate_reads_the_placement():
    # Megatron's interleaved table is valid on its own mapping and deadlocks on the V one,
    # and the other way round: the validator never assumes chunk*p + device.
    inter, vee = S.make("interleaved", 2, 2, 2), S.make("dualpipe-v", 2, 3)
    with pytest.raises(S.ScheduleError, match="deadlock|before its input"):
        dataclasses.replace(inter, placement="v").validate()
    with pytest.raises(S.ScheduleError, match="deadlock|before its input"):
        dataclasses.replace(vee, placement="loop").validate()


# ---- sends -------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", [(1, 3), (2, 3), (4, 8), (8, 32)])
def test_sends_skip_the_turn(p, m):
    s = S.make("dualpipe-v", p, m)
    assert len(s.sends) == 2 * m * (2 * p - 2) == 2 * len(S.make("1f1b", p, m).sends)
    for snd in s.sends:
        k = s.stage_of(snd.src, snd.chunk)
        assert s.stage_of(snd.dst, snd.dst_chunk) == (k + 1 if snd.kind == "F" else k - 1)
        assert snd.src != snd.dst and abs(snd.src - snd.dst) == 1 and snd.chunk == snd.dst_chunk
        assert {k, k + (1 if snd.kind == "F" else -1)} != {p - 1, p}  # the turn stays on device p-1
        assert snd.needed_at >= snd.tick == s.end(snd.kind, snd.microbatch, k)


# ---- what the tables give ----------------------------------------------------------------


@FAST
@given(p=st.integers(1, 8), extra=st.integers(0, 40))
def test_bubble_and_peak_exact(p, extra):
    m = 2 * p - 1 + extra
    s = S.make("dualpipe-v", p, m)
    check_dependencies(s)
    assert s.total_time == 6 * m + p - 1
    idle = sum(a is None for d in range(p) for a in s.occupancy(d))
    assert Fraction(idle, p * s.total_time) == Fraction(p - 1, 6 * m + p - 1)
    assert s.bubble_fraction == pytest.approx(formulas.bubble("dualpipe-v", p, m, 2), abs=1e-12)
    # a parallelogram: device d busy without a gap from tick d to 6m + d, so back to back 0
    for d in range(p):
        prog = s.program(d)
        assert prog[0][0] == d and prog[-1][0] + 1 == 6 * m + d
    assert s.steady_bubble_fraction == 0
    # 2p live microbatch-chunks on every device = 1F1B's p full-stage microbatches
    assert s.peak_activations == s.peak_in_flight == [2 * p] * p
    assert 2 * max(S.make("1f1b", p, m).peak_activations) == 2 * p


@FAST
@given(p=st.integers(1, 8), extra=st.integers(0, 12), f=st.integers(1, 3), b=st.integers(1, 3),
       w=st.integers(1, 3))
def test_runs_with_any_costs(p, extra, f, b, w):
    s = S.make("dualpipe-v", p, 2 * p - 1 + extra, costs={"F": f, "B": b, "W": w})
    check_dependencies(s)
    assert s.total_time >= 2 * (f + b + w) * s.microbatches


def test_p4_m8_figures():
    s = S.make("dualpipe-v", 4, 8)
    assert s.total_time == 51 and s.ascii().splitlines()[0].startswith(
        "DualPipe-V (p=4, m=8, v=2 in a V): bubble 5.9%, total time 51, peak activations "
        "(microbatch-chunks, 1/2 stage each) per device "
        "[8, 8, 8, 8], in flight until W [8, 8, 8, 8]; back to back: bubble 0%")
    rows = s.ascii().splitlines()
    assert rows[7] == "  device 3: ...00112233aA4aA4bB5bB5cC6cC6dD7dD7eeffgghhEEFFGGHH"
    assert rows[8] == "  chunk   :    010101011100011100011100011100011010101010101010"


# ---- bad input and the outputs -----------------------------------------------------------


@pytest.mark.parametrize("args, value, fix", [
    (("dualpipe-v", 4, 6), "microbatches=6 < 7 for stages=4", "use microbatches=7 or more"),
    (("dualpipe-v", 8, 14), "microbatches=14 < 15 for stages=8", "use microbatches=15 or more"),
    (("dualpipe-v", 4, 8, 3), "not chunks=3", "drop chunks"),
    (("dualpipe-v", 0, 8), "stages=0", "stages=1 or more"),
])
def test_bad_input(args, value, fix):
    # the message names the offending value, then how to fix it
    with pytest.raises(ValueError, match=re.escape(value) + ".*" + re.escape(fix)):
        S.make(*args)


def test_json_trace_png(tmp_path):
    s = S.make("dualpipe-v", 3, 5)
    d = json.loads(s.to_json())
    assert d["placement"] == "v" and d["chunks"] == 2
    assert {(a["chunk"], a["stage"]) for a in d["programs"][0]} == {(0, 0), (1, 5)}
    slices = [e for e in s.chrome_trace()["traceEvents"] if e["ph"] == "X"]
    assert all(e["args"]["stage"] == v_stage(3, e["tid"], e["args"]["chunk"]) for e in slices)
    s.save_png(str(tmp_path / "v.png"))
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"


def test_cli(capsys):
    assert main(["schedule", "dualpipe-v", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert "bubble 5.9%" in out and "sends between devices: 96" in out
    assert main(["schedule", "--all", "-p", "4", "-m", "8", "--costs", "F=1,B=1,W=1"]) == 0
    line = next(r for r in capsys.readouterr().out.splitlines() if "dualpipe-v" in r)
    assert "5.9%" in line and "[8, 8, 8, 8]" in line
    assert main(["schedule", "dualpipe-v", "-p", "4", "-m", "4"]) == 2
    assert "use -m 7 or more" in capsys.readouterr().err
