"""Searched pipeline schedules against Qi et al.'s published bubble rates, and search time.

    python -m benchmarks.schedule_search [--time-limit 1.0]
    python -m benchmarks.run schedule_search

Four tables, printed as markdown (pure Python: no JAX, one CPU core):

  table5   every row of Qi et al. 2023's Table 5 (Table 6's profiled F, B, W, comm; Table
           1's M_W / M_B) searched at 1F1B's memory (p M_B) against the paper's ZB-1p and
           at 2p M_B against ZB-2p, with ZB-H1 / ZB-H2 (jaxpar's orders, timed) beside
           them; "ok" when the found rate, to the paper's four decimals, is no worse.
  zb_v     every row of the arXiv version's Table 8 (ZB-V at 1F1B's memory): the paper's
           1F1B, ZB-H1, ZB-H2 and ZB-V beside jaxpar's, timed with the same model's Table 6
           times (the paper does not print the ZB-V settings' times: `published.ZB_V_PROXY`),
           the V placement searched at p M_B (two chunks a device, times halved per chunk).
  v        the V placement (two chunks a device) with F = B = W and activations freed at B:
           at p M_B (ZB-V), (p+2)//2 (V-Half, about p/(2m)) and (p+4)//3 (V-Min, about
           2p/(3m)) of Qi et al. 2024.
  growth   search seconds at the default time limit against p and m (cap 2p), with the
           actions searched (3 p m): the budget is counted in actions timed, so the time
           stays near the limit while the seeds' share grows with p m.
"""

from __future__ import annotations

import argparse
import time

from jaxpar.schedules import published, schedule, search
from jaxpar.schedules.timing import Costs, timed

UNIT = Costs(F=1.0, B=1.0, W=1.0, weight_memory=0.0)
V_SIZES = ((4, 16), (4, 32), (8, 32), (8, 64), (16, 64))
GROWTH = ((4, (8, 16, 32)), (8, (16, 32, 64)), (16, (32, 64, 128)), (32, (64, 128, 256)))


def _searched(p: int, m: int, costs: Costs, cap: float, time_limit: float, **placement) -> tuple:
    """(bubble, method, wall seconds) of one search."""
    began = time.perf_counter()
    found = search.search(p, m, costs, cap, time_limit=time_limit, **placement)
    return found.timing.bubble, found.method, time.perf_counter() - began


def table5(time_limit: float = 1.0) -> list[dict]:
    rows = []
    for (model, m), paper in published.BUBBLES.items():
        p, costs = published.MODELS[model].stages, published.profiled_costs(model, m)
        for cap, column, handmade in ((p, "zb_1p", "zb-h1"), (2 * p, "zb_2p", "zb-h2")):
            bubble, method, seconds = _searched(p, m, costs, cap, time_limit)
            rows.append({"model": model, "p": p, "m": m, "cap": f"{cap // p}p",
                         handmade: round(timed(schedule.make(handmade, p, m), costs).bubble, 4),
                         "published": getattr(paper, column), "found": round(bubble, 4),
                         "ok": round(bubble, 4) <= getattr(paper, column), "seconds": round(seconds, 2),
                         "method": method})
    return rows


def zb_v(time_limit: float = 1.0) -> list[dict]:
    rows = []
    for (model, p, m), paper in published.ZB_V_BUBBLES.items():
        whole = published.zb_v_proxy_costs(model, p, m)
        half = published.zb_v_proxy_costs(model, p, m, chunks=2)
        ours = {name: round(timed(schedule.make(name, p, m), whole).bubble, 4) for name in ("1f1b", "zb-h1", "zb-h2")}
        bubble, method, seconds = _searched(p, m, half, p, time_limit, chunks=2, placement="v")
        rows.append({"model": model, "p": p, "m": m, "times of": "m=%d" % published.ZB_V_PROXY[model, p, m][1],
                     "1F1B paper/ours": f"{paper.one_f_one_b} / {ours['1f1b']}",
                     "ZB-H1 paper/ours": f"{paper.zb_h1} / {ours['zb-h1']}",
                     "ZB-H2 paper/ours": f"{paper.zb_h2} / {ours['zb-h2']}",
                     "ZB-V paper": paper.zb_v, "found (p M_B)": round(bubble, 4),
                     "seconds": round(seconds, 2), "method": method})
    return rows


def v_shapes(time_limit: float = 1.0) -> list[dict]:
    rows = []
    for p, m in V_SIZES:
        for name, cap, about in (("ZB-V", p, 0.0), ("V-Half", (p + 2) // 2, p / (2 * m)),
                                 ("V-Min", (p + 4) // 3, 2 * p / (3 * m))):
            bubble, method, seconds = _searched(p, m, UNIT, cap, time_limit, chunks=2, placement="v")
            rows.append({"schedule": name, "p": p, "m": m, "cap": cap, "about": round(about, 4),
                         "found": round(bubble, 4), "1f1b": round((p - 1) / (m + p - 1), 4),
                         "seconds": round(seconds, 2), "method": method})
    return rows


def growth(time_limit: float = 1.0) -> list[dict]:
    rows = []
    costs = published.profiled_costs("1.5B", 24)
    for p, sizes in GROWTH:
        for m in sizes:
            bubble, method, seconds = _searched(p, m, costs, 2 * p, time_limit)
            rows.append({"p": p, "m": m, "actions": 3 * p * m, "seconds": round(seconds, 2),
                         "bubble": round(bubble, 4), "method": method})
    return rows


def run(time_limit: float = 1.0) -> list[dict]:
    """Every row of the three tables, each with its table's name first."""
    return ([{"table": "table5", **row} for row in table5(time_limit)]
            + [{"table": "zb_v", **row} for row in zb_v(time_limit)]
            + [{"table": "v", **row} for row in v_shapes(time_limit)]
            + [{"table": "growth", **row} for row in growth(time_limit)])


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    cells = [[("yes" if v else "no") if isinstance(v, bool) else str(v) for v in row.values()] for row in rows]
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                     + ["| " + " | ".join(row) + " |" for row in cells])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.schedule_search", description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=1.0, help="seconds per search (default 1.0)")
    args = parser.parse_args(argv)
    for title, make in (("Table 5: searched at p M_B (ZB-1p) and 2p M_B (ZB-2p)", table5),
                        ("Table 8 (arXiv): ZB-V at p M_B, Table 6's times standing in", zb_v),
                        ("V placement, F = B = W: ZB-V, V-Half, V-Min", v_shapes),
                        ("Search time against p and m (cap 2p, 1.5B's times)", growth)):
        began = time.perf_counter()
        rows = make(args.time_limit)
        print(f"\n### {title} ({time.perf_counter() - began:.0f} s)\n\n{markdown(rows)}")


if __name__ == "__main__":
    main()
