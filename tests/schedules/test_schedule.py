"""Pipeline schedules as data: the lecture's timelines, bubble and memory figures computed
from the tables against formulas written independently here, and the generators' tables
checked by a dependency checker of this file's own."""

from __future__ import annotations

import json
import pathlib
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar.errors import ConfigError
from jaxpar.schedules import schedule as S
from jaxpar.pipeline import formulas
from jaxpar.schedules import orders
from jaxpar.pipeline.formulas import LECTURE_TIMELINES
from jaxpar.schedules.viz import percent
from tests.oracles import FAST, bubble, check_dependencies

# The lecture text sits in shared/ beside the repository (a CI clone has a copy there too).
SEED_NAME = "seed/000_c4f408be80accaec.txt"
SEED = next((d / SEED_NAME for d in (pathlib.Path(__file__).resolve().parents[3] / "shared",
                                     pathlib.Path("/work/shared")) if (d / SEED_NAME).exists()), None)

# Sections 2.1-2.3 of the lecture, copied verbatim (figure title and rows), so that the check
# against a copy independent of formulas.LECTURE_TIMELINES never skips.
LECTURE_TEXT = {
    "naive": """\
朴素（m = 1）：气泡 75%
  阶段 0：0.........aa
  阶段 1：.0......aa..
  阶段 2：..0...aa....
  阶段 3：...0aa......""",
    "gpipe": """\
GPipe（m = 8）：气泡 27.3%
  阶段 0：01234567.........aabbccddeeffgghh
  阶段 1：.01234567......aabbccddeeffgghh..
  阶段 2：..01234567...aabbccddeeffgghh....
  阶段 3：...01234567aabbccddeeffgghh......""",
    "1f1b": """\
1F1B（m = 8）：气泡 27.3%，各阶段最多同时保存 [4, 3, 2, 1] 份激活值
  阶段 0：0123......aa4bb5cc6dd7ee.ff.gg.hh
  阶段 1：.012....aa3bb4cc5dd6ee7ff.gg.hh..
  阶段 2：..01..aa2bb3cc4dd5ee6ff7gg.hh....
  阶段 3：...0aa1bb2cc3dd4ee5ff6gg7hh......""",
}
# ---- the lecture's figures ------------------------------------------------------------


@pytest.mark.parametrize("name", list(LECTURE_TIMELINES))
def test_lecture_timelines_character_for_character(name):
    fig = LECTURE_TIMELINES[name]
    s = S.make(name, stages=4, microbatches=fig["microbatches"])
    text = s.ascii()
    for d, row in enumerate(fig["rows"]):
        assert f"  stage {d}: {row}\n" in text + "\n"
    header = text.splitlines()[0]
    assert f"bubble {'75%' if name == 'naive' else '27.3%'}," in header
    if fig["peak"]:
        assert s.peak_activations == [4, 3, 2, 1] and "[4, 3, 2, 1]" in header
    assert abs(float(bubble(s)) - fig["bubble"]) < 5e-4


@pytest.mark.parametrize("name", list(LECTURE_TEXT))
def test_timelines_equal_the_lecture_text(name):
    title, *lines = LECTURE_TEXT[name].splitlines()
    rows = [re.fullmatch(r"  阶段 (\d)：(\S+)", line).group(2) for line in lines]
    m = int(re.search(r"m = (\d+)", title).group(1))
    s = S.make(name, stages=4, microbatches=m)
    assert s.ascii().splitlines()[1:] == [f"  stage {d}: {r}" for d, r in enumerate(rows)]
    assert f"气泡 {percent(s.bubble_fraction)}" in title
    peaks = re.search(r"\[[\d, ]+\]", title)
    assert peaks is None or str(s.peak_activations) == peaks.group(0)
    assert rows == LECTURE_TIMELINES[name]["rows"]


@pytest.mark.skipif(SEED is None, reason=f"lecture text ({SEED_NAME}) not in shared/ beside this checkout")
def test_vendored_lecture_text_is_the_lectures():
    text = SEED.read_text()
    for block in LECTURE_TEXT.values():
        assert block in text


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_formula_every_p_and_m(name):
    for p in range(1, 9):
        for m in range(1, 33):
            s = S.make(name, p, m)
            assert bubble(s) == Fraction(p - 1, m + p - 1), (p, m)
            assert s.bubble_fraction == pytest.approx(float(Fraction(p - 1, m + p - 1)), abs=1e-12)


@FAST
@given(p=st.integers(1, 8), m=st.integers(1, 32), f=st.integers(1, 3), b=st.integers(1, 4))
def test_bubble_formula_any_costs(p, m, f, b):
    for name in ("gpipe", "1f1b"):
        s = S.make(name, p, m, costs={"F": f, "B": b})
        assert bubble(s) == Fraction(p - 1, m + p - 1)
        assert s.total_time == (m + p - 1) * (f + b)


