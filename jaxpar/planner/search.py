"""Enumerate parallel configurations, reject the impossible ones with their reason, and
rank the rest by a modelled step time (lecture 7.2-7.3).

For a model, a cluster (an accelerator, a GPU count, an MFU assumption) and a global
batch of `tokens` in sequences of `seq_len`, every (tp, pp, dp, cp, ep, chunks,
microbatch_size, recompute) with tp*pp*dp*cp = GPUs is estimated (`evaluate`):

  memory    model states (`memory.states`, ZeRO over dp) + the first stage's activations
            (`memory.activations.first_stage_bytes`: the model's own block, sequence
            parallel with tp, microbatches in flight of the schedule);
  compute   tokens x (6 x active params + 6 x n_layers x d_model x seq_len, causal attention)
            / (GPUs x peak x mfu); full recompute adds a forward (x 4/3), selective the
            attention's forward;
  bubble    `pipeline.formulas.bubble` of the schedule (`orders.DEFAULT`, 1F1B, or its
            chunked form with chunks);
  TP        per layer and microbatch, the bytes of `tensor.formulas.tp_block_collectives`
            (forward + backward; + a forward with full recompute) on the ring, 2(t-1)/t of
            each all-reduce, over NVLink when tp fits a node, else the inter-node link;
  EP        4 all-to-alls per MoE layer and microbatch (`expert.formulas.dispatch_bytes`);
  PP        an activation and a gradient per microbatch and chunk across nodes;
  CP        the ring's K/V blocks (reported; the ring hides them behind attention);
  DP        the gradient all-reduce (reduce-scatter + all-gather with ZeRO), once a step.
  step      (compute + TP + EP + PP) / (1 - bubble) + DP: no overlap, a rough model.
  uneven    with `Candidate.layers_per_stage`, per-stage costs (layers, the LM head on the
            last: `head_cost`): the busiest device sets the step and the bubble
            (`pipeline_span`), each device's memory counts its own layers; `balanced_split`
            and `propose_split` give the split that makes the slowest stage fastest.

Rejected: a tp that splits neither heads nor KV heads, a pp larger than the layers, a
batch that does not split into dp x microbatch_size sequences, m < p, the sizes the schedule
itself refuses (its registry entry's `requires`: m a multiple of p when interleaved), a
sequence cp (and tp with SP) does not split, an ep that does not divide dp or the
experts, and memory above the accelerator's. `Estimate.reasons` says why.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.expert import formulas as expert_formulas
from jaxpar.memory import activations, states
from jaxpar.pipeline import formulas as pipeline_formulas
from jaxpar.pipeline import orders, plan
from jaxpar.planner.catalog import Accelerator, Model
from jaxpar.tensor import formulas as tensor_formulas

TIE = 0.02              # plans within 2% of the fastest are a tie: the simplest wins (lecture 7.2)
ACT_DTYPE = "float16"   # 2 bytes, as bf16 (numpy has no bfloat16)
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    gpu: Accelerator
    gpus: int
    mfu: float = 0.5

    def __post_init__(self):
        errors.whole("gpus", self.gpus)
        if self.gpus > 1 and self.gpus % self.gpu.per_node:
            raise ConfigError(f"gpus={self.gpus} is not a multiple of the {self.gpu.per_node} {self.gpu.name} per "
                              f"node: use a multiple of {self.gpu.per_node}")
        if not (isinstance(self.mfu, (int, float)) and 0 < self.mfu <= 1) or isinstance(self.mfu, bool):
            raise ConfigError(f"mfu={self.mfu!r}: the fraction of peak FLOP/s the compute reaches, in (0, 1]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    chunks: int = 1
    microbatch_size: int = 1     # sequences per microbatch
    recompute: str = "none"
    # uneven stages: the layers of each of the pp*chunks model stages (None: the even
    # model, every device ceil(n_layers / pp) layers and the bubble's closed form)
    layers_per_stage: tuple[int, ...] | None = None

    @property
    def schedule(self) -> str:
        """The lecture's schedule (`orders.DEFAULT`), or its chunked form with chunks > 1."""
        kind = orders.REGISTRY[orders.DEFAULT]
        return kind.chunked if self.chunks > 1 else kind.name

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("v", self.chunks)) if v > 1)
        layers = f" layers={split_label(self.layers_per_stage)}" if self.layers_per_stage else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} mb={self.microbatch_size} {self.recompute}{layers}"


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


