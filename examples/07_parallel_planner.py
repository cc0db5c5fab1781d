"""The 3D/4D parallelism planner (lecture section 7).

    python examples/07_parallel_planner.py

Mirrors the lecture's 07_parallel_planner.py. Pure Python (no JAX). Opens with the
technique: one call, `search.best(model, cluster, tokens=..., seq_len=...)`, for Llama 3 405B
on 16384 H100, and the plan it returns explained: microbatches, memory per GPU term by
term, and the step time from compute, communication and the pipeline bubble. Then:
  demo 1  the fastest feasible configurations, TP 8 vs TP 16 communication, the bubble
          at p x d = 2048, and the published TP 8 x PP 16 x DP 128;
  demo 2  Llama 3 8B on 64 GPUs, 4M tokens: t = p = 1, all data parallel;
  demo 3  the published configurations of real trainings, evaluated by the planner;
  demo 4  exercises 1, 3, 7 and 8;
  demo 5  bad input: a ConfigError naming the constraint.
Same tables: `jaxpar plan ...`, `jaxpar exercise N`.
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
    found = S.search(model, cluster, tokens=16 * 2**20, seq_len=8192)
    feasible = [e for e in found if e.feasible]
    print(f"  {len(found)} configurations in {time.perf_counter() - start:.2f} s, {len(feasible)} feasible; fastest:")
    for e in feasible[:5]:
        print(f"    {e.candidate.label():<36} step {e.step:5.2f} s  bubble {e.bubble:5.1%}  "
              f"memory {e.memory['total'] / 1e9:5.1f} GB  TP comm {e.ratio('tp'):4.0%} of compute")
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


def demo_published():
    print("\n== demo 3: published configurations, evaluated (full recompute) ==")
    for p in catalog.PUBLISHED:
        e = S.evaluate(catalog.model(p.model), S.Cluster(gpu=catalog.accelerator(p.gpu), gpus=p.gpus),
                       S.Candidate(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, recompute="full"), tokens=p.tokens,
                       seq_len=p.seq_len)
        print(f"  {p.model:<12} {p.gpus:>5} {p.gpu:<5} seq {p.seq_len:>6}: {e.candidate.label():<38} "
              f"{'feasible' if e.feasible else e.reasons[0]:<9} bubble {e.bubble:5.1%}  ({p.source})")


def demo_exercises():
    print("\n== demo 4: exercises ==")
    for k in (1, 3, 7, 8):
        print(f"  {k}: " + exercise_cli.ANSWERS[k](getattr(exercises, f"exercise_{k}")()))


def demo_bad_input():
    print("\n== demo 5: bad input ==")
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
    demo_published()
    demo_exercises()
    demo_bad_input()
