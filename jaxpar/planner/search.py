"""Enumerate parallel configurations, reject the impossible ones with their reason, and
rank the rest by a modelled step time (lecture 7.2-7.3).

For a model, a cluster and a global batch of `tokens` in sequences of `seq_len`,
`candidates` lists every (tp, pp, dp, cp, ep, chunks, microbatch_size, recompute) with
tp*pp*dp*cp = GPUs; `evaluate` checks one against the rules below and, if it keeps them,
costs it with `estimate.py` (memory per GPU, bubble, step time by part: that module's
docstring gives the model); `search` ranks them all, `best` picks the planner's choice,
and `propose_split` the uneven split (`estimate.balanced_split`) of the choice's stages.

Rejected: a tp that splits neither heads nor KV heads, a pp larger than the layers, a
batch that does not split into dp x microbatch_size sequences, m < p, the sizes the schedule
itself refuses (its registry entry's `requires`: m a multiple of p when interleaved), a
sequence cp (and tp with SP) does not split, an ep that does not divide dp or the
experts, and memory above the accelerator's. `Estimate.reasons` says why.

The candidate, the cluster and the uneven-stage helpers (`head_cost`, `balanced_split`,
`pipeline_span`, `split_label`) are defined in `estimate.py` and importable from here
too: the CLI, the examples and the tests read the planner through this one module.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jaxpar.errors import ConfigError
from jaxpar.memory import activations
from jaxpar.pipeline import stage_layers
from jaxpar.schedules import orders
from jaxpar.planner.catalog import Model
from jaxpar.planner.estimate import (ACTIVATIONS, Candidate, Cluster, balanced_split, block, bubble_and_slowest,
                                     head_cost, memory_per_gpu, pipeline_span, sequences, split_label, step_times)

__all__ = ["Cluster", "Candidate", "Estimate", "Split", "evaluate", "candidates", "search", "best", "propose_split",
           "parse_split", "sequences", "block", "ACTIVATIONS", "head_cost", "balanced_split", "pipeline_span",
           "split_label", "TIE"]

TIE = 0.02              # plans within 2% of the fastest are a tie: the simplest wins (lecture 7.2)
GB = 1e9


@dataclasses.dataclass
class Estimate:
    candidate: Candidate
    reasons: list
    microbatches: int = 0
    memory: dict = dataclasses.field(default_factory=dict)
    bubble: float = 0.0
    times: dict = dataclasses.field(default_factory=dict)   # seconds per step, by part

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def step(self) -> float:
        return self.times.get("step", math.inf)

    def ratio(self, part: str) -> float:
        """A communication time over the compute time."""
        return self.times[part] / self.times["compute"]


def evaluate(model: Model, cluster: Cluster, cand: Candidate, *, tokens, seq_len: int, zero: int = 1,
             activation_model: str = "block") -> Estimate:
    """One candidate's estimate: the rules it breaks (then nothing more), else its memory per
    GPU against the GPU's and its step time."""
    n_seq = sequences(tokens, seq_len)
    m = n_seq // (cand.dp * cand.microbatch_size) if cand.dp * cand.microbatch_size else 0
    reasons = _broken_rules(model, cluster, cand, n_seq=n_seq, m=m, seq_len=seq_len)
    if reasons:
        return Estimate(candidate=cand, reasons=reasons, microbatches=m)
    memory = memory_per_gpu(model, cand, m=m, seq_len=seq_len, zero=zero, activation_model=activation_model)
    if memory["total"] > cluster.gpu.memory:
        reasons.append(f"memory {memory['total'] / GB:.1f} GB > {cluster.gpu.memory / GB:.0f} GB")
    bubble, slowest = bubble_and_slowest(model, cand, m=m, seq_len=seq_len)
    times = step_times(model, cluster, cand, n_seq=n_seq, m=m, seq_len=seq_len, bubble=bubble, slowest=slowest)
    return Estimate(candidate=cand, reasons=reasons, microbatches=m, memory=memory, bubble=bubble, times=times)


