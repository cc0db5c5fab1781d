"""`jaxpar schedule`: build a pipeline schedule and show its timeline, bubble and memory.

    jaxpar schedule 1f1b -p 4 -m 8                 the lecture's 1F1B timeline
    jaxpar schedule interleaved -p 4 -m 8 -v 2     Megatron's interleaved 1F1B
    jaxpar schedule zb-h1 -p 4 -m 8 --costs F=1,B=1,W=1
    jaxpar schedule dualpipe-v -p 4 -m 8           two chunks per device in a V (DualPipeV, ZB-V)
    jaxpar schedule --all -p 8 -m 64               every schedule side by side
    jaxpar schedule gpipe --json | --png t.png | --trace t.json   (Perfetto: ui.perfetto.dev)
    jaxpar schedule 1f1b --steps                   also the SPMD steps the JAX runtime runs
    jaxpar schedule zb-h1 -p 8 -m 24 --costs F=18.522,B=18.086,W=9.337,comm=0.601
                                                   timed with measured costs and comm
    jaxpar schedule search -p 8 -m 24 --costs F=18.522,B=18.086,W=9.337,comm=0.601 --memory 2p
                                                   the best order found under a memory cap
    jaxpar schedule --published                    Qi et al.'s Table 5 against jaxpar's timing
    jaxpar schedule search --published             ... and their searched ZB-1p, ZB-2p against jaxpar's search

Time is in ticks of one action, peaks in live microbatches; a schedule with more than one
chunk per device runs each action on one chunk, 1/chunks of a stage, so there ticks and
peaks are chunk-sized and `--all` also gives them divided by chunks (stage units) to compare
with the others. (Its output labels chunks v, beside p and m: `p=4, m=8, v=2`.)
`--costs` in whole ticks (F=1,B=2) sets the table's ticks; with a fraction or comm
(F=18.522,...,comm=0.601) the timeline stays in unit ticks, showing each device's order,
and the figures under it are that order timed with the costs (`schedules.timing`): Qi et
al.'s bubble rate and each device's peak activation memory in M_B (one microbatch's
activations on a device's share of the model).

Pure Python: no JAX start-up; matplotlib only for --png. The library speaks Python
(`microbatches=7`); FLAGS gives main the flags to say it in (`-m 7`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import textwrap

from jaxpar.cli.flags import translate
from jaxpar.errors import ConfigError
from jaxpar.pipeline import plan
from jaxpar.schedules import interchange, orders, published, schedule, search, viz
from jaxpar.schedules.timing import EXAMPLE, Costs, Timing, timed

FLAGS = {"stages": "-p", "microbatches": "-m", "chunks": "-v", "costs": "--costs", "memory_cap": "--memory",
         "placement": "--placement", "time_limit": "--time-limit"}
HELP = "pipeline schedules as data: timelines, bubble, peak activations (lecture section 2)"
SEARCH = "search"   # the NAME that searches an order instead of building a named one
# Flags that only `jaxpar schedule search` reads.
SEARCH_ONLY = {"memory": "--memory", "placement": "--placement", "csv": "--csv", "time_limit": "--time-limit"}


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


COSTS_HELP = (
    f"ticks per action kind, per chunk for {_listed([n for n, k in orders.REGISTRY.items() if k.chunks > 1])} "
    f"(default F=1,B=2). {_listed(orders.names(split_backward=True))} split the backward: there B is the input "
    "gradient only and W the weight gradient (default F=1,B=1,W=1; W keeps 1 unless given, so F=1,B=2 means B=2 "
    "plus W=1). Their orders are Qi et al.'s handcrafted orders, designed for F=B=W; with other costs they "
    "still run, but are not the orders Qi et al.'s scheduler would pick. Measured times with a fraction or "
    f"comm ({EXAMPLE}; also activation=, weight_memory=; a per-stage value as F=10/20/20/10) keep the "
    "timeline in unit ticks and time its order with them: Qi et al.'s bubble rate, each device's peak "
    "memory in M_B.")
CHUNKS_HELP = "model chunks per device, " + "; ".join(
    [f"{_listed(orders.names(takes_chunks=True))} only (default "
     f"{', '.join(str(k.chunks) for k in orders.REGISTRY.values() if k.takes_chunks)})"]
    + [f"{n}: {k.chunks}" for n, k in orders.REGISTRY.items() if k.chunks > 1 and not k.takes_chunks])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME",
                        help=f"one of: {', '.join(orders.REGISTRY)}; or '{SEARCH}': search the best order under "
                             "--memory for --costs")
    parser.add_argument("-p", "--pp", dest="stages", type=int, default=4,
                        help="the pipeline size pp: the devices, the schedule's stages p (default 4)")
    parser.add_argument("-m", "--microbatches", type=int, default=8, help="microbatches m (default 8)")
    parser.add_argument("-v", "--chunks", type=int, default=None, help=CHUNKS_HELP)
    parser.add_argument("--costs", default=None, metavar="F=1,B=2[,W=1]", help=COSTS_HELP)
    parser.add_argument("--all", action="store_true", help="compare every schedule for this p and m")
    parser.add_argument("--json", action="store_true", help="print the schedule (table, stats, sends) as JSON")
    parser.add_argument("--png", metavar="PATH", help="write a timeline figure")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON")
    parser.add_argument("--steps", action="store_true",
                        help="also print the SPMD steps the pipeline runtime executes (backward lane, then "
                             "forward lane, per device), their count and the collective-permutes")
    parser.add_argument("--published", action="store_true",
                        help="Qi et al. 2023's Table 5 bubble rates beside jaxpar's, timed with their Table 6 times")
    parser.add_argument("--memory", metavar="CAP", default=None,
                        help=f"{SEARCH} only: the most live activation memory a device may hold: p, 2p, 1.5p "
                             "(times the stages) or a number, in M_B (one microbatch's activations on a device; "
                             "p M_B is 1F1B's memory; default p)")
    parser.add_argument("--placement", default=None, metavar="|".join(schedule.PLACEMENTS),
                        help=f"{SEARCH} only: chunks over the model, loop (stage chunk*p + device) or v (down the "
                             "devices and back up; 2 chunks, the default -v there); default loop")
    parser.add_argument("--csv", metavar="PATH", help=f"{SEARCH} only: write the order in torch.pipelining's CSV")
    parser.add_argument("--time-limit", dest="time_limit", type=float, default=None, metavar="S",
                        help=f"{SEARCH} only: seconds the search may take (default 1)")


def parse_costs(text: str | None) -> tuple[dict[str, int] | None, Costs | None]:
    """--costs in one of two forms: whole ticks of F, B, W ('F=1,B=2,W=1' -> ({'F': 1, 'B': 2,
    'W': 1}, None)), which the table is built with, or measured times ('F=18.522,...,comm=0.601'
    -> (None, Costs)), with which its order is timed."""
    if not text:
        return None, None
    ticks = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        if kind.strip().upper() not in ("F", "B", "W") or not value.strip().isdigit():
            break
        ticks[kind.strip().upper()] = int(value)
    else:
        return ticks, None
    try:
        return None, Costs.parse(text)
    except ConfigError as e:
        reason = str(e).removeprefix(f"costs {text!r}: ")
        raise ConfigError(f"--costs {text!r}: write kind=ticks pairs (F=1,B=2) or times with comm "
                          f"({EXAMPLE}); {reason}") from None


def search_costs(text: str | None) -> Costs:
    """--costs for the search, in either form (whole ticks are times too); default F=B=W=1."""
    ticks, costs = parse_costs(text)
    if costs is not None:
        return costs
    ticks = ticks or {}
    return Costs(F=ticks.get("F", 1), B=ticks.get("B", 1), W=ticks.get("W", 1))


def memory_cap(text: str | None, stages: int) -> float:
    """--memory: 'p', '2p', '1.5p' (times the stages) or a number of M_B; default p."""
    if text is None:
        return float(stages)
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)?\s*\*?\s*p\s*", text)
    try:
        return (float(found.group(1) or 1) * stages) if found else float(text)
    except ValueError:
        raise ConfigError(f"--memory {text!r}: write p, 2p, 1.5p (times the stages) or a number of M_B, "
                          f"e.g. --memory 2p") from None


def describe(costs: Costs) -> str:
    """'F=18.522, B=18.086, W=9.337, comm=0.601' (per-stage values with slashes; the memory
    keys where they are not the defaults)."""
    def value(v) -> str:
        return "/".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}"
    defaults = Costs(F=1.0, B=1.0)
    keys = ["F", "B", "W", "comm"] + [k for k in ("activation", "weight_memory")
                                      if getattr(costs, k) != getattr(defaults, k)]
    return ", ".join(f"{k}={value(getattr(costs, k))}" for k in keys)


def timed_lines(t: Timing, costs: Costs) -> list[str]:
    """What `timed` found, in words: the bubble rate, the step, each device's peak memory."""
    chunked = t.schedule.chunks > 1
    return [
        f"timed with {describe(costs)}" + (" (per action on one chunk)" if chunked else "")
        + "; comm on every activation and input gradient between devices",
        f"  bubble {t.bubble:.4f} = {viz.percent(t.bubble)} (Qi et al.'s rate: longest device span {t.cost:.6g}, busiest "
        f"device's work {max(t.busy):.6g}); one step from time 0: {t.makespan:.6g}, bubble "
        f"{viz.percent(t.makespan_bubble)}",
        "  peak activation memory per device (M_B): " + ", ".join(f"{x:.4g}" for x in t.peak_memory),
    ]


