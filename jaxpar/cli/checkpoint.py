"""`jaxpar checkpoint ls DIR`: what a checkpoint directory of `jaxpar train` holds.

    jaxpar checkpoint ls run/ckpt
    jaxpar checkpoint ls run/ckpt --json

One line per step, oldest first: the step, the model (layers, d_model, query/KV heads,
vocab, MLP, experts), the mesh it was written on, the dtype, the loss at that step, the
schedule of the run that wrote it, and whether it is intact (its record read, its arrays
read back equal to the checksum written with them) or why not
(`jaxpar.train.checkpoint.listing`). Nothing is written; JAX runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os

FLAGS = {"directory": "DIR"}
HELP = "list the steps of a checkpoint directory (`ls`): model, mesh, loss, whether intact"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    ls = actions.add_parser("ls", help="one line per saved step", description="one line per saved step: model, "
                            "mesh, dtype, loss, schedule, intact")
    ls.add_argument("directory", metavar="DIR", help="a --checkpoint directory of jaxpar train")
    ls.add_argument("--json", action="store_true", help="one object per step, as a JSON list")


def main(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")          # reading arrays back needs no accelerator
    from jaxpar.train import checkpoint

    steps = checkpoint.listing(args.directory)
    if args.json:
        print(json.dumps(steps, indent=1))
    elif not steps:
        print(f"no checkpoint in {os.path.abspath(args.directory)}")
    else:
        print("\n".join(format_step(s) for s in steps))
    return 0


def format_step(s: dict) -> str:
    """'step 60  L2 D32 N8/8 V512 swiglu  dp2 x tp2  float32  loss 4.8612  60 steps, warm-up 6  intact'."""
    if s["model"] is None:
        return f"step {s['step']:>6}  not restorable: {s['problem']}"
    loss = "loss n/a" if s["loss"] is None else f"loss {s['loss']:.4f}"
    schedule = f"{s['schedule']['steps']} steps, warm-up {s['schedule']['warmup']}"
    state = "intact" if s["intact"] else f"not restorable: {s['problem']}"
    return f"step {s['step']:>6}  {s['model']}  {s['mesh']}  {s['dtype']}  {loss}  {schedule}  {state}"