def _broken_rules(model: Model, cluster: Cluster, c: Candidate, *, n_seq: int, m: int, seq_len: int) -> list[str]:
    """Every rule candidate c breaks (m: its microbatches), each as a sentence."""
    reasons = []
    if c.tp * c.pp * c.dp * c.cp != cluster.gpus:
        reasons.append(f"tp x pp x dp x cp = {c.tp * c.pp * c.dp * c.cp} is not the {cluster.gpus} GPUs")
    if model.n_heads % c.tp or (model.n_kv_heads % c.tp and c.tp % model.n_kv_heads):
        reasons.append(f"tp={c.tp} splits neither the {model.n_heads} heads nor the {model.n_kv_heads} KV heads evenly")
    if c.pp > model.n_layers or c.pp * c.chunks > model.n_layers:
        reasons.append(f"pp x chunks = {c.pp * c.chunks} stages for {model.n_layers} layers")
    if n_seq % (c.dp * c.microbatch_size):
        reasons.append(f"{n_seq} sequences do not split into dp={c.dp} x microbatch_size={c.microbatch_size}")
    if c.pp > 1 and m < c.pp:
        reasons.append(f"m = {m} microbatches < p = {c.pp} (the pipeline never fills)")
    try:
        orders.REGISTRY[c.schedule].requires(c.schedule, c.pp, m, c.chunks)
    except ConfigError as e:
        reasons.append(str(e))
    if c.layers_per_stage is not None:
        try:
            stage_layers.layer_split(c.layers_per_stage, model.n_layers, c.pp * c.chunks)
        except ConfigError as e:
            reasons.append(str(e))
    if seq_len % (c.cp * c.tp):
        reasons.append(f"seq_len={seq_len} does not split into cp x tp = {c.cp * c.tp} (context and sequence parallel)")
    if model.experts and (c.dp % c.ep or model.experts % c.ep):
        reasons.append(f"ep={c.ep} must divide dp={c.dp} and the {model.experts} experts")
    if not model.experts and c.ep > 1:
        reasons.append(f"ep={c.ep} on a dense model")
    return reasons


def _powers(limit: int) -> list[int]:
    return [2 ** k for k in range(0, int(math.log2(limit)) + 1) if 2 ** k <= limit]


def candidates(model: Model, cluster: Cluster, *, tps=None, pps=None, cps=(1,), eps=None, chunks=(1, 2),
               microbatch_sizes=(1, 2, 4), recompute=activations.RECOMPUTE):
    """Every Candidate over the given choices (powers of two by default) that uses all GPUs."""
    n = cluster.gpus
    tps = tps or _powers(min(n, 2 * cluster.gpu.per_node))
    pps = pps or _powers(min(n, model.n_layers))
    eps = eps or (_powers(min(n, model.experts)) if model.experts else (1,))
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        for ep, n_chunks, size, rc in itertools.product(eps, chunks if pp > 1 else (1,), microbatch_sizes, recompute):
            yield Candidate(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, chunks=n_chunks, microbatch_size=size, recompute=rc)


def search(model: Model, cluster: Cluster, *, tokens, seq_len: int, zero: int = 1, activation_model: str = "block",
           **choices) -> list[Estimate]:
    """Every candidate evaluated: the feasible ones first, fastest first, then the rejected."""
    sequences(tokens, seq_len)
    block(model, activation_model)
    out = [evaluate(model, cluster, c, tokens=tokens, seq_len=seq_len, zero=zero, activation_model=activation_model)
           for c in candidates(model, cluster, **choices)]
    return sorted(out, key=lambda e: (not e.feasible, e.step, e.candidate.tp, e.candidate.pp))