def timed_dict(t: Timing) -> dict:
    """The figures `--json` adds for timed costs: bubble and peak as numbers, and the rest."""
    return {"bubble": t.bubble, "peak": t.peak_memory, "timing": t.to_dict()}


def compare(p: int, m: int, chunks: int | None, costs: dict[str, int] | None,
            measured: Costs | None = None) -> list[dict]:
    """One summary per known schedule (or the reason it cannot run for this p, m); `chunks`
    goes to the schedules that take chunks (the others run their own); with `measured`
    costs each row also has the order timed with them ("bubble" and "peak", M_B)."""
    schedule.check_sizes(p, m, 1 if chunks is None else chunks)   # sizes every schedule needs: refused once, here
    out = []
    for name, kind in orders.REGISTRY.items():
        own_chunks = chunks if kind.takes_chunks else None
        own = {k: c for k, c in (costs or {}).items() if k != "W" or kind.split_backward}
        try:
            s = schedule.make(name, p, m, own_chunks, own)
        except ConfigError as e:
            out.append({"name": name, "error": e})
            continue
        d = s.to_dict()
        out.append({k: d[k] for k in ("name", "chunks", "costs", "units", "total_time", "stage_time",
                                      "bubble_fraction", "steady_bubble_fraction", "peak_activations",
                                      "peak_in_flight")}
                   | {"peak_stage_equivalent": max(s.peak_activations) / s.chunks, "sends": len(s.sends)})
        if measured is not None:
            t = timed(s, measured)
            out[-1] |= {"bubble": t.bubble, "peak": t.peak_memory}
    return out


