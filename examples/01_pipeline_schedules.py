"""Pipeline schedules as data (lecture section 2, script 01_pipeline_schedules.py). No JAX.

    python examples/01_pipeline_schedules.py            # timelines and figures, in a second
    python examples/01_pipeline_schedules.py --png DIR  # also a timeline PNG per schedule

schedule.make builds a schedule as its table, actions[tick][device]; each figure below is
counted from such tables beside the lecture's. Every schedule side by side: `jaxpar schedule
--all -p P -m M`; the checks as one table (every p <= 8, m <= 32): `jaxpar verify schedule`.
"""

import argparse
import pathlib

from jaxpar.errors import ConfigError
from jaxpar.pipeline.formulas import LECTURE_TIMELINES as LECTURE  # the lecture's timelines
from jaxpar.pipeline.formulas import bubble
from jaxpar.schedules import schedule
from jaxpar.schedules.viz import percent

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--png", metavar="DIR", help="write one timeline PNG per schedule into DIR")
args = parser.parse_args()
shown = []


def show(name: str, p: int = 4, m: int = 8, **kw) -> schedule.Schedule:
    s = schedule.make(name, stages=p, microbatches=m, **kw)
    print(s.ascii(), end="\n\n")
    shown.append(s)
    return s


# actions[tick][device] is the Action (kind F, B or W; microbatch; chunk) that starts on that
# device at that tick, or None (idle). F takes 1 tick, B 2.
s = schedule.make("1f1b", stages=4, microbatches=8)
name = lambda a: "." if a is None else f"{a.kind}{a.microbatch}"
print("== A schedule is a table: 1F1B, p=4 stages, m=8 microbatches ==")
print(f"  actions[10], devices 0..3: {'  '.join(map(name, s.actions[10]))}")
print("  device 0's own order: " + ", ".join(f"{name(a)} at {t}" for t, a in s.program(0)[:6]) + ", ...")
print(f"  {len(s.actions)} ticks; bubble {percent(s.bubble_fraction)} = (p-1)/(m+p-1) = "
      f"{percent(bubble('1f1b', 4, 8))}; {len(s.sends)} sends between devices "
      f"(first: device {s.sends[0].src} -> {s.sends[0].dst} at tick {s.sends[0].tick})")
try:
    schedule.make("interleaved", stages=4, microbatches=6, chunks=2)
except ConfigError as e:
    print(f"  interleaved, p=4, m=6: ConfigError: {e}\n")

# 2.1-2.3: the lecture's three timelines, p = 4, F = 1, B = 2 (one character per tick).
print("== Lecture 2.1-2.3: naive, GPipe, 1F1B (p=4) ==\n")
for name, fig in LECTURE.items():
    s = show(name, m=fig["microbatches"])
    same = s.ascii().splitlines()[1:] == [f"  stage {d}: {r}" for d, r in enumerate(fig["rows"])]
    print(f"  bubble {percent(s.bubble_fraction)} (lecture {percent(fig['bubble'])}); "
          f"timeline {'identical to' if same else 'DIFFERENT from'} the lecture's"
          + (f"; peak activations {s.peak_activations} (lecture {fig['peak']})" if fig["peak"] else ""),
          end="\n\n")

# Exercise 1: p = 8, bubble <= 10%: the smallest m, and the global batch it implies.
# Exercise 2: p = 8, m = 64: live activations on the first and the last stage.
m = next(m for m in range(1, 1000) if schedule.make("1f1b", 8, m).bubble_fraction <= 0.10)
g, f = schedule.make("gpipe", 8, 64), schedule.make("1f1b", 8, 64)
print("== Exercises 1 and 2 ==")
print(f"1. p=8, bubble <= 10%: m >= {m} (m={m - 1} gives {percent(schedule.make('1f1b', 8, m - 1).bubble_fraction)}); "
      f"lecture: m >= 63; at 4 x 4096 tokens a microbatch, {m * 4 * 4096:,} tokens per pipeline")
print(f"2. p=8, m=64: GPipe first/last stage {g.peak_activations[0]}/{g.peak_activations[-1]} "
      f"microbatches (lecture 64/64); 1F1B {f.peak_activations[0]}/{f.peak_activations[-1]} (lecture 8/1)\n")

# 2.5: interleaved 1F1B (Narayanan et al. 2021), zero bubble (Qi et al. 2023), DualPipe-V.
print("== 2.5 Interleaved 1F1B: several chunks per device ==\n")
ref = schedule.make("1f1b", 4, 8)
s = show("interleaved", chunks=2)
print(f"  bubble {percent(s.bubble_fraction)} = (p-1)/(v*m+p-1) = {percent(bubble('interleaved', 4, 8, 2))} "
      f"(1F1B {percent(ref.bubble_fraction)}); sends {len(s.sends)} (1F1B {len(ref.sends)})\n")

print("== 2.5 Zero bubble: backward split into B (input gradient) and W (weights), F=B=W=1 ==\n")
zb1, zb2 = show("zb-h1"), show("zb-h2")
print(f"  ZB-H1: idle {zb1.idle_time} = 1/3 of 1F1B's {ref.idle_time} ((p-1)(F+B-W) vs (p-1)(F+B+W)), "
      f"same peak activations {zb1.peak_activations}")
print(f"  ZB-H2: the same idle in one step, but a parallelogram: steps run back to back with bubble "
      f"{percent(zb2.steady_bubble_fraction)}, for peak activations {zb2.peak_activations} (2p-1 = 7)\n")

# DeepSeek-V3's DualPipe cut in half (DualPipeV), the V-shape ZB-V of Qi et al. 2024: device d
# holds stage d and stage 2p-1-d, so the loss is on device 0 and the turn needs no send.
print("== 2.5 DualPipe-V: two chunks per device in a V, F=B=W=1 per chunk ==\n")
dv = show("dualpipe-v")
print(f"  bubble {percent(dv.bubble_fraction)} = (p-1)/(6m+p-1) = {percent(bubble('dualpipe-v', 4, 8, 2))}, "
      f"back to back {percent(dv.steady_bubble_fraction)}; peak {dv.peak_in_flight[0]} half-stage chunks "
      f"= 1F1B's {ref.peak_activations[0]} stages; sends {len(dv.sends)} = 2x 1F1B's {len(ref.sends)}")

if args.png:
    out = pathlib.Path(args.png)
    out.mkdir(parents=True, exist_ok=True)
    for s in shown:
        path = out / f"{s.name}_p{s.stages}_m{s.microbatches}_v{s.chunks}.png"
        s.save_png(str(path))
        print(f"wrote {path}")