@FAST
@given(p=st.integers(1, 8), m=st.integers(1, 32))
def test_peak_activations(p, m):
    assert S.make("gpipe", p, m).peak_activations == [m] * p
    assert S.make("1f1b", p, m).peak_activations == [min(p - s, m) for s in range(p)]
    assert S.make("naive", p, m).peak_activations == [1] * p


def test_naive_microbatches_do_not_overlap():
    s = S.make("naive", 4, 3)
    assert bubble(s) == Fraction(3, 4) and s.total_time == 3 * 12


# ---- interleaved and zero bubble ------------------------------------------------------


@FAST
@given(p=st.integers(1, 8), k=st.integers(1, 4), v=st.integers(2, 4), f=st.integers(1, 2), b=st.integers(1, 3))
def test_interleaved_bubble(p, k, v, f, b):
    m = k * p
    s = S.make("interleaved", p, m, v, costs={"F": f, "B": b})
    assert bubble(s) == Fraction(p - 1, v * m + p - 1)
    idle, busy = sum(s.idle_time), sum(s.busy_time)
    assert Fraction(idle, busy) == Fraction(p - 1, v * m)  # Narayanan et al.'s (p-1)/(v m)
    assert formulas.bubble("interleaved", p, m, v) == pytest.approx(float(bubble(s)))
    check_dependencies(s)


def test_interleaved_uses_v_times_the_sends():
    p, m, v = 4, 8, 3
    assert len(S.make("1f1b", p, m).sends) == 2 * m * (p - 1)
    assert len(S.make("interleaved", p, m, v).sends) == 2 * m * (p * v - 1)


@FAST
@given(p=st.integers(1, 8), extra=st.integers(0, 24))
def test_zb_h1_third_of_1f1b_bubble_same_memory(p, extra):
    m = p + extra
    zb, ref = S.make("zb-h1", p, m), S.make("1f1b", p, m, costs={"F": 1, "B": 2})
    assert 3 * sum(zb.idle_time) == sum(ref.idle_time)  # (p-1)(F+B-W) vs (p-1)(F+B+W)
    assert zb.total_time == 3 * m + p - 1
    assert zb.peak_activations == ref.peak_activations
    assert max(zb.peak_in_flight) == p
    check_dependencies(zb)


@FAST
@given(p=st.integers(1, 8), extra=st.integers(0, 24))
def test_zb_h2_no_bubble_back_to_back_2p_minus_1_live(p, extra):
    m = 2 * p - 1 + extra
    s = S.make("zb-h2", p, m)
    assert s.steady_bubble_fraction == pytest.approx(0, abs=1e-12)
    assert s.peak_activations[0] == 2 * p - 1
    assert max(s.peak_in_flight) == 2 * p - 1
    assert S.make("1f1b", p, m).steady_bubble_fraction > 0 or p == 1
    check_dependencies(s)


def test_zb_h2_with_few_microbatches_still_runs():
    s = S.make("zb-h2", 4, 4)
    check_dependencies(s)
    assert 0 < s.steady_bubble_fraction < S.make("1f1b", 4, 4).steady_bubble_fraction


@pytest.mark.parametrize("name", S.KNOWN)
def test_every_generator_passes_an_independent_check(name):
    for p, m in [(1, 1), (2, 4), (4, 8), (3, 9)]:
        check_dependencies(S.make(name, p, m) if name != "interleaved" else S.make(name, p, p * 2, 2))


# ---- the table's other readings -------------------------------------------------------


def test_sends_go_to_the_next_and_previous_stage():
    s = S.make("interleaved", 4, 8, 2)
    for snd in s.sends:
        k = s.stage_of(snd.src, snd.chunk)
        assert s.stage_of(snd.dst, snd.dst_chunk) == (k + 1 if snd.kind == "F" else k - 1)
        assert snd.src != snd.dst and snd.needed_at >= snd.tick
        assert snd.tick == s.end(snd.kind, snd.microbatch, k)
    assert S.make("1f1b", 1, 8).sends == []


def test_occupancy_and_program_agree():
    s = S.make("1f1b", 4, 8)
    for d in range(4):
        occ = s.occupancy(d)
        assert len(occ) == s.total_time
        for t, a in s.program(d):
            assert occ[t:t + s.cost(a)] == [a] * s.cost(a)
        assert sum(a is not None for a in occ) == s.busy_time[d] == 8 * 3