def format_comparison(p: int, m: int, rows: list[dict]) -> str:
    costs = {orders.REGISTRY[r["name"]].split_backward: r["costs"] for r in rows if "error" not in r}
    said = {False: "ticks per action ", True: "split backward (B = input gradient only) "}
    lines = [f"p={p}, m={m}; " + "; ".join(said[split] + ", ".join(f"{k}={c}" for k, c in ks.items())
                                           for split, ks in sorted(costs.items())),
             "v > 1 runs each action on one chunk, 1/v of a stage, so time and peaks count chunk-sized",
             "units there; time/v and peak/v (most live on a device) are in stage units for every row",
             f"  {'schedule':<16} {'bubble':>7} {'back2back':>9} {'time':>5} {'time/v':>6} {'sends':>5} "
             f"{'peak/v':>6}  peak live per device / in flight until W"]
    for r in rows:
        if "error" in r:
            lines.append(f"  {r['name']:<16} cannot run: {translate(str(r['error']), FLAGS).splitlines()[0]}")
            continue
        name = r["name"] + (f" v={r['chunks']}" if r["chunks"] > 1 else "")
        peaks = str(r["peak_activations"])
        if r["peak_in_flight"] != r["peak_activations"]:
            peaks += f" / {r['peak_in_flight']}"
        peaks += " microbatch-chunks" if r["chunks"] > 1 else ""
        lines.append(f"  {name:<16} {viz.percent(r['bubble_fraction']):>7} "
                     f"{viz.percent(r['steady_bubble_fraction']):>9} {r['total_time']:>5} "
                     f"{r['stage_time']:>6g} {r['sends']:>5} {r['peak_stage_equivalent']:>6g}  {peaks}")
    timed_rows = [r for r in rows if "bubble" in r]
    if timed_rows:
        lines += ["each order timed with --costs (per action on one chunk where v > 1): Qi et al.'s bubble rate "
                  "and the most activation memory a device holds, in M_B",
                  f"  {'schedule':<16} {'bubble':>7}  peak M_B per device"]
        lines += [f"  {r['name']:<16} {viz.percent(r['bubble']):>7}  " + ", ".join(f"{x:.4g}" for x in r["peak"])
                  for r in timed_rows]
    return "\n".join(lines)