def sequences(tokens, seq_len) -> int:
    """The sequences of seq_len tokens in a global batch of `tokens`."""
    errors.whole("seq_len", seq_len)
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or tokens <= 0:
        raise ConfigError(f"tokens={tokens!r}: the global batch in tokens, e.g. 16 * 2**20")
    n = tokens / seq_len
    if n < 1 or abs(n - round(n)) > 1e-9:
        raise ConfigError(f"a global batch of {tokens:g} tokens is not a whole number of {seq_len}-token sequences: "
                          f"use a multiple of {seq_len}")
    return round(n)


ACTIVATIONS = ("block", "gpt")


def block(model: Model, activation_model: str = "block") -> activations.Block:
    """The layer the activation model counts: the model's own ("block": its MLP, KV
    heads, dropout or not), or the GPT-3 layer of Korthikanti's 34 sbh + 5 as^2 b with the
    model's h and a ("gpt", as the lecture's planner counts)."""
    errors.one_of("activations", activation_model, ACTIVATIONS)
    if activation_model == "gpt":
        return activations.Block(d_model=model.d_model, n_heads=model.n_heads)
    return activations.Block(d_model=model.d_model, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
                             d_ff=model.d_ff, mlp=model.mlp, dropout=model.dropout)


def _sizes(model: Model):
    """The sizes tensor.formulas reads, for one of the model's blocks."""
    return SimpleNamespace(vocab=model.vocab, d_model=model.d_model, n_heads=model.n_heads,
                           n_kv_heads=model.n_kv_heads, head_dim=model.d_model // model.n_heads, d_ff=model.d_ff,
                           mlp=model.mlp)


def tp_wire_bytes(model: Model, *, tokens: int, tp: int, passes: int = 2) -> float:
    """Bytes one device sends for one layer over `tokens` tokens: `passes` programs
    (forward, backward, and a recomputed forward) of tensor.formulas' collectives, on a
    ring (all-reduce 2(t-1)/t, all-gather / reduce-scatter (t-1)/t of the bytes)."""
    if tp == 1:
        return 0.0
    total = 0.0
    for backward in (False, True, False)[:passes]:     # forward, backward, the recomputed forward
        c = tensor_formulas.tp_block_collectives(cfg=_sizes(model), batch_size=1, seq_len=tokens, dtype=ACT_DTYPE,
                                                 tp=tp, backward=backward)
        total += sum(b * (2 if op == "all-reduce" else 1) * (tp - 1) / tp for op, (_, b) in c.items())
    return total


def evaluate(model: Model, cluster: Cluster, cand: Candidate, *, tokens, seq_len: int, zero: int = 1,
             activation_model: str = "block") -> Estimate:
    """One candidate's estimate: the rules it breaks (then nothing more), else its memory per
    GPU against the GPU's and its step time."""
    n_seq = sequences(tokens, seq_len)
    m = n_seq // (cand.dp * cand.microbatch_size) if cand.dp * cand.microbatch_size else 0
    reasons = _broken_rules(model, cluster, cand, n_seq=n_seq, m=m, seq_len=seq_len)
    if reasons:
        return Estimate(candidate=cand, reasons=reasons, microbatches=m)
    if cand.layers_per_stage is not None:
        memory = _uneven_memory(model, cand, m=m, seq_len=seq_len, zero=zero, activation_model=activation_model)
    else:
        memory = _memory(model, cand, m=m, seq_len=seq_len, zero=zero, activation_model=activation_model)
    if memory["total"] > cluster.gpu.memory:
        reasons.append(f"memory {memory['total'] / GB:.1f} GB > {cluster.gpu.memory / GB:.0f} GB")
    bubble = pipeline_formulas.bubble(cand.schedule, cand.pp, m, cand.chunks) if cand.pp > 1 else 0.0
    slowest = 1.0          # the busiest device's compute over the mean device's
    if cand.layers_per_stage is not None:
        costs = stage_costs(cand.layers_per_stage, head_cost=head_cost(model, seq_len))
        span, busiest = pipeline_span(costs, pp=cand.pp, microbatches=m, chunks=cand.chunks)
        bubble = (span - busiest) / span
        slowest = busiest / (m * sum(costs) / cand.pp)
    times = _times(model, cluster, cand, n_seq=n_seq, m=m, seq_len=seq_len, bubble=bubble, slowest=slowest)
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
            plan.layer_split(c.layers_per_stage, model.n_layers, c.pp * c.chunks)
        except ConfigError as e:
            reasons.append(str(e))
    if seq_len % (c.cp * c.tp):
        reasons.append(f"seq_len={seq_len} does not split into cp x tp = {c.cp * c.tp} (context and sequence parallel)")
    if model.experts and (c.dp % c.ep or model.experts % c.ep):
        reasons.append(f"ep={c.ep} must divide dp={c.dp} and the {model.experts} experts")
    if not model.experts and c.ep > 1:
        reasons.append(f"ep={c.ep} on a dense model")
    return reasons


