"""`jaxpar schedule`: build a pipeline schedule and show its timeline, bubble and memory.

    jaxpar schedule 1f1b -p 4 -m 8                 the lecture's 1F1B timeline
    jaxpar schedule interleaved -p 4 -m 8 -v 2     Megatron's interleaved 1F1B
    jaxpar schedule zb-h1 -p 4 -m 8 --costs F=1,B=1,W=1
    jaxpar schedule dualpipe-v -p 4 -m 8           two chunks per device in a V (DualPipeV, ZB-V)
    jaxpar schedule --all -p 8 -m 64               every schedule side by side
    jaxpar schedule gpipe --json | --png t.png | --trace t.json   (Perfetto: ui.perfetto.dev)
    jaxpar schedule 1f1b --steps                   also the SPMD steps the JAX runtime runs

Time is in ticks of one action, peaks in live microbatches; a schedule with v > 1 chunks
per device runs each action on one chunk, 1/v of a stage, so there ticks and peaks are
chunk-sized and `--all` also gives them divided by v (stage units) to compare with the others.

Pure Python: no JAX start-up; matplotlib only for --png. The library speaks Python
(`microbatches=7`); FLAGS gives main the flags to say it in (`-m 7`).
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

from jaxpar.cli.flags import translate
from jaxpar.errors import ConfigError
from jaxpar.pipeline import orders, plan, schedule, viz

FLAGS = {"stages": "-p", "microbatches": "-m", "chunks": "-v", "costs": "--costs"}
HELP = "pipeline schedules as data: timelines, bubble, peak activations (lecture section 2)"


def _listed(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


COSTS_HELP = (
    f"ticks per action kind, per chunk for {_listed([n for n, k in orders.REGISTRY.items() if k.chunks > 1])} "
    f"(default F=1,B=2). {_listed(orders.names(split_backward=True))} split the backward: there B is the input "
    "gradient only and W the weight gradient (default F=1,B=1,W=1; W keeps 1 unless given, so F=1,B=2 means B=2 "
    "plus W=1). Their orders are Qi et al.'s handcrafted orders, designed for F=B=W; with other costs they "
    "still run, but are not the orders Qi et al.'s scheduler would pick.")
CHUNKS_HELP = "model chunks per device, " + "; ".join(
    [f"{_listed(orders.names(takes_chunks=True))} only (default "
     f"{', '.join(str(k.chunks) for k in orders.REGISTRY.values() if k.takes_chunks)})"]
    + [f"{n}: {k.chunks}" for n, k in orders.REGISTRY.items() if k.chunks > 1 and not k.takes_chunks])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"one of: {', '.join(orders.REGISTRY)}")
    parser.add_argument("-p", "--stages", type=int, default=4, help="pipeline stages (devices) p (default 4)")
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


def parse_costs(text: str | None) -> dict[str, int] | None:
    """'F=1,B=2,W=1' -> {'F': 1, 'B': 2, 'W': 1}."""
    if not text:
        return None
    costs = {}
    for item in text.split(","):
        kind, _, value = item.partition("=")
        try:
            costs[kind.strip().upper()] = int(value)
        except ValueError:
            raise ConfigError(f"--costs {text!r}: write kind=ticks pairs, e.g. --costs F=1,B=2") from None
    return costs


def compare(p: int, m: int, chunks: int | None, costs: dict[str, int] | None) -> list[dict]:
    """One summary per known schedule (or the reason it cannot run for this p, m); `chunks`
    goes to the schedules that take chunks (the others run their own)."""
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
    costs = parse_costs(args.costs)
    writable(args.png, "--png")
    writable(args.trace, "--trace")
    if args.all:
        if args.png or args.trace:
            raise ConfigError("--png and --trace draw one schedule: give its NAME instead of --all")
        rows = compare(args.stages, args.microbatches, args.chunks, costs)
        if args.json:
            print(json.dumps([r if "error" not in r else {"name": r["name"], "error": str(r["error"])}
                              for r in rows], indent=2))
        else:
            print(format_comparison(args.stages, args.microbatches, rows))
        return 0
    if args.name is None:
        raise ConfigError(f"give a schedule NAME ({', '.join(orders.REGISTRY)}) or --all")
    s = schedule.make(args.name, args.stages, args.microbatches, args.chunks, costs)
    if args.png:
        s.save_png(args.png)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(s.chrome_trace(), f)
    if args.json:
        print(s.to_json(indent=1))
        return 0
    print(s.ascii())
    print(f"\nsends between devices: {len(s.sends)}")
    if args.steps:
        print("\n" + plan.ascii_steps(plan.plan(s)))
    print(textwrap.fill(viz.LEGEND, 100, initial_indent="legend: ", subsequent_indent="  "))
    for path, what in ((args.png, "timeline figure"), (args.trace, "Chrome trace (ui.perfetto.dev)")):
        if path:
            print(f"wrote {what}: {path}")
    return 0