def format_published(rows: list[dict]) -> str:
    """Table 5 of Qi et al. 2023 beside jaxpar's timing of the same orders with Table 6's
    times (and jaxpar's searched orders, where the rows have them). 'same' when every
    reproduced column rounds to the published figure; a searched one may also beat it."""
    columns = [c for c in published.LABELS if c in rows[0]["ours"]]
    head = "  ".join(f"{published.LABELS[c] + ' paper/ours':>17}" for c in columns)
    lines = [f"{published.CITATION}: Table 5's bubble rates, and jaxpar's orders timed with Table 6's "
             "profiled F, B, W, comm (ms)" + ("; ZB-1p / ZB-2p: jaxpar's search under p M_B / 2p M_B"
                                            if "zb_1p" in columns else ""),
             f"  {'model':<6} {'p':>3} {'m':>4}  {head}  {'named':>5}"]
    for r in rows:
        cells = [f"{r['published'][c]:.4f}/{r['ours'][c]:.4f}" for c in columns]
        same = all(round(r["ours"][c], 4) == r["published"][c] for c in published.REPRODUCED)
        lines.append(f"  {r['model']:<6} {r['stages']:>3} {r['microbatches']:>4}  "
                     + "  ".join(f"{c:>17}" for c in cells) + f"  {'same' if same else 'NO':>5}")
    lines.append("1F1B-I (one layer per chunk, first and last stage one layer short) is the paper's only"
                 + ("" if "zb_1p" in columns else "; `jaxpar schedule search --published` adds ZB-1p / ZB-2p "
                                                  "searched by jaxpar"))
    return "\n".join(lines)


