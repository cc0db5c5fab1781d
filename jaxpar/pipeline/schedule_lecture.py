"""The lecture's pipeline figures as data, and the `jaxpar tour` rows that check them.

Sections 2.1-2.3 print three timelines for p=4 (naive m=1, GPipe m=8, 1F1B m=8) with their
bubble fractions and 1F1B's peak activations; `LECTURE_TIMELINES` holds them verbatim,
and tests and the tour compare `schedule.make(...)` against them character for character.
`interleaved_bubble` and `dualpipe_v_bubble` are the closed forms the tables are checked against.
"""

from __future__ import annotations

import time

from jaxpar.pipeline import schedule_viz
from jaxpar.pipeline.schedule import make

# The lecture's section 2.1-2.3 timelines (p=4, F=1, B=2), its bubble figures as printed
# (rounded to 0.1%) and 1F1B's peak activations. Tests and the tour both read this.
LECTURE_TIMELINES: dict[str, dict] = {
    "naive": {"microbatches": 1, "bubble": 0.75, "peak": None, "rows": [
        "0.........aa", ".0......aa..", "..0...aa....", "...0aa......"]},
    "gpipe": {"microbatches": 8, "bubble": 0.273, "peak": None, "rows": [
        "01234567.........aabbccddeeffgghh", ".01234567......aabbccddeeffgghh..",
        "..01234567...aabbccddeeffgghh....", "...01234567aabbccddeeffgghh......"]},
    "1f1b": {"microbatches": 8, "bubble": 0.273, "peak": [4, 3, 2, 1], "rows": [
        "0123......aa4bb5cc6dd7ee.ff.gg.hh", ".012....aa3bb4cc5dd6ee7ff.gg.hh..",
        "..01..aa2bb3cc4dd5ee6ff7gg.hh....", "...0aa1bb2cc3dd4ee5ff6gg7hh......"]},
}


def interleaved_bubble(p: int, m: int, v: int) -> float:
    """The bubble of jaxpar's interleaved tables, for any F and B costs: total time is
    (v*m + p - 1)(F + B), so idle/total = (p-1)/(v*m + p-1), i.e. idle/busy = (p-1)/(v*m),
    Narayanan et al.'s figure (they divide by the ideal time)."""
    return (p - 1) / (v * m + p - 1)


def dualpipe_v_bubble(p: int, m: int) -> float:
    """The bubble of jaxpar's dualpipe-v tables at F=B=W=1 (m >= 2p-1): each device works
    6m ticks without a gap from tick d, so total time 6m + p - 1 and idle/total =
    (p-1)/(6m+p-1); back to back, 0."""
    return (p - 1) / (6 * m + p - 1)


def tour_check():
    """Rows for `jaxpar tour`: the lecture's three timelines, the GPipe/1F1B formula over
    p in 1..8, m in 1..32, and the interleaved / zero-bubble / DualPipe-V figures."""
    from jaxpar.tour import Row

    rows = []
    for name, fig in LECTURE_TIMELINES.items():
        t0 = time.perf_counter()
        s = make(name, 4, fig["microbatches"])
        err = abs(s.bubble_fraction - fig["bubble"])
        same = s.ascii().splitlines()[1:] == [f"  stage {d}: {r}" for d, r in enumerate(fig["rows"])]
        peak_ok = fig["peak"] is None or s.peak_activations == fig["peak"]
        rows.append(Row(technique=f"{schedule_viz.DISPLAY[name]} schedule p=4 m={s.microbatches}", mesh="-",
                        max_error=err, collectives=f"{len(s.sends)} sends", seconds=time.perf_counter() - t0,
                        ok=same and peak_ok and err < 5e-4,
                        note=f"bubble {schedule_viz.percent(s.bubble_fraction)} (lecture "
                             f"{schedule_viz.percent(fig['bubble'])}), timeline "
                             + ("= lecture" if same else "DIFFERS from lecture")
                             + (f", peak {s.peak_activations}" if fig["peak"] else "")))
    t0 = time.perf_counter()
    err = max(abs(make(n, p, m).bubble_fraction - (p - 1) / (m + p - 1))
              for n in ("gpipe", "1f1b") for p in range(1, 9) for m in range(1, 33))
    rows.append(Row(technique="GPipe/1F1B bubble, p 1..8 x m 1..32", mesh="-", max_error=err,
                    collectives="-", seconds=time.perf_counter() - t0, ok=err < 1e-12,
                    note="vs (p-1)/(m+p-1)"))
    t0 = time.perf_counter()
    s = make("interleaved", 4, 8, 2)
    err = abs(s.bubble_fraction - interleaved_bubble(4, 8, 2))
    rows.append(Row(technique="interleaved 1F1B p=4 m=8 v=2", mesh="-", max_error=err,
                    collectives=f"{len(s.sends)} sends (1F1B {len(make('1f1b', 4, 8).sends)})",
                    seconds=time.perf_counter() - t0, ok=err < 1e-12,
                    note=f"bubble {schedule_viz.percent(s.bubble_fraction)} = (p-1)/(vm+p-1)"))
    t0 = time.perf_counter()
    zb1, ref = make("zb-h1", 4, 8), make("1f1b", 4, 8, costs={"B": 2})
    ratio = sum(zb1.idle_time) / sum(ref.idle_time)
    rows.append(Row(technique="ZB-H1 p=4 m=8 F=B=W", mesh="-", max_error=abs(ratio - 1 / 3),
                    collectives=f"{len(zb1.sends)} sends", seconds=time.perf_counter() - t0,
                    ok=abs(ratio - 1 / 3) < 1e-12 and max(zb1.peak_activations) == 4,
                    note=f"idle {ratio:.3f} of 1F1B's, peak {zb1.peak_activations}"))
    t0 = time.perf_counter()
    zb2 = make("zb-h2", 4, 8)
    rows.append(Row(technique="ZB-H2 p=4 m=8 F=B=W", mesh="-", max_error=zb2.steady_bubble_fraction,
                    collectives=f"{len(zb2.sends)} sends", seconds=time.perf_counter() - t0,
                    ok=zb2.steady_bubble_fraction < 1e-12 and zb2.peak_activations[0] == 7,
                    note=f"back-to-back bubble {schedule_viz.percent(zb2.steady_bubble_fraction)}, "
                         f"peak {zb2.peak_activations} (2p-1 = 7)"))
    t0 = time.perf_counter()
    dpv = make("dualpipe-v", 4, 8)
    err = abs(dpv.bubble_fraction - dualpipe_v_bubble(4, 8))
    rows.append(Row(technique="DualPipe-V p=4 m=8 F=B=W", mesh="-", max_error=err,
                    collectives=f"{len(dpv.sends)} sends (1F1B {len(make('1f1b', 4, 8).sends)})",
                    seconds=time.perf_counter() - t0,
                    ok=err < 1e-12 and dpv.steady_bubble_fraction == 0 and dpv.peak_in_flight == [8] * 4,
                    note=f"bubble {schedule_viz.percent(dpv.bubble_fraction)} = (p-1)/(6m+p-1), back to "
                         f"back 0%, peak {dpv.peak_in_flight} chunks = 2p"))
    return rows
