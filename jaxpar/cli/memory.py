"""`jaxpar memory`: one layer's activations term by term (lecture 4.2-4.5), and the
first pipeline stage's whole model.

    jaxpar memory                                          GPT-3 175B's layer: 0.86 + 2.01 = 2.87 GB
    jaxpar memory --tp 8 --sp --recompute selective        34sbh/t: 0.107 GB
    jaxpar memory --seq 131072 --tp 8 --sp                 lecture 5.1: the attention share, 99%
    jaxpar memory --model llama3-405b --seq 8192 --tp 8 --sp --recompute selective --pp 16 --microbatches 16
"""

from __future__ import annotations

import argparse
import json

from jaxpar import errors
from jaxpar.cli.plan import table
from jaxpar.memory import activations as A
from jaxpar.pipeline import formulas as pipeline_formulas
from jaxpar.schedules import orders
from jaxpar.planner import catalog
from jaxpar.planner.search import ACTIVATIONS, block

FLAGS = {"seq_len": "--seq", "batch_size": "--batch", "tp": "--tp", "cp": "--cp", "sp": "--sp",
         "recompute": "--recompute", "pp": "--pp", "stages": "--pp", "microbatches": "--microbatches", "chunks": "--chunks"}
HELP = "activation memory of one layer, term by term, and of the first pipeline stage (lecture 4.2-4.5)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt3-175b", help=f"one of: {', '.join(catalog.MODELS)}")
    parser.add_argument("--activations", default="block", choices=ACTIVATIONS,
                        help="block: the model's own layer; gpt: Korthikanti's GPT-3 layer at its h and a")
    parser.add_argument("--seq", dest="seq_len", type=int, default=2048, help="sequence length s (default 2048)")
    parser.add_argument("--batch", dest="batch_size", type=int, default=1,
                        help="sequences b of one microbatch (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size t")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism with tp")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--recompute", default="none", choices=A.RECOMPUTE)
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size pp (devices), for the first stage's total")
    parser.add_argument("--schedule", default=orders.DEFAULT, help=f"one of: {', '.join(orders.REGISTRY)}")
    parser.add_argument("--microbatches", type=int, default=1, help="microbatches m per pipeline")
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks per device: interleaved's (default 2); the others have their own")
    parser.add_argument("--json", action="store_true")


def main(args) -> int:
    model = catalog.model(args.model)
    blk = block(model, args.activations)
    kw = dict(seq_len=args.seq_len, batch_size=args.batch_size, tp=args.tp, sp=args.sp, cp=args.cp,
              recompute=args.recompute)
    terms = A.breakdown(blk, **kw)
    layer = sum(b for _, b in terms)
    errors.whole("pp", args.pp)    # refused as pp (--pp), before the schedule's p
    in_flight = pipeline_formulas.in_flight(args.schedule, p=args.pp, m=args.microbatches, chunks=args.chunks)
    chunks = orders.lookup(args.schedule).chunks if args.chunks is None else args.chunks
    if args.pp * chunks > model.n_layers:
        raise errors.ConfigError(f"pp={args.pp} with {chunks} chunk{'s' * (chunks > 1)} per device is "
                                 f"{args.pp * chunks} stages for the {model.n_layers} layers of {model.name}: every "
                                 f"stage needs a layer; use pp={model.n_layers // chunks} or less")
    stage = A.first_stage_bytes(blk, n_layers=model.n_layers, pp=args.pp, in_flight=in_flight, **kw)
    quad = sum(b for name, b in terms if name in ("softmax output", "softmax dropout mask", "dropout output"))
    out = {"terms": dict(terms), "layer_bytes": layer, "attention_matrix_bytes": quad,
           "layers": model.n_layers, "first_stage_bytes": stage,
           "in_flight": in_flight}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{model.name} layer ({args.activations}: h={blk.d_model} a={blk.n_heads} K={blk.n_kv_heads} "
          f"F={blk.d_ff} {blk.mlp}"
          f"{' dropout' if blk.dropout else ''}), s={args.seq_len} b={args.batch_size} tp={args.tp}"
          f"{' sp' if args.sp else ''} cp={args.cp} recompute={args.recompute}\n")
    print(table([{"term": n, "GB": b / 1e9} for n, b in terms]))
    print(f"\none layer: {(layer - quad) / 1e9:.3g} + {quad / 1e9:.3g} (attention matrix) = {layer / 1e9:.3g} GB; "
          f"{model.n_layers} layers: {model.n_layers * layer / 1e9:.3g} GB")
    print(f"first stage, pp={args.pp} {args.schedule} m={args.microbatches}: ceil({model.n_layers}/{args.pp}) layers x "
          f"{out['in_flight']:g} microbatches in flight = {stage / 1e9:.3g} GB")
    return 0
