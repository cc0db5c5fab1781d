"""`jaxpar plan`: the 3D/4D planner (lecture 7.3); `jaxpar memory`, `jaxpar exercise`.

    jaxpar plan                                   Llama 3 405B on 16384 H100, seq 8192, 16M tokens
    jaxpar plan --model llama3-8b --gpus 64 --tokens 4M
    jaxpar plan --config tp=8,pp=16,dp=128        one configuration, every figure
    jaxpar plan --config tp=8,pp=16,dp=128,layers=balanced     uneven stages (or layers=7/8x14/7)
    jaxpar plan --why                             also every rejected configuration and its reason
    jaxpar plan --list                            the models, GPUs and published configurations known
    jaxpar memory --model gpt3-175b --seq 2048 --tp 8 --sp --recompute selective
    jaxpar exercise 3                             the lecture's exercises 1, 3, 7, 8

Pure Python: jaxpar plan starts without JAX. --json prints the same as data.
"""

from __future__ import annotations

import argparse
import json

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.memory import activations
from jaxpar.planner import catalog
from jaxpar.planner import search as S

FLAGS = {"gpus": "--gpus", "mfu": "--mfu", "tokens": "--tokens", "seq_len": "--seq", "zero": "--zero",
         "activations": "--activations", "top": "--top"}   # cp= and tp= are --config's keys
HELP = "the 3D/4D parallelism planner: memory, bubble and communication of every configuration (lecture 7)"
GB = 1e9


def tokens(text: str) -> float:
    """'16M' -> 16 * 2**20 (K, M, G are powers of two, as the lecture's batches), '4096' -> 4096."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper()
    try:
        return float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise ConfigError(f"tokens={text!r}: a token count such as 16M, 4096 or 3.2e7") from None


def table(rows: list[dict]) -> str:
    if not rows:
        return "(none)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    width = {k: max(len(k), *(len(cell(r.get(k, ""))) for r in rows)) for k in keys}
    lines = ["  ".join(k.ljust(width[k]) for k in keys), "  ".join("-" * width[k] for k in keys)]
    lines += ["  ".join(cell(r.get(k, "")).ljust(width[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def row(e: S.Estimate, cluster: S.Cluster) -> dict:
    c = e.candidate
    out = {"config": c.label(), "m": e.microbatches}
    if e.times:
        peak = e.times["compute"] * cluster.mfu
        out |= {"step s": e.times["step"], "MFU": peak / e.times["step"], "bubble": e.bubble,
                "memory GB": e.memory["total"] / GB, "activations GB": e.memory["activations"] / GB,
                "TP/compute": e.ratio("tp"), "EP/compute": e.ratio("ep"), "DP s": e.times["dp"]}
    if e.reasons:
        out["rejected"] = "; ".join(e.reasons)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama3-405b", help=f"one of: {', '.join(catalog.MODELS)}")
    parser.add_argument("--gpu", default="h100", help=f"one of: {', '.join(catalog.ACCELERATORS)}")
    parser.add_argument("--gpus", type=int, default=16384, help="GPU count (a multiple of GPUs per node)")
    parser.add_argument("--seq", dest="seq_len", type=int, default=8192, help="sequence length (default 8192)")
    parser.add_argument("--tokens", default="16M", help="global batch in tokens: 16M, 4096, 3.2e7 (default 16M)")
    parser.add_argument("--mfu", type=float, default=0.5, help="fraction of peak FLOP/s compute reaches (0.5)")
    parser.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp (default 1)")
    parser.add_argument("--cp", default="1", help="context-parallel sizes to try, e.g. 1,2,4 (default 1)")
    parser.add_argument("--activations", default="block", choices=S.ACTIVATIONS,
                        help="block: the model's own layer; gpt: Korthikanti's 34sbh + 5as^2b (the lecture's)")
    parser.add_argument("--config", help="evaluate one configuration, e.g. tp=8,pp=16,dp=128,recompute=full; "
                                         "layers=balanced or layers=7/8x14/7: uneven stages (the layers of each)")
    parser.add_argument("--top", type=int, default=10, help="feasible configurations shown (default 10)")
    parser.add_argument("--why", action="store_true", help="also list every rejected configuration and why")
    parser.add_argument("--list", action="store_true", help="the models, GPUs and published configurations")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "chunks", "microbatch_size", "recompute", "layers")
ALIASES = {"v": "chunks", "mb": "microbatch_size"}     # as Candidate.label() writes them


def whole_number(what: str, text: str, example: str) -> int:
    """An int from a flag's text, or ConfigError naming `what` and an `example`."""
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{what}{text!r} is not a whole number: give e.g. {example}") from None


