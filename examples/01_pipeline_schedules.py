"""Lecture section 2 (script 01_pipeline_schedules.py): pipeline schedules as data.

    python examples/01_pipeline_schedules.py            # timelines and figures, in a few seconds
    python examples/01_pipeline_schedules.py --png DIR  # also a timeline PNG per schedule

Opens with one schedule as the table it is: actions[tick][device], built by
jaxpar.schedules.schedule, with its bubble held against the closed form. Every figure
below is then counted from such tables and put beside the lecture's figures and
formulas. No JAX: schedules are plain Python. The same checks as one table:
`jaxpar verify schedule`; one schedule's timeline and figures: `jaxpar schedule NAME -p P -m M`.
"""

import argparse
import pathlib

from jaxpar.schedules import schedule
from jaxpar.pipeline.formulas import LECTURE_TIMELINES as LECTURE  # the lecture's timelines
from jaxpar.pipeline.formulas import bubble
from jaxpar.schedules.viz import percent

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--png", metavar="DIR", help="write one timeline PNG per schedule into DIR")
args = parser.parse_args()
shown = []

# A schedule is data: actions[tick][device] is the Action (kind F, B or W; microbatch;
# chunk) that starts on that device at that tick, or None (idle). F takes 1 tick, B 2.
s = schedule.make("1f1b", stages=4, microbatches=8)
name = lambda a: "." if a is None else f"{a.kind}{a.microbatch}"
print("== A schedule is a table: 1F1B, p=4 stages, m=8 microbatches ==")
print(f"  actions[10], devices 0..3: {'  '.join(map(name, s.actions[10]))}")
print("  device 0's own order: " + ", ".join(f"{name(a)} at {t}" for t, a in s.program(0)[:6]) + ", ...")
print(f"  {len(s.actions)} ticks; bubble {percent(s.bubble_fraction)} = (p-1)/(m+p-1) = "
      f"{percent(bubble('1f1b', 4, 8))}; {len(s.sends)} sends between devices "
      f"(first: device {s.sends[0].src} -> {s.sends[0].dst} at tick {s.sends[0].tick})\n")


def show(s: schedule.Schedule) -> None:
    print(s.ascii(), end="\n\n")
    shown.append(s)


# 2.1-2.3: the lecture's three timelines, p = 4, F = 1, B = 2 (one character per tick).
print("== Lecture 2.1-2.3: naive, GPipe, 1F1B (p=4) ==\n")
for name, fig in LECTURE.items():
    s = schedule.make(name, stages=4, microbatches=fig["microbatches"])
    show(s)
    same = s.ascii().splitlines()[1:] == [f"  stage {d}: {r}" for d, r in enumerate(fig["rows"])]
    print(f"  bubble {percent(s.bubble_fraction)} (lecture {percent(fig['bubble'])}); "
          f"timeline {'identical to' if same else 'DIFFERENT from'} the lecture's"
          + (f"; peak activations {s.peak_activations} (lecture {fig['peak']})" if fig["peak"] else ""),
          end="\n\n")

# The lecture: "the simulator matched the formula exactly" -- so do these tables.
worst = max(abs(schedule.make(n, p, m).bubble_fraction - (p - 1) / (m + p - 1))
            for n in ("gpipe", "1f1b") for p in range(1, 9) for m in range(1, 33))
print(f"GPipe and 1F1B bubble vs (p-1)/(m+p-1), p 1..8 x m 1..32: max difference {worst:.1e}\n")

# Exercise 1: p = 8, bubble <= 10%: the smallest m, and the global batch it implies.
p = 8
m = next(m for m in range(1, 1000) if schedule.make("1f1b", p, m).bubble_fraction <= 0.10)
s = schedule.make("1f1b", p, m)
print("== Exercise 1 ==")
print(f"p=8, bubble <= 10%: m >= {m} (bubble {percent(s.bubble_fraction)}; m={m - 1} gives "
      f"{percent(schedule.make('1f1b', p, m - 1).bubble_fraction)}); lecture: m >= 63")
print(f"4 sequences of 4096 tokens per microbatch: {m} x 4 x 4096 = {m * 4 * 4096:,} tokens "
      f"(~{m * 4 * 4096 / 1e6:.2f} M) per pipeline, times the data-parallel degree\n")