def best(model: Model, cluster: Cluster, *, tokens, seq_len: int, zero: int = 1, activation_model: str = "block",
         **choices) -> Estimate:
    """The planner's choice: of the feasible configurations within TIE of the fastest, the
    one with the least model parallelism (tp x pp x cp), as the lecture's rule says: what
    data parallelism can do, leave to it (the model is too rough to split 2%). ConfigError
    naming the binding constraint if nothing fits."""
    found = search(model, cluster, tokens=tokens, seq_len=seq_len, zero=zero, activation_model=activation_model,
                   **choices)
    if found and found[0].feasible:
        near = [e for e in found if e.feasible and e.step <= (1 + TIE) * found[0].step]
        return min(near, key=lambda e: (e.candidate.tp * e.candidate.pp * e.candidate.cp, e.step))
    memory = [e for e in found if e.memory]
    closest = min(memory, key=lambda e: e.memory["total"]) if memory else None
    why = (f"the closest, {closest.candidate.label()}, needs {closest.memory['total'] / GB:.1f} GB of "
           f"{cluster.gpu.memory / GB:.0f} GB" if closest else
           f"every candidate fails a divisibility rule, e.g. {found[0].reasons[0]}" if found else "no candidate")
    raise ConfigError(f"{model.name} fits no configuration on {cluster.gpus} {cluster.gpu.name}: {why}. Fix: more "
                      "GPUs, a smaller batch or sequence, or ZeRO-3 (zero=3)")


@dataclasses.dataclass(frozen=True)
class Split:
    """A proposed uneven split for a candidate: the balanced one and, to compare, the
    nearest to even (`stage_layers.even_or_near`), both estimated with per-stage costs."""
    layers_per_stage: tuple[int, ...]
    head_cost: float              # the LM head, in layers
    balanced: Estimate
    near_even: Estimate

    def to_dict(self) -> dict:
        row = lambda e: {"layers_per_stage": list(e.candidate.layers_per_stage), "step s": e.step,
                         "bubble": e.bubble, "memory GB": e.memory.get("total", 0.0) / GB}
        return {"layers_per_stage": list(self.layers_per_stage), "head_cost_layers": self.head_cost,
                "balanced": row(self.balanced), "near_even": row(self.near_even)}


def propose_split(model: Model, cluster: Cluster, cand: Candidate, *, tokens, seq_len: int, zero: int = 1,
                  activation_model: str = "block") -> Split:
    """`balanced_split` of the model's layers over cand's pp*chunks stages, the LM head
    costed (`head_cost`), with the estimates of that split and of the nearest-to-even one."""
    stages = cand.pp * cand.chunks
    cost = head_cost(model, seq_len)
    split = balanced_split(model.n_layers, stages, head_cost=cost, chunks=cand.chunks)
    estimate = lambda counts: evaluate(model, cluster, dataclasses.replace(cand, layers_per_stage=counts),
                                       tokens=tokens, seq_len=seq_len, zero=zero, activation_model=activation_model)
    return Split(layers_per_stage=split, head_cost=cost, balanced=estimate(split),
                 near_even=estimate(stage_layers.even_or_near(model.n_layers, stages)))


def parse_split(text: str, *, model: Model, stages: int, seq_len: int, chunks: int = 1) -> tuple[int, ...]:
    """--config's layers=...: 'balanced' (`balanced_split` with the LM head costed), or
    counts separated by '/', a run written count x times: '7/8x14/7'."""
    if text == "balanced":
        return balanced_split(model.n_layers, stages, head_cost=head_cost(model, seq_len), chunks=chunks)
    counts = []
    for part in text.split("/"):
        value, _, times = part.partition("x")
        if not value.strip().isdigit() or (times and not times.strip().isdigit()):
            raise ConfigError(f"layers={text!r}: give 'balanced' or the layers of each stage separated by '/', "
                              "a run as count x times, e.g. layers=7/8x14/7")
        counts += [int(value)] * (int(times) if times else 1)
    return tuple(counts)
