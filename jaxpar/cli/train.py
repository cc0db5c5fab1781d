"""`jaxpar train`: the composed model trained on a dp x pp x tp x cp x ep mesh.

    jaxpar train --mesh dp=2,pp=2,tp=2 --schedule 1f1b --steps 200
    jaxpar train --mesh pp=2,cp=2,ep=2 --experts 4 --microbatches 2 --steps 50
    jaxpar train --mesh dp=4,tp=2 --sp --zero 1 --checkpoint run/ckpt --every 20   (resumes if killed)
    jaxpar train --mesh dp=2 --steps 50 --log run/steps.jsonl --json

Ends with a summary: loss curve PNG, tokens/s, memory per device (compiled), and the
collectives of one step against the techniques' formulas (`jaxpar.train.summary`);
`--json` adds the history, one row per step (step, loss, grad_norm, lr, seconds), the
rows `--log` writes as JSON lines while training. The checkpoint directory and the log
are checked before JAX starts; the checkpoints' threads are closed on every way out.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from jaxpar.pipeline import orders

FLAGS = {"dp": "--mesh dp", "pp": "--mesh pp", "tp": "--mesh tp", "cp": "--mesh cp", "ep": "--mesh ep",
         "microbatches": "--microbatches", "batch_size": "--batch", "seq_len": "--seq", "n_layers": "--layers",
         "n_heads": "--heads", "n_kv_heads": "--kv-heads", "vocab": "--vocab", "n_experts": "--experts",
         "d_ff": "--ffn", "chunks": "--chunks", "zero": "--zero", "attention": "--attention", "layout": "--layout",
         "schedule": "--schedule", "steps": "--steps", "warmup": "--warmup", "lr": "--lr", "every": "--every",
         "directory": "--checkpoint", "log": "--log", "router": "--router", "aux_loss": "--aux-loss",
         "bias_rate": "--bias-rate", "top_k": "--top-k"}
HELP = "train the composed model on a dp x pp x tp x cp x ep mesh (lecture 7), with a summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default="dp=2,pp=2,tp=2", help="axis sizes, e.g. dp=2,pp=2,tp=2 (dp pp cp ep tp)")
    parser.add_argument("--schedule", default=orders.DEFAULT, help=f"one of: {', '.join(orders.REGISTRY)}")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches (default: 2 x pp)")
    parser.add_argument("--chunks", type=int, default=None,
                        help=f"model chunks per device ({', '.join(orders.names(takes_chunks=True))})")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on tp")
    parser.add_argument("--recompute", action="store_true", help="keep only each stage's input between F and B")
    parser.add_argument("--zero", type=int, default=0, help="1: ZeRO-1, optimizer state sharded over dp")
    parser.add_argument("--attention", default="ring", help="ring or ulysses over cp")
    parser.add_argument("--layout", default="contiguous", help="contiguous or zigzag (ring over cp)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: fits the mesh)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 2 per stage)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--router", default="softmax", help="softmax, or sigmoid (DeepSeek-V3, with --bias-rate)")
    parser.add_argument("--aux-loss", type=float, default=0.0,
                        help="weight of the per-sequence balance loss (Switch/GShard; e.g. 0.01; 0: off)")
    parser.add_argument("--bias-rate", type=float, default=0.0,
                        help="DeepSeek-V3's router-bias step per update (e.g. 0.001; --router sigmoid; 0: off)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps / 10)")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--checkpoint", default=None,
                        help="directory (its folder must exist): save every --every steps and the last, resume from it")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--log", default=None,
                        help="append one JSON line per step to this file (its folder must exist)")
    parser.add_argument("--out", default="jaxpar-train", help="where the loss curve goes (default jaxpar-train/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--devices", type=int, default=None, help="fake CPU devices (default: the mesh's)")
    parser.add_argument("--platform", choices=["cpu", "default"], default="default")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def main(args) -> int:
    from jaxpar.train import spec as spec_lib

    spec = spec_lib.parse(args.mesh, schedule=args.schedule, chunks=args.chunks, sequence_parallel=args.sp,
                          recompute=args.recompute, zero=args.zero, attention=args.attention, layout=args.layout,
                          microbatches=1)
    m = 2 * spec.pp if args.microbatches is None else args.microbatches
    spec = spec_lib.ParallelSpec(**{**spec.__dict__, "microbatches": m})

    from jaxpar import reference

    layers = 2 * spec.pp * spec.resolved_chunks if args.layers is None else args.layers
    cfg = reference.ModelConfig(n_layers=layers, d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                head_dim=max(2, args.d_model // args.heads), d_ff=args.ffn, vocab=args.vocab,
                                mlp="swiglu", n_experts=args.experts, top_k=min(args.top_k, max(args.experts, 1)),
                                rope_theta=10000.0, router=args.router, aux_loss=args.aux_loss,
                                bias_rate=args.bias_rate)
    batch = spec.dp * spec.ep * m if args.batch is None else args.batch
    spec.check(cfg, batch_size=batch, seq_len=args.seq)        # every problem, before JAX starts
    from jaxpar import errors

    if args.checkpoint is not None:
        errors.writable_path("directory", args.checkpoint, directory=True)
    if args.log is not None:
        errors.writable_path("log", args.log)

    import jax

    from jaxpar import mesh
    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.loop import fit
    from jaxpar.train.optim import OptimConfig
    from jaxpar.train.step import Trainer

    warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    optim = OptimConfig(lr=args.lr, warmup=min(warmup, args.steps), steps=args.steps, clip=args.clip)
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    mesh.use_cpu_devices(spec.devices if args.devices is None else args.devices)
    with contextlib.ExitStack() as stack:    # the checkpoints' threads end here, whatever is raised
        ckpt = stack.enter_context(Checkpoints(args.checkpoint, every=args.every)) if args.checkpoint else None
        trainer = Trainer(cfg, spec, optim, batch_size=batch, seq_len=args.seq, devices=jax.devices()[:spec.devices])
        _, history = fit(trainer, steps=args.steps, checkpoints=ckpt, log=args.log,
                         progress=not (args.quiet or args.json))
    return _report(args, trainer, history)


def _report(args, trainer, history) -> int:
    if not history.steps:       # resumed from a checkpoint of the last step: nothing to train, nothing to measure
        done = history.resumed_from or 0
        print(json.dumps({"steps": 0, "resumed_from": done, "history": []}) if args.json else
              f"nothing to train: the checkpoint is at step {done} of --steps {args.steps}")
        return 0
    from jaxpar.train.summary import format_summary, summarize

    summary = summarize(trainer, history, out=args.out)
    if args.json:
        c = summary["collectives"]
        summary["collectives"] = {k: (v.to_json() if hasattr(v, "to_json") else {str(n): b for n, b in v.items()}
                                      if isinstance(v, dict) else v) for k, v in c.items()}
        summary["resumed_from"] = history.resumed_from
        summary["history"] = history.rows()
        print(json.dumps(summary, indent=1, default=str))
    else:
        if history.resumed_from is not None:
            print(f"resumed from the checkpoint of step {history.resumed_from}")
        print(format_summary(summary))
    return 0 if summary["collectives_match"] else 1