# Exercise 2: p = 8, m = 64: live activations on the first and the last stage.
g, f = schedule.make("gpipe", 8, 64), schedule.make("1f1b", 8, 64)
print("== Exercise 2 ==")
print(f"p=8, m=64: GPipe first/last stage {g.peak_activations[0]}/{g.peak_activations[-1]} "
      f"microbatches (lecture 64/64); 1F1B {f.peak_activations[0]}/{f.peak_activations[-1]} (lecture 8/1)")
print(f"  1F1B per stage: {f.peak_activations}\n")

# 2.5: interleaved 1F1B (Narayanan et al. 2021) and zero bubble (Qi et al. 2023).
print("== 2.5 Interleaved 1F1B: v chunks per device ==\n")
show(schedule.make("interleaved", 4, 8, chunks=2))
for v in (1, 2, 4):
    s = schedule.make("interleaved", 4, 8, chunks=v) if v > 1 else schedule.make("1f1b", 4, 8)
    print(f"  v={v}: bubble {percent(s.bubble_fraction)} = (p-1)/(v*m+p-1) = "
          f"{percent(bubble('interleaved', 4, 8, v))}; idle/busy "
          f"{sum(s.idle_time) / sum(s.busy_time):.4f} = (p-1)/(v*m) = {3 / (v * 8):.4f}; sends {len(s.sends)}")
print()

print("== 2.5 Zero bubble: backward split into B (input gradient) and W (weights), F=B=W=1 ==\n")
ref = schedule.make("1f1b", 4, 8)
print(f"1F1B (B+W as one B of 2 ticks): idle ticks per device {ref.idle_time}, peak {ref.peak_activations}\n")
for name in ("zb-h1", "zb-h2"):
    show(schedule.make(name, 4, 8))
zb1, zb2 = schedule.make("zb-h1", 4, 8), schedule.make("zb-h2", 4, 8)
print(f"  ZB-H1: idle {zb1.idle_time} = 1/3 of 1F1B's ((p-1)(F+B-W) vs (p-1)(F+B+W)), "
      f"same peak activations {zb1.peak_activations}")
print(f"  ZB-H2: one step has the same idle ({zb2.idle_time}) -- the last stage cannot start "
      f"before tick p-1 -- but the timeline is a parallelogram: steps run back to back with bubble "
      f"{percent(zb2.steady_bubble_fraction)}, for peak activations {zb2.peak_activations} (2p-1 = 7)")
for p, m in ((8, 32),):
    a, b, c = (schedule.make(n, p, m) for n in ("1f1b", "zb-h1", "zb-h2"))
    print(f"  p={p}, m={m}: bubble 1F1B {percent(a.bubble_fraction)}, ZB-H1 {percent(b.bubble_fraction)}, "
          f"ZB-H2 {percent(c.bubble_fraction)} (back to back {percent(c.steady_bubble_fraction)}); "
          f"peak on stage 0: {a.peak_activations[0]}, {b.peak_activations[0]}, {c.peak_activations[0]}")
print()

# DeepSeek-V3's DualPipe cut in half (DualPipeV), the V-shape ZB-V of Qi et al. 2024: device d
# holds stage d and stage 2p-1-d, so the loss is on device 0 and the turn needs no send.
print("== 2.5 DualPipe-V: two chunks per device in a V, F=B=W=1 per chunk ==\n")
show(schedule.make("dualpipe-v", 4, 8))
for p, m in ((4, 8), (8, 32)):
    ref, zb, dv = (schedule.make(n, p, m) for n in ("1f1b", "zb-h1", "dualpipe-v"))
    print(f"  p={p}, m={m}: bubble {percent(dv.bubble_fraction)} = (p-1)/(6m+p-1) = "
          f"{percent(bubble('dualpipe-v', p, m, 2))} (ZB-H1 {percent(zb.bubble_fraction)}, 1F1B "
          f"{percent(ref.bubble_fraction)}), back to back {percent(dv.steady_bubble_fraction)}; peak "
          f"{dv.peak_in_flight[0]} half-stage chunks on every device = 1F1B's {ref.peak_activations[0]} "
          f"stages; sends {len(dv.sends)} = 2x 1F1B's {len(ref.sends)}")

if args.png:
    out = pathlib.Path(args.png)
    out.mkdir(parents=True, exist_ok=True)
    for s in shown:
        path = out / f"{s.name}_p{s.stages}_m{s.microbatches}_v{s.chunks}.png"
        s.save_png(str(path))
        print(f"wrote {path}")
