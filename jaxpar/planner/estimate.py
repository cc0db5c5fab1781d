"""What one parallel configuration costs (lecture 7.2-7.3): its memory per GPU, its bubble
and its step time, part by part; with uneven stages, each stage's cost and the split that
balances them. `search.py` enumerates the configurations, rejects the impossible ones and
ranks the rest by these figures.

For a model, a cluster (an accelerator, a GPU count, an MFU assumption) and a global
batch of `tokens` in sequences of `seq_len`, a `Candidate` (tp, pp, dp, cp, ep, chunks,
microbatch_size, recompute) with tp*pp*dp*cp = GPUs costs:

  memory    model states (`memory.states`, ZeRO over dp) + the first stage's activations
            (`memory.activations.first_stage_bytes`: the model's own block, sequence
            parallel with tp, microbatches in flight of the schedule): `memory_per_gpu`;
  compute   tokens x (6 x active params + 6 x n_layers x d_model x seq_len, causal attention)
            / (GPUs x peak x mfu); full recompute adds a forward (x 4/3), selective the
            attention's forward;
  bubble    `pipeline.formulas.bubble` of the schedule (`orders.DEFAULT`, 1F1B, or its
            chunked form with chunks): `bubble_and_slowest`;
  TP        per layer and microbatch, the bytes of `tensor.formulas.tp_block_collectives`
            (forward + backward; + a forward with full recompute) on the ring, 2(t-1)/t of
            each all-reduce, over NVLink when tp fits a node, else the inter-node link;
  EP        4 all-to-alls per MoE layer and microbatch (`expert.formulas.dispatch_bytes`);
  PP        an activation and a gradient per microbatch and chunk across nodes;
  CP        the ring's K/V blocks (reported; the ring hides them behind attention);
  DP        the gradient all-reduce (reduce-scatter + all-gather with ZeRO), once a step.
  step      (compute + TP + EP + PP) / (1 - bubble) + DP: no overlap, a rough model
            (`step_times`).
  uneven    with `Candidate.layers_per_stage`, per-stage costs (layers, the LM head on the
            last: `head_cost`): the busiest device sets the step and the bubble
            (`pipeline_span`), each device's memory counts its own layers; `balanced_split`
            gives the split that makes the slowest stage fastest.

Pure Python: no JAX.
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
from jaxpar.schedules import orders
from jaxpar.planner.catalog import Accelerator, Model
from jaxpar.tensor import formulas as tensor_formulas

ACT_DTYPE = "float16"   # 2 bytes, as bf16 (numpy has no bfloat16)
MAX_GPUS = 1 << 24      # past any cluster (the largest run 100k to 200k GPUs): a larger size is a typo
MAX_TOKENS = 1 << 36    # tokens in one global batch: 4,000 times Llama 3's 16M


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    gpu: Accelerator
    gpus: int
    mfu: float = 0.5

    def __post_init__(self):
        errors.whole("gpus", self.gpus, maximum=MAX_GPUS)
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

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "cp", "ep", "chunks", "microbatch_size"):
            errors.whole(name, getattr(self, name), maximum=MAX_GPUS)
        errors.one_of("recompute", self.recompute, activations.RECOMPUTE)

    @property
    def schedule(self) -> str:
        """The lecture's schedule (`orders.DEFAULT`), or its chunked form with chunks > 1."""
        kind = orders.REGISTRY[orders.DEFAULT]
        return kind.chunked if self.chunks > 1 else kind.name

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("v", self.chunks)) if v > 1)
        layers = f" layers={split_label(self.layers_per_stage)}" if self.layers_per_stage else ""
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} mb={self.microbatch_size} {self.recompute}{layers}"


def sequences(tokens, seq_len) -> int:
    """The sequences of seq_len tokens in a global batch of `tokens`."""
    errors.whole("seq_len", seq_len)
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or not 0 < tokens <= MAX_TOKENS:
        raise ConfigError(f"tokens={tokens!r}: the global batch in tokens, a number in (0, {MAX_TOKENS:.3g}], "
                          "e.g. 16 * 2**20")
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