def _config(text: str, model: catalog.Model, seq_len: int, gpus: int) -> S.Candidate:
    """--config's tp=8,pp=16,dp=128,...: each key once; dp, when left out, the GPUs the rest
    leave (gpus / (tp x pp x cp))."""
    fields, split = {}, None
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key, value = ALIASES.get(key.strip(), key.strip()), value.strip()
        if key not in CONFIG_KEYS or not eq:
            raise ConfigError(f"--config: {part.strip()!r} is not key=value with a key of {', '.join(CONFIG_KEYS)} "
                              "(e.g. --config tp=8,pp=16,dp=128)")
        if key in fields or (key == "layers" and split is not None):
            raise ConfigError(f"--config: {key} is given twice; give each key once")
        if key == "layers":
            split = value
        else:
            fields[key] = value if key == "recompute" else whole_number(f"--config {key}=", value, f"{key}=8")
    if "dp" not in fields:
        rest = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1)
        if rest < 1 or gpus % rest:
            raise ConfigError(f"--config: tp x pp x cp = {rest} does not divide the {gpus} GPUs, so dp cannot be "
                              "inferred: give dp, or sizes whose product divides --gpus")
        fields["dp"] = gpus // rest
    cand = S.Candidate(**fields)
    if split is None:
        return cand
    counts = S.parse_split(split, model=model, stages=cand.pp * cand.chunks, seq_len=seq_len, chunks=cand.chunks)
    return S.Candidate(**fields, layers_per_stage=counts)


def split_lines(split: S.Split) -> list[str]:
    """The proposed uneven split of the choice, against the nearest-to-even one."""
    b, e = split.balanced, split.near_even
    fig = lambda x: (f"step {x.step:.2f} s, bubble {x.bubble:.3f}, memory {x.memory.get('total', 0) / GB:.1f} GB"
                     if x.times else "; ".join(x.reasons))
    lines = [f"\nuneven stages (the LM head costs {split.head_cost:.2f} layers, on the last stage; per-stage costs: "
             f"the slowest stage sets the step): balanced split layers={S.split_label(split.layers_per_stage)}: "
             f"{fig(b)}"]
    if e.candidate.layers_per_stage == split.layers_per_stage:
        return lines + ["  (the nearest-to-even split is the same)"]
    return lines + [f"  nearest to even, layers={S.split_label(e.candidate.layers_per_stage)}: {fig(e)}"]


