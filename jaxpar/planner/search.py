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
from jaxpar.pipeline import orders
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

    @property
    def schedule(self) -> str:
        """The lecture's schedule (`orders.DEFAULT`), or its chunked form with chunks > 1."""
        kind = orders.REGISTRY[orders.DEFAULT]
        return kind.chunked if self.chunks > 1 else kind.name

    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("v", self.chunks)) if v > 1)
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} mb={self.microbatch_size} {self.recompute}"


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
    memory = _memory(model, cand, m=m, seq_len=seq_len, zero=zero, activation_model=activation_model)
    if memory["total"] > cluster.gpu.memory:
        reasons.append(f"memory {memory['total'] / GB:.1f} GB > {cluster.gpu.memory / GB:.0f} GB")
    bubble = pipeline_formulas.bubble(cand.schedule, cand.pp, m, cand.chunks) if cand.pp > 1 else 0.0
    times = _times(model, cluster, cand, n_seq=n_seq, m=m, seq_len=seq_len, bubble=bubble)
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
           bubble: float) -> dict:
    """Seconds per step: compute, the tp, ep, pp, cp (hidden under compute) and dp traffic,
    and the step, (compute + tp + ep + pp) / (1 - bubble) + dp."""
    gpu = cluster.gpu
    flops = 6 * model.active_params + 6 * model.n_layers * model.d_model * seq_len
    extra = {"none": 0.0, "selective": 2 * model.n_layers * model.d_model * seq_len, "full": 2 * model.active_params}
    compute = n_seq * seq_len * (flops + extra[c.recompute]) / (cluster.gpus * gpu.flops * cluster.mfu)
    passes_per_step = -(-model.n_layers // c.pp) * m          # layer-microbatches per device per step
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
    step = (compute + tp_s + ep_s + pp_s) / (1 - bubble) + dp_s
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