def memory_per_gpu(model: Model, c: Candidate, *, m: int, seq_len: int, zero: int, activation_model: str) -> dict:
    """Bytes per GPU: params, grads, optimizer (ZeRO `zero`), activations in flight, and
    their total; the first stage's with the even model, else the device of the largest
    total (`_uneven_memory`)."""
    if c.layers_per_stage is not None:
        return _uneven_memory(model, c, m=m, seq_len=seq_len, zero=zero, activation_model=activation_model)
    st = states.state_bytes(dense=model.dense_params, experts=model.expert_params, tp=c.tp, pp=c.pp, dp=c.dp,
                            ep=c.ep, zero=zero)
    in_flight = pipeline_formulas.in_flight(c.schedule, p=c.pp, m=m, chunks=c.chunks)
    act = activations.first_stage_bytes(block(model, activation_model), n_layers=model.n_layers, seq_len=seq_len,
                                        batch_size=c.microbatch_size, tp=c.tp, sp=c.tp > 1, cp=c.cp,
                                        recompute=c.recompute, pp=c.pp, in_flight=in_flight)
    memory = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": act}
    memory["total"] = sum(memory.values())
    return memory


def bubble_and_slowest(model: Model, c: Candidate, *, m: int, seq_len: int) -> tuple[float, float]:
    """(the bubble, the busiest pipeline device's compute over the mean device's): the
    schedule's closed form and 1 with the even model; with uneven stages both from the
    per-stage costs (`pipeline_span`), the slowest stage setting the pace."""
    bubble = pipeline_formulas.bubble(c.schedule, c.pp, m, c.chunks) if c.pp > 1 else 0.0
    slowest = 1.0
    if c.layers_per_stage is not None:
        costs = stage_costs(c.layers_per_stage, head_cost=head_cost(model, seq_len))
        span, busiest = pipeline_span(costs, pp=c.pp, microbatches=m, chunks=c.chunks)
        bubble = (span - busiest) / span
        slowest = busiest / (m * sum(costs) / c.pp)
    return bubble, slowest


def step_times(model: Model, cluster: Cluster, c: Candidate, *, n_seq: int, m: int, seq_len: int,
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
# `schedules.timing.timed` tightens by a few percent (a light stage catches up in the drain).


def layer_params(model: Model) -> float:
    """Active parameters of one transformer layer: the model's less the embedding and the
    LM head (d_model x vocab each, untied), over its layers."""
    return (model.active_params - 2 * model.d_model * model.vocab) / model.n_layers


def head_cost(model: Model, seq_len: int) -> float:
    """The LM head's training FLOPs per token (6 d_model vocab) in units of one layer's (6 x
    its parameters + 6 d_model seq_len, causal attention, as `step_times` counts them): about
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
    """`memory_per_gpu` with uneven stages: per device, the states of its own layers (the
    embedding on the first, the head on the last) and its activations at its peak
    (`pipeline.formulas.device_peaks`: the layers x microbatches it holds at once, read
    off the schedule's table with each stage weighing its layers); the device of the
    largest total."""
    counts = device_layers(c.layers_per_stage, c.pp, c.chunks)
    held_layers = pipeline_formulas.device_peaks(c.schedule, p=c.pp, m=m, chunks=c.chunks,
                                                 stage_weights=c.layers_per_stage)
    per_layer = activations.layer_bytes(block(model, activation_model), seq_len=seq_len, batch_size=c.microbatch_size,
                                        tp=c.tp, sp=c.tp > 1, cp=c.cp, recompute=c.recompute)
    edge = model.d_model * model.vocab                     # the embedding's, or the head's, parameters
    dense_layer = (model.dense_params - 2 * edge) / model.n_layers
    expert_layer = model.expert_params / model.n_layers
    devices = []
    for d, held in enumerate(counts):
        dense = held * dense_layer + edge * ((d == 0) + (d == c.pp - 1))
        # state_bytes splits its counts over pp: this device's own, times pp
        st = states.state_bytes(dense=dense * c.pp, experts=held * expert_layer * c.pp, tp=c.tp, pp=c.pp,
                                dp=c.dp, ep=c.ep, zero=zero)
        act = per_layer * held_layers[d]
        devices.append({"params": st.params, "grads": st.grads, "optimizer": st.optimizer, "activations": act})
    peak = max(devices, key=lambda mem: sum(mem.values()))
    return {**peak, "total": sum(peak.values())}