def writable(path: str | None, what: str) -> None:
    """Refuse, before building anything, a path whose folder does not exist or cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"{what} {path!r}: folder {folder!r} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or os.path.isdir(path):
        raise ConfigError(f"{what} {path!r}: cannot write there; choose another path")


def main(args) -> int:
    writable(args.png, "--png")
    writable(args.trace, "--trace")
    if args.name == SEARCH:
        return main_search(args)
    for field, flag in SEARCH_ONLY.items():
        if getattr(args, field) is not None:
            raise ConfigError(f"{flag} is an option of `jaxpar schedule {SEARCH}` only; drop it, or give NAME {SEARCH}")
    if args.published:
        rows = published.table()
        print(json.dumps(rows, indent=1) if args.json else format_published(rows))
        return 0
    costs, measured = parse_costs(args.costs)
    if args.all:
        if args.png or args.trace:
            raise ConfigError("--png and --trace draw one schedule: give its NAME instead of --all")
        rows = compare(args.stages, args.microbatches, args.chunks, costs, measured)
        if args.json:
            print(json.dumps([r if "error" not in r else {"name": r["name"], "error": str(r["error"])}
                              for r in rows], indent=2))
        else:
            print(format_comparison(args.stages, args.microbatches, rows))
        return 0
    if args.name is None:
        raise ConfigError(f"give a schedule NAME ({', '.join(orders.REGISTRY)}) or --all")
    s = schedule.make(args.name, args.stages, args.microbatches, args.chunks, costs)
    t = timed(s, measured) if measured is not None else None
    if args.png:
        s.save_png(args.png)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(s.chrome_trace(), f)
    if args.json:
        print(json.dumps(s.to_dict() | (timed_dict(t) if t else {}), indent=1))
        return 0
    print(s.ascii())
    if t is not None:
        print(f"the timeline is in unit ticks ({', '.join(f'{k}={c}' for k, c in s.costs.items())}): it shows "
              "each device's order; the figures below time that order with --costs")
        print("\n".join(timed_lines(t, measured)))
    print(f"\nsends between devices: {len(s.sends)}")
    if args.steps:
        print("\n" + plan.ascii_steps(plan.plan(s)))
    print(textwrap.fill(viz.LEGEND, 100, initial_indent="legend: ", subsequent_indent="  "))
    for path, what in ((args.png, "timeline figure"), (args.trace, "Chrome trace (ui.perfetto.dev)")):
        if path:
            print(f"wrote {what}: {path}")
    return 0


def main_search(args) -> int:
    """`jaxpar schedule search`: the order with the least bubble found under --memory."""
    if args.all or args.steps or args.trace:
        raise ConfigError(f"--all, --steps and --trace do not apply to `jaxpar schedule {SEARCH}`; drop them")
    if args.published:
        rows = published.table(search=True, time_limit=1.0 if args.time_limit is None else args.time_limit)
        print(json.dumps(rows, indent=1) if args.json else format_published(rows))
        return 0
    writable(args.csv, "--csv")
    costs = search_costs(args.costs)
    placement = args.placement or "loop"
    chunks = args.chunks if args.chunks is not None else (2 if placement == "v" else 1)
    cap = memory_cap(args.memory, args.stages)
    found = search.search(args.stages, args.microbatches, costs, cap, chunks=chunks, placement=placement,
                          time_limit=1.0 if args.time_limit is None else args.time_limit)
    t = found.timing
    if args.png:
        found.save_png(args.png)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(interchange.to_csv(found))
    if args.json:
        print(json.dumps(found.to_dict() | timed_dict(t) | {
            "memory_cap": found.memory_cap, "search_seconds": found.search_seconds, "method": found.method},
            indent=1))
        return 0
    print(f"searched: p={args.stages}, m={args.microbatches}, chunks={chunks} ({placement}), memory cap "
          f"{found.memory_cap:g} M_B, {found.search_seconds:.2f} s ({found.method})")
    print("\n".join(timed_lines(t, costs)))
    print("  under the same costs: " + ", ".join(compare_named(args.stages, args.microbatches, costs)))
    print("\nthe searched order, in unit ticks (F=B=W=1; the runtime runs this order):")
    print(found.ascii())
    for path, what in ((args.png, "timeline figure"), (args.csv, "torch.pipelining CSV")):
        if path:
            print(f"wrote {what}: {path}")
    return 0


def compare_named(p: int, m: int, costs: Costs) -> list[str]:
    """'1f1b 24.31% (peak 8 M_B)', ... for the one-chunk split schedules that run at this p, m."""
    out = []
    for name in ("1f1b", "zb-h1", "zb-h2"):
        try:
            t = timed(schedule.make(name, p, m), costs)
        except ConfigError:
            continue
        out.append(f"{name} {t.bubble:.4f} (peak {max(t.peak_memory):.4g} M_B)")
    return out
