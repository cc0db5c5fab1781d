"""`jaxpar exercise N`: the lecture's exercises 1, 3, 7 and 8, from jaxpar's formulas."""

from __future__ import annotations

import argparse
import json

from jaxpar.planner import exercises

FLAGS: dict[str, str] = {}
HELP = "the lecture's exercises 1, 3, 7 and 8, answered from jaxpar's formulas"
ANSWERS = {
    1: lambda r: (f"p=8, bubble <= 10%: m >= {r['microbatches']} (bubble {r['bubble']:.1%}); one pipeline's batch "
                  f"{r['microbatches']} x 4 x 4096 = {r['tokens'] / 1e6:.2f} M tokens (lecture: 63, about 1.03 M)"),
    3: lambda r: (f"(a) {r['bytes'] / 1e9:.2f} GB per GPU per layer per step (lecture 0.94 GB); (b) NVLink "
                  f"{r['nvlink_s'] * 1e3:.1f} ms (2.1 ms); (c) compute {r['compute_s'] * 1e3:.1f} ms (about 10 ms), "
                  f"communication {r['share']:.0%} of it (21%); (d) InfiniBand {r['infiniband_s'] * 1e3:.1f} ms "
                  "(about 19 ms)"),
    7: lambda r: (f"dispatch {r['dispatch'] / 1e6:.0f} MB (lecture about 462 MB); forward {r['forward'] / 1e9:.2f} GB "
                  f"(0.92 GB); forward + backward {r['forward_and_backward'] / 1e9:.2f} GB (1.85 GB)"),
    8: lambda r: (f"32 M tokens: m = {r['microbatches']} per pipeline, bubble {r['bubble']:.1%} = 15/47 "
                  "(lecture: 15/47, about 32%)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("number", type=int, choices=sorted(ANSWERS), help="the exercise: 1, 3, 7 or 8")
    parser.add_argument("--json", action="store_true")


def main(args) -> int:
    result = getattr(exercises, f"exercise_{args.number}")()
    print(json.dumps(result, indent=1) if args.json else ANSWERS[args.number](result))
    return 0