def _memory(model: Model, c: Candidate, *, m: int, seq_len: int, zero: int, activation_model: str) -> dict:
    """Bytes per GPU: params, grads, optimizer (ZeRO `zero`), the first stage's activations
    in flight, and their total."""
    st = states.state_bytes(dense=model.dense_params, experts=model.expert_params, tp=c.tp, pp=c.pp, dp=c.dp,
                            ep=c.ep, zero=zero)
    in_flight = pipeline_formulas.in_flight(c.schedule, p=c.pp, m=m, chunks=c.chunks)
    act = activations.first_stage_bytes(block(model, activation_model), n_layers=model.n_layers, seq_len=seq_len,
                                        batch_size=c.microbatch_size, tp=c.tp, sp=c.tp > 1, cp=c.cp,
                                        recompute=c.recompute, pp=c.pp, in_flight=in_flight)
    memory = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": act}
    memory["total"] = sum(memory.values())
    return memory


def _times(model: Model, cluster: Cluster, c: Candidate, *, n_seq: int, m: int, seq_len: int,
           bubble: float, slowest: float = 1.0) -> dict:
    """Seconds per step: compute, the tp, ep, pp, cp (hidden under compute) and dp traffic,
    and the step, (compute x slowest + tp + ep + pp) / (1 - bubble) + dp, where `slowest`
    is the busiest pipeline device's compute over the mean's (1 with the even model; with
    uneven stages the slowest stage sets the pace)."""
    gpu = cluster.gpu
    flops = 6 * model.active_params + 6 * model.n_layers * model.d_model * seq_len
    extra = {"none": 0.0, "selective": 2 * model.n_layers * model.d_model * seq_len, "full": 2 * model.active_params}
    compute = n_seq * seq_len * (flops + extra[c.recompute]) / (cluster.gpus * gpu.flops * cluster.mfu)
    held = max(device_layers(c.layers_per_stage, c.pp, c.chunks)) if c.layers_per_stage else -(-model.n_layers // c.pp)
    passes_per_step = held * m          # layer-microbatches per device per step (the device holding the most)
    local_tokens = c.microbatch_size * seq_len // c.cp
    bw = lambda group: gpu.intra if group <= gpu.per_node else gpu.inter
    tp_s = passes_per_step * tp_wire_bytes(model, tokens=local_tokens, tp=c.tp,
                                           passes=3 if c.recompute == "full" else 2) / bw(c.tp)
    ep_s = 0.0
    if model.experts and c.ep > 1:
        moe_passes = -(-model.moe_layers // c.pp) * m
        ep_s = moe_passes * 4 * expert_formulas.dispatch_bytes(tokens=local_tokens, top_k=model.top_k,
                                                               d_model=model.d_model, ep=c.ep, dtype=ACT_DTYPE) \
            / bw(c.tp * c.ep)
    act_bytes = local_tokens * model.d_model * 2 / c.tp
    pp_s = 2 * m * c.chunks * act_bytes / gpu.inter if c.pp > 1 else 0.0
    kv = model.n_kv_heads / model.n_heads
    cp_s = passes_per_step * 3 * (c.cp - 1) * 2 * local_tokens * model.d_model * kv * 2 / c.tp / bw(c.tp * c.cp)
    grad_bytes = 2 * (model.dense_params / (c.tp * c.pp))
    dp_s = grad_bytes * 2 * (c.dp - 1) / c.dp / gpu.inter if c.dp > 1 else 0.0
    step = (compute * slowest + tp_s + ep_s + pp_s) / (1 - bubble) + dp_s
    return {"compute": compute, "tp": tp_s, "ep": ep_s, "pp": pp_s, "cp (hidden)": cp_s, "dp": dp_s, "step": step}


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


# ---- uneven stages: per-stage costs, the pipeline's span, a balanced split -----------------
#
# Stage k's time per microbatch, in units of one transformer layer's (forward and
# backward): its layers, plus the embedding on the first stage and the LM head on the
# last. The pipeline runs at the pace of its busiest device: with the loop placement of
# `chunks` chunks (stage c*p + d on device d), device d's time per microbatch is the sum
# of its chunks' stages, T_d, and the step's span is m max_d T_d (the busiest device's
# work) plus the time the first microbatch takes to fill the pipeline and the last to
# drain it, (sum_k t_k - max_d T_d) / chunks: with even stages (p - 1)/(m + p - 1) of
# the span for 1F1B and (p - 1)/(v m + p - 1) interleaved, the closed forms of
# `pipeline.formulas.bubble`. With uneven stages it is an upper bound that
# `pipeline.timing.timed` tightens by a few percent (a light stage catches up in the drain).


def layer_params(model: Model) -> float:
    """Active parameters of one transformer layer: the model's less the embedding and the
    LM head (d_model x vocab each, untied), over its layers."""
    return (model.active_params - 2 * model.d_model * model.vocab) / model.n_layers


def head_cost(model: Model, seq_len: int) -> float:
    """The LM head's training FLOPs per token (6 d_model vocab) in units of one layer's (6 x
    its parameters + 6 d_model seq_len, causal attention, as `_times` counts them): about
    0.6 for Llama 3 405B at seq 8192. The embedding is a lookup: no FLOPs to speak of."""
    return 6 * model.d_model * model.vocab / (6 * layer_params(model) + 6 * model.d_model * seq_len)


def stage_costs(layers_per_stage: tuple[int, ...], *, embed_cost: float = 0.0, head_cost: float = 0.0) -> tuple:
    """Each model stage's time per microbatch in layer units: its layers, the embedding's
    `embed_cost` on the first, the LM head's `head_cost` on the last."""
    costs = [float(n) for n in layers_per_stage]
    costs[0] += embed_cost
    costs[-1] += head_cost
    return tuple(costs)


def device_layers(layers_per_stage: tuple[int, ...], pp: int, chunks: int = 1) -> list[int]:
    """The layers each pipeline device holds: its chunks' stages c*pp + d summed."""
    return [sum(layers_per_stage[c * pp + d] for c in range(chunks)) for d in range(pp)]


def pipeline_span(costs: tuple[float, ...], *, pp: int, microbatches: int, chunks: int = 1) -> tuple[float, float]:
    """(the step's span, the busiest device's work), both in the units of `costs` (one per
    model stage, pp*chunks of them, e.g. `stage_costs`): span = m max_d T_d + (sum costs -
    max_d T_d) / chunks (see above); the bubble is (span - work) / span."""
    if len(costs) != pp * chunks:
        raise ConfigError(f"{len(costs)} stage costs for pp x chunks = {pp} x {chunks} stages: give one per stage")
    per_device = [sum(costs[c * pp + d] for c in range(chunks)) for d in range(pp)]
    busiest = microbatches * max(per_device)
    return busiest + (sum(costs) - max(per_device)) / chunks, busiest


def balanced_split(n_layers: int, stages: int, *, embed_cost: float = 0.0, head_cost: float = 0.0,
                   chunks: int = 1) -> tuple:
    """The layers of each of `stages` model stages (at least one each) that make the
    slowest device, its layers + embed_cost on the first stage's + head_cost on the last
    stage's, as fast as whole layers allow; among the splits as fast, the devices at the
    ends lightest. With `chunks` per device (the loop placement: stage c*p + d on device
    d), the devices are balanced, each one's layers then split evenly over its chunks.
    balanced_split(6, 4) = (1, 2, 2, 1); balanced_split(126, 16, head_cost=0.63) = (7, 8,
    ..., 8, 7) (Llama 3 405B on pp=16)."""
    errors.whole("n_layers", n_layers)
    errors.whole("stages", stages)
    errors.whole("chunks", chunks)
    for name, value in (("embed_cost", embed_cost), ("head_cost", head_cost)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ConfigError(f"{name}={value!r}: a cost in layers, a finite number >= 0 (e.g. "
                              "search.head_cost(model, seq_len))")
    if stages % chunks:
        raise ConfigError(f"stages={stages} is not pp x chunks with chunks={chunks}: give a multiple of {chunks}")
    if n_layers < stages:
        raise ConfigError(f"{n_layers} layers cannot fill {stages} stages (each holds at least one): use at most "
                          f"{n_layers} stages")
    pp = stages // chunks
    per_device = _fill(n_layers, stage_costs((0,) * pp, embed_cost=embed_cost, head_cost=head_cost), chunks)
    split = [0] * stages
    for d, held in enumerate(per_device):
        base, more = divmod(held, chunks)
        # the extra layers away from the embedding's chunk (device 0's first) and the head's (the last device's last)
        order = list(range(chunks))[::-1] if d == 0 else list(range(chunks))
        for j, c in enumerate(order):
            split[c * pp + d] = base + (j < more)
    return tuple(split)


def _fill(n_layers: int, extra: tuple[float, ...], minimum: int) -> list[int]:
    """Layers per slot (each at least `minimum`) summing to n_layers that minimise the
    largest layers + extra; ties: the slots at the ends lighter."""
    slots = len(extra)

    def counts_within(limit: float) -> list[int]:      # the most layers each slot takes under `limit`
        return [max(minimum, math.floor(limit - e + 1e-9)) for e in extra]
    limits = sorted({j + e for e in extra for j in range(1, n_layers + 1)})
    lo, hi = 0, len(limits) - 1
    while lo < hi:                                       # the smallest limit that holds every layer
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sum(counts_within(limits[mid])) < n_layers else (lo, mid)
    counts = counts_within(limits[lo])
    for _ in range(sum(counts) - n_layers):              # too many: take from the slowest, ends first
        k = max((k for k in range(slots) if counts[k] > minimum),
                key=lambda k: (counts[k] + extra[k], extra[k], -min(k, slots - 1 - k)))
        counts[k] -= 1
    return counts


def split_label(layers_per_stage: tuple[int, ...]) -> str:
    """'7/8x14/7' for (7, 8, ..., 8, 7): runs of equal counts written count x times."""
    runs = [list(g) for _, g in itertools.groupby(layers_per_stage)]
    return "/".join(f"{r[0]}x{len(r)}" if len(r) > 2 else "/".join(map(str, r)) for r in runs)


def _uneven_memory(model: Model, c: Candidate, *, m: int, seq_len: int, zero: int, activation_model: str) -> dict:
    """`_memory` with uneven stages: per device, the states of its own layers (the
    embedding on the first, the head on the last) and its activations at its peak
    (`activations.stage_bytes`: its layers, in flight as its place in the pipeline
    says); the device of the largest total."""
    counts = device_layers(c.layers_per_stage, c.pp, c.chunks)
    in_flight = pipeline_formulas.in_flight(c.schedule, p=c.pp, m=m, chunks=c.chunks)
    edge = model.d_model * model.vocab                     # the embedding's, or the head's, parameters
    dense_layer = (model.dense_params - 2 * edge) / model.n_layers
    expert_layer = model.expert_params / model.n_layers
    devices = []
    for d, held in enumerate(counts):
        dense = held * dense_layer + edge * ((d == 0) + (d == c.pp - 1))
        # state_bytes splits its counts over pp: this device's own, times pp
        st = states.state_bytes(dense=dense * c.pp, experts=held * expert_layer * c.pp, tp=c.tp, pp=c.pp,
                                dp=c.dp, ep=c.ep, zero=zero)
        act = activations.stage_bytes(block(model, activation_model), layers=held, device=d, pp=c.pp,
                                      in_flight=in_flight, seq_len=seq_len, batch_size=c.microbatch_size, tp=c.tp,
                                      sp=c.tp > 1, cp=c.cp, recompute=c.recompute)
        devices.append({"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": act})
    peak = max(devices, key=lambda mem: sum(mem.values()))
    return {**peak, "total": sum(peak.values())}


@dataclasses.dataclass(frozen=True)
class Split:
    """A proposed uneven split for a candidate: the balanced one and, to compare, the
    nearest to even (`plan.even_or_near`), both estimated with per-stage costs."""
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
                 near_even=estimate(plan.even_or_near(model.n_layers, stages)))


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