def test_json_and_chrome_trace():
    s = S.make("zb-h1", 4, 8)
    d = json.loads(s.to_json())
    assert d["bubble_fraction"] == s.bubble_fraction and d["peak_activations"] == [4, 3, 2, 1]
    for dev, prog in enumerate(d["programs"]):
        assert [(a["tick"], S.Action(a["kind"], a["microbatch"], a["chunk"])) for a in prog] == list(s.program(dev))
    trace = json.loads(json.dumps(s.chrome_trace()))["traceEvents"]
    assert sum(e["ph"] == "X" for e in trace) == 4 * 8 * 3
    assert sum(e["ph"] in "sf" for e in trace) == 2 * len(s.sends)


def test_interleaved_ascii_shows_chunks():
    rows = S.make("interleaved", 2, 2, 2).ascii().splitlines()
    assert rows[1].startswith("  device 0: ") and rows[2].startswith("  chunk   : ")
    busy = [c != "." for c in rows[1][12:]]
    assert [c != " " for c in rows[2][12:].ljust(len(busy))] == busy


def test_w_renders_uppercase():
    assert "A" in S.make("zb-h1", 2, 2).ascii().splitlines()[1]


# ---- the registry's closed forms against the tables -------------------------------------


def test_every_registry_closed_form_matches_the_table():
    """Each schedule's registry entry names its bubble and in-flight forms (formulas.py
    keeps them): the form equals the table's figure at every size the schedule takes
    (p <= 5, m <= 16), and a schedule without a bubble form is refused by name."""
    checked = 0
    for name, kind in orders.REGISTRY.items():
        assert kind.in_flight in formulas.IN_FLIGHT and kind.bubble in (None, *formulas.BUBBLES), name
        for p in range(1, 6):
            for m in range(1, 17):
                for v in ((2, 3) if kind.takes_chunks else (None,)):
                    try:
                        s = S.make(name, p, m, v)
                    except ValueError:
                        continue
                    # the first stage's peak, in whole stages (v chunk-sized microbatches each)
                    assert formulas.in_flight(name, p=p, m=m, chunks=s.chunks) == pytest.approx(
                        max(s.peak_activations) / s.chunks), (name, p, m, v)
                    if kind.bubble is not None:
                        assert formulas.bubble(name, p, m, s.chunks) == pytest.approx(float(bubble(s))), (name, p, m)
                    checked += 1
    assert checked > 300
    with pytest.raises(ValueError, match="no closed-form bubble for 'zb-h1': one of naive, gpipe, 1f1b, interleaved"):
        formulas.bubble("zb-h1", 4, 8)
    assert orders.REGISTRY[orders.DEFAULT].chunked in orders.REGISTRY


def test_closed_forms_refuse_what_the_tables_refuse():
    """formulas.bubble and formulas.in_flight take exactly the sizes `make` builds a table
    for (below the table's size bound): p or m of 0, -3 or 4.5, interleaved with m not a
    multiple of p or one chunk, DualPipe-V with m < 2p - 1, chunks for a schedule without
    them all raise ConfigError, never a number."""
    compared = 0
    for name, kind in orders.REGISTRY.items():
        for p in (0, 1, 2, 3, 4, 4.5, -3):
            for m in (0, 1, 2, 3, 5, 6, 7, 8):
                for v in (None, 0, 1, 2, 3):
                    try:
                        S.make(name, p, m, v)
                        built = True
                    except ConfigError:
                        built = False
                    forms = [lambda: formulas.in_flight(name, p=p, m=m, chunks=v)]
                    if kind.bubble is not None:
                        forms.append(lambda: formulas.bubble(name, p, m, v))
                    for form in forms:
                        if built:
                            assert form() >= 0, (name, p, m, v)
                        else:
                            with pytest.raises(ConfigError):
                                form()
                        compared += 1
    assert compared > 1000


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), v=st.integers(2, 4), data=st.data())
def test_device_peaks_are_the_tables_weighted_peaks(p, v, data):
    """formulas.device_peaks (built with at most 4p microbatches) equals the whole table's
    peaks with each stage weighted by a drawn weight (its layers), at any m up to 10p; with
    weights of 1 it is the table's peak_activations."""
    for name, kind in orders.REGISTRY.items():
        chunks = v if kind.takes_chunks else kind.chunks
        weights = data.draw(st.lists(st.integers(1, 9), min_size=p * chunks, max_size=p * chunks))
        m = data.draw(st.integers(1, 10)) * p if kind.takes_chunks else data.draw(st.integers(1, 10 * p))
        try:
            table = S.make(name, p, m, chunks)
        except ConfigError:
            continue
        got = formulas.device_peaks(name, p=p, m=m, chunks=chunks, stage_weights=weights)
        assert got == table.weighted_peaks(weights), (name, p, m, chunks, weights)
        assert formulas.device_peaks(name, p=p, m=m, chunks=chunks, stage_weights=[1] * (p * chunks)) == \
            table.peak_activations