def main(args) -> int:
    if args.list:
        listing = {"models": {k: vars(m) for k, m in catalog.MODELS.items()},
                   "gpus": {k: vars(g) for k, g in catalog.ACCELERATORS.items()},
                   "published": [vars(p) for p in catalog.PUBLISHED]}
        print(json.dumps(listing, indent=1) if args.json else
              "models: " + ", ".join(catalog.MODELS) + "\ngpus: " + ", ".join(catalog.ACCELERATORS) + "\n\n"
              + table([{k: v for k, v in vars(p).items()} for p in catalog.PUBLISHED]))
        return 0
    errors.whole("top", args.top, maximum=10**6, fix="show at least one configuration, e.g. --top 10")
    args.tokens = tokens(args.tokens)
    model, gpu = catalog.model(args.model), catalog.accelerator(args.gpu)
    cluster = S.Cluster(gpu=gpu, gpus=args.gpus, mfu=args.mfu)
    head = (f"{model.name} ({model.params / 1e9:.1f}B params) on {args.gpus} {gpu.name}, seq {args.seq_len}, "
            f"{args.tokens / 2**20:g}M tokens a step, MFU {args.mfu}, ZeRO-{args.zero}, activations: {args.activations}")
    if args.config:
        e = S.evaluate(model, cluster, _config(args.config, model, args.seq_len, args.gpus), tokens=args.tokens, seq_len=args.seq_len, zero=args.zero,
                       activation_model=args.activations)
        out = row(e, cluster) | {"memory": e.memory, "times": e.times}
        print(json.dumps(out, indent=1, default=str) if args.json else head + "\n\n" + table([row(e, cluster)]))
        return 0
    cps = tuple(whole_number("--cp ", c.strip(), "--cp 1,2,4") for c in args.cp.split(","))
    for c in cps:
        if not 1 <= c <= args.gpus:
            raise ConfigError(f"--cp {c}: context-parallel sizes run from 1 to the {args.gpus} GPUs; e.g. --cp 1,2,4")
    found = S.search(model, cluster, tokens=args.tokens, seq_len=args.seq_len, zero=args.zero, cps=cps,
                     activation_model=args.activations)
    choice = S.best(model, cluster, tokens=args.tokens, seq_len=args.seq_len, zero=args.zero, cps=cps,
                    activation_model=args.activations)
    published = [p for p in catalog.PUBLISHED
                 if p.model == model.name and p.gpus == args.gpus and p.seq_len == args.seq_len]
    pub_rows = [row(S.evaluate(model, cluster, S.Candidate(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep,
                                                           recompute=rc), tokens=args.tokens, seq_len=args.seq_len,
                               zero=args.zero, activation_model=args.activations), cluster) | {"source": p.source}
                for p in published for rc in activations.RECOMPUTE]
    feasible = [e for e in found if e.feasible]
    rejected = [e for e in found if not e.feasible]
    split = S.propose_split(model, cluster, choice.candidate, tokens=args.tokens, seq_len=args.seq_len,
                            zero=args.zero, activation_model=args.activations) if choice.candidate.pp > 1 else None
    if args.json:
        print(json.dumps({"choice": row(choice, cluster), "split": split.to_dict() if split else None,
                          "feasible": [row(e, cluster) for e in feasible[:args.top]],
                          "published": pub_rows, "rejected": [row(e, cluster) for e in rejected] if args.why
                          else len(rejected)}, indent=1))
        return 0
    print(head)
    print(f"\n{len(found)} configurations, {len(feasible)} feasible. Fastest {min(args.top, len(feasible))}:\n")
    print(table([row(e, cluster) for e in feasible[:args.top]]))
    print(f"\nplanner's choice (the least model parallelism within {S.TIE:.0%} of the fastest): "
          f"{choice.candidate.label()}, step {choice.step:.2f} s")
    if split is not None:
        print("\n".join(split_lines(split)))
    if pub_rows:
        print("\npublished configuration, with each recompute choice:\n")
        print(table(pub_rows))
    if args.why:
        print(f"\nrejected ({len(rejected)}):\n")
        print(table([{"config": e.candidate.label(), "why": "; ".join(e.reasons)} for e in rejected]))
    else:
        reasons = {}
        for e in rejected:
            key = e.reasons[0].split(" ")[0] if e.reasons[0].startswith("memory") else e.reasons[0]
            reasons[key] = reasons.get(key, 0) + 1
        print(f"\nrejected: {len(rejected)} (--why lists each); the most common reason: "
              f"{max(reasons, key=reasons.get) if reasons else '-'}")
    return 0
