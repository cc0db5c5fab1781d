"""The 3D/4D parallelism planner (lecture section 7). Pure Python (no JAX).

    python examples/07_parallel_planner.py

Mirrors the lecture's 07_parallel_planner.py: `search.best` for Llama 3 405B on 16384 H100 and
the plan explained (microbatches, memory term by term, step time); TP 8 vs 16, the published
TP 8 x PP 16 x DP 128; Llama 3 8B on 64 GPUs; exercises 1, 3, 7 and 8; bad input refused.
The tables (fastest configurations, published ones): `jaxpar plan`, `jaxpar plan --list`,
`jaxpar plan --config tp=8,pp=16,dp=128,recompute=full`; each exercise: `jaxpar exercise N`.
"""

import time

from jaxpar.cli import exercise as exercise_cli
from jaxpar.errors import ConfigError
from jaxpar.planner import catalog, exercises
from jaxpar.planner import search as S

H100 = catalog.accelerator("h100")


def lesson():
    print("== Llama 3 405B on 16384 H100 (MFU 50%, ZeRO-1), 16M tokens a step in sequences of 8192: the plan ==")
    model, cluster = catalog.model("llama3-405b"), S.Cluster(gpu=H100, gpus=16384)
    plan = S.best(model, cluster, tokens=16 * 2**20, seq_len=8192)     # every (tp, pp, dp, v, mb, recompute) tried
    c, t = plan.candidate, plan.times
    print(f"  {c.label()}: tensor {c.tp}-way in a node, {c.pp} pipeline stages of {c.chunks} chunks each ({c.schedule} "
          f"schedule), {c.dp} data-parallel replicas, {c.recompute} recompute")
    print(f"  m = {S.sequences(16 * 2**20, 8192)} sequences / (dp {c.dp} x microbatch_size {c.microbatch_size}) = "
          f"{plan.microbatches} microbatches per pipeline; bubble {plan.bubble:.1%}")
    mem = plan.memory
    print(f"  memory per GPU: params {mem['params'] / 1e9:.2f} + grads {mem['grads'] / 1e9:.2f} + optimizer "
          f"{mem['optimizer'] / 1e9:.2f} (ZeRO-1 over dp) + activations {mem['activations'] / 1e9:.2f} = "
          f"{mem['total'] / 1e9:.1f} GB of {H100.memory / 1e9:.0f} GB")
    print(f"  step = (compute {t['compute']:.2f} + TP {t['tp']:.2f} + PP {t['pp']:.2f} s) / (1 - bubble) + "
          f"DP {t['dp']:.2f} s = {plan.step:.2f} s")
    print(f"  the rule (lecture 7.2): of the plans within {S.TIE:.0%} of the fastest, the least model parallelism")


def demo_405b():
    print("\n== demo 1: Llama 3 405B, 16384 H100, seq 8192, 16M tokens, MFU 50%, ZeRO-1 ==")
    model, cluster = catalog.model("llama3-405b"), S.Cluster(gpu=H100, gpus=16384)
    start = time.perf_counter()
    found = S.search(model, cluster, tokens=16 * 2**20, seq_len=8192)     # every one, the fastest first
    print(f"  {len(found)} configurations in {time.perf_counter() - start:.2f} s, "
          f"{sum(e.feasible for e in found)} feasible (the fastest: `jaxpar plan`)")
    peak = S.Cluster(gpu=H100, gpus=16384, mfu=1.0)
    for tp, pp, dp in ((8, 16, 128), (16, 16, 64)):
        e = S.evaluate(model, peak, S.Candidate(tp=tp, pp=pp, dp=dp), tokens=16 * 2**20, seq_len=8192)
        print(f"  TP {tp:>2}: communication {e.ratio('tp'):.2f}x compute at peak (lecture: TP 8 21%, TP 16 about 4x)")
    pub = S.evaluate(model, cluster, S.Candidate(tp=8, pp=16, dp=128, recompute="full"), tokens=16 * 2**20,
                     seq_len=8192)
    sel = S.evaluate(model, cluster, S.Candidate(tp=8, pp=16, dp=128, recompute="selective"), tokens=16 * 2**20,
                     seq_len=8192)
    print(f"  published TP 8 PP 16 DP 128: m = {pub.microbatches}, bubble {pub.bubble:.1%} (lecture: near 50%); "
          f"selective recompute {sel.memory['total'] / 1e9:.0f} GB > 80 GB, full recompute "
          f"{pub.memory['total'] / 1e9:.0f} GB")


def demo_8b():
    print("\n== demo 2: Llama 3 8B, 64 H100, 4M tokens ==")
    b = S.best(catalog.model("llama3-8b"), S.Cluster(gpu=H100, gpus=64), tokens=4 * 2**20, seq_len=8192)
    print(f"  planner: {b.candidate.label()} (lecture: t = p = 1, all data parallel with ZeRO-1)")


def demo_exercises():
    print("\n== demo 3: exercises ==")
    for k in (1, 3, 7, 8):
        print(f"  {k}: " + exercise_cli.ANSWERS[k](getattr(exercises, f"exercise_{k}")()))


def demo_bad_input():
    print("\n== demo 4: bad input ==")
    for what, call in [("an unknown model", lambda: catalog.model("gpt5")),
                       ("12 H100 (8 per node)", lambda: S.Cluster(gpu=H100, gpus=12)),
                       ("405B on one node", lambda: S.best(catalog.model("llama3-405b"), S.Cluster(gpu=H100, gpus=8),
                                                           tokens=8 * 8192, seq_len=8192))]:
        try:
            call()
            print(f"  {what}: no error (FAIL)")
        except ConfigError as e:
            print(f"  {what}: ConfigError: {e}")


if __name__ == "__main__":
    lesson()
    demo_405b()
    demo_8b()
    demo_exercises()
    demo_bad_input()
