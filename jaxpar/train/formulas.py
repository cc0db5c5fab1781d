"""The collectives inside the composed model's pipeline stages, in closed form (pure Python).

`stage_collectives(cfg=, spec=, batch_size=, seq_len=, dtype=, runs=)` is what one pp
rank runs inside the branches of the pipeline program in one training step, given how
often it runs each branch (`pipeline.plan.Plan.lane_runs`): the sum of the techniques'
own formulas at the sizes one device sees. b = batch_size/(dp*ep*microbatches) rows per
microbatch, T/cp tokens each (all of a device's tokens under SP too: the attention and the
MoE run on the gathered sequence).

Per layer, forward (F) and backward (B; under recompute F again before B, but for the
collective that only makes the stage's output when a stage holds one layer, see
`stage_collectives`; a split backward's W runs the backward again, and F before it under
recompute, while its B runs none of what only the weights' gradients need):
  tp block   tensor.formulas.tp_block_collectives (TP: f and g; SP: all-gathers and
             reduce-scatters; the replicated KV heads' gradient when tp > K), at b rows
             of T/cp tokens; the MoE enters and leaves the tp region as the MLP does;
  attention  over cp: the ring (context.formulas.ring_collectives: cp-1 K/V hops forward,
             cp-1 K/V and cp dK/dV hops backward, on the N/tp query heads and the K/tp
             KV heads (1 when tp > K) of this device), each hop a collective-permute, or
             inside a pipeline (pp > 1) an all-to-all of cp blocks (collectives.ring_shift:
             XLA:CPU meets a collective-permute with every device of the program); or
             Ulysses (context.formulas.ulysses_collectives: 4 all-to-alls each way). The
             zigzag layout costs nothing here: the tokens are put in its order once, before
             the step, and Ulysses reorders the gathered sequence locally;
  MoE        over ep: the dispatch and combine all-to-alls of the dropless worst-case
             buffers, E*C*D elements each with C = t = b*T/cp tokens
             (expert.formulas.ep_moe_collectives), forward and again backward; under
             tp > 1 the router, replicated over tp but fed each tp rank's partial share of
             d loss/d gates, has its gradient all-reduced over tp in the backward, D*E
             elements, which XLA's combiner merges into another all-reduce of the tp group
             ready then (attention's f under TP, the norm gains' under SP): bytes, no
             instruction; with the balance loss on, its per-sequence sums over cp
             (expert.formulas.balance_collectives).
The embedding runs in every F of the first stage, the LM head and the cross-entropy in
every F of the last (its backward is fused into that step: `pipeline_loss`); see
`embedding` and `head`.

One stage (pp = 1) is counted as exactly, in count and bytes: the one-stage program
(pipeline.direct) runs F and B in one computation, one jax.checkpoint per layer under
recompute, where XLA merges what a branch keeps apart; `stage_collectives` says what.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar.comms import Collectives
from jaxpar.context import formulas as cp_formulas
from jaxpar.expert import formulas as ep_formulas
from jaxpar.tensor import formulas as tp_formulas


@dataclasses.dataclass(frozen=True)
class _Heads:
    """The head counts one tp shard holds, for the context formulas (which read only these)."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


def _times(c: Collectives, n: int) -> Collectives:
    return Collectives({k: (n * a, n * b) for k, (a, b) in c.items()})


def _rows(spec, batch_size: int) -> int:
    return batch_size // (spec.dp * spec.ep * spec.microbatches)


def layer_collectives(*, cfg, spec, batch_size: int, seq_len: int, dtype, backward: bool = False) -> Collectives:
    """One layer's collectives in one F (backward=False) or one B (backward=True) of one
    microbatch on one device (see the module docstring)."""
    b, tokens, tp, cp = _rows(spec, batch_size), seq_len // spec.cp, spec.tp, spec.cp
    out = tp_formulas.tp_block_collectives(cfg=cfg, batch_size=b, seq_len=tokens, dtype=dtype, tp=tp,
                                           sequence_parallel=spec.sequence_parallel, backward=backward)
    if cp > 1:
        heads = _Heads(cfg.n_heads // tp, cfg.n_kv_heads // tp if cfg.n_kv_heads % tp == 0 else 1, cfg.head_dim)
        kw = dict(cfg=heads, batch_size=b, seq_len=seq_len, dtype=dtype, cp=cp, backward=backward)
        if spec.attention == "ulysses":
            out = out + cp_formulas.ulysses_collectives(**kw)
        else:
            hop = "all_to_all" if spec.pp > 1 else "ppermute"
            out = out + cp_formulas.ring_collectives(**kw, layout=spec.layout, hop=hop)
    if cfg.n_experts:
        if spec.ep > 1:
            out = out + ep_formulas.ep_moe_collectives(cfg=cfg, batch_size=b * spec.ep, seq_len=tokens, dtype=dtype,
                                                       ep=spec.ep)
        if backward and tp > 1 and ep_formulas.router_learns(cfg):
            item = np.dtype(dtype).itemsize
            out = out + Collectives({"all-reduce": (0, cfg.d_model * cfg.n_experts * item)})
    return out


def _weight_only(*, cfg, spec, batch_size: int, seq_len: int, dtype) -> Collectives:
    """What one layer's backward runs only for its weights' gradients (a split backward's
    B, which keeps none, runs none of it): SP's gains' gradient all-reduce over tp, and
    the bytes merged into another tp all-reduce, the replicated KV heads' and the
    router's gradients."""
    item, tp = np.dtype(dtype).itemsize, spec.tp
    out = Collectives({})
    if tp == 1:
        return out
    if spec.sequence_parallel:
        out = out + Collectives({"all-reduce": (1, 2 * cfg.d_model * item)})
    if cfg.n_kv_heads % tp:
        out = out + Collectives({"all-reduce": (0, 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim * item)})
    if cfg.n_experts and ep_formulas.router_learns(cfg):
        out = out + Collectives({"all-reduce": (0, cfg.d_model * cfg.n_experts * item)})
    return out


def _output_only(*, cfg, spec, batch_size: int, seq_len: int, dtype) -> Collectives:
    """The collectives of a layer's forward that only make its output: B needs the
    recomputed layer's residuals, not its output, so with one layer per stage (no scan
    left around it) XLA drops them from B's rerun. The last g all-reduce (TP) or
    reduce-scatter (SP); and the MoE's combine all-to-all when the gates are constant
    (top-1 renormalised: no gate gradient reads the experts' outputs)."""
    out = Collectives()
    tokens = _rows(spec, batch_size) * seq_len // spec.cp
    act = tokens * cfg.d_model * np.dtype(dtype).itemsize
    if spec.tp > 1:
        out = out + Collectives({"reduce-scatter" if spec.sequence_parallel else "all-reduce": (1, act)})
    if cfg.n_experts and spec.ep > 1 and ep_formulas.constant_gates(cfg):
        out = out + Collectives({"all-to-all": (1, cfg.n_experts * act)})    # [E, C = tokens, D], dropless
    return out


def _hop(*, cfg, spec, batch_size: int, seq_len: int, dtype) -> Collectives:
    """One K/V hop of the ring: one stacked K/V block (cp of them in an all-to-all hop)."""
    kv = cfg.n_kv_heads // spec.tp if cfg.n_kv_heads % spec.tp == 0 else 1
    block = 2 * _rows(spec, batch_size) * (seq_len // spec.cp) * kv * cfg.head_dim * np.dtype(dtype).itemsize
    if spec.pp > 1:
        return Collectives({"all-to-all": (1, spec.cp * block)})
    return Collectives({"collective-permute": (1, block)})


def _shared_hops(*, cfg, spec, batch_size: int, seq_len: int, dtype) -> Collectives:
    """The ring's K/V hops that a layer's backward sends again, of the same blocks as a
    forward in the same computation (the recomputed one under recompute="full", else the
    first): XLA's CSE keeps one of each pair it sees outside a loop, the first hop, and
    with cp = 3 the second (context.ring._ring: steps 1..cp-2 are a scan, inlined when it
    runs once). Under recompute="dots" the first only: the checkpoint splits the forward's
    inner scan in two (one keeps the hops' outputs, one runs in the backward), so the hops
    of steps 1..cp-2 never meet their twins; B reads the forward's K/V buffer
    (context.ring.KV_NAME, kept by "dots"), so its first hop meets the forward's."""
    if spec.cp == 1 or spec.attention != "ring":
        return Collectives()
    merged = spec.cp - 1 if spec.cp <= 3 and spec.recompute != "dots" else 1
    return _times(_hop(cfg=cfg, spec=spec, batch_size=batch_size, seq_len=seq_len, dtype=dtype), merged)


def _split_back(*, cfg, spec, runs: dict[str, int], depth: int) -> Collectives:
    """The all-reduces the one-stage program (pp = 1, pipeline.direct) counts beyond the
    techniques' formulas, no bytes: those count the instructions of a pipeline's branches,
    where XLA's combiner merges a few psums into one; in the one computation of F and B
    it merges a stage's all-reduces across layers and with the step's own reductions,
    depending on what is ready when, so `summary.collectives` splits every combined
    all-reduce back into the psums it was made of, and each counts. Under tp: the
    cross-entropy's two sums (one instruction in a branch) in each loss; in each layer's
    backward SP's two gain gradients (one), the router's gradient and the replicated K
    and V heads' two (merged into attention's f there)."""
    if spec.tp == 1:
        return Collectives()
    per_layer = (1 if spec.sequence_parallel else 0) + (2 if cfg.n_kv_heads % spec.tp else 0) + (
        1 if cfg.n_experts and ep_formulas.router_learns(cfg) else 0)
    return Collectives({"all-reduce": (runs["pipeline_loss"] + per_layer * depth * runs["pipeline_B"], 0)})


def embedding(*, cfg, spec, batch_size: int, seq_len: int, dtype, backward: bool = False) -> Collectives:
    """The first stage's vocab-parallel embedding, in one F (or, under SP, the all-gather
    its backward starts with, in one B of the first stage)."""
    b, tokens = _rows(spec, batch_size), seq_len // spec.cp
    if spec.tp == 1:
        return Collectives()
    if not spec.sequence_parallel:
        return Collectives() if backward else tp_formulas.embedding_collectives(
            cfg=cfg, batch_size=b, seq_len=tokens, dtype=dtype, tp=spec.tp)
    act = b * tokens * cfg.d_model * np.dtype(dtype).itemsize
    return Collectives({"all-gather" if backward else "reduce-scatter": (1, act)})


def head(*, cfg, spec, batch_size: int, seq_len: int, dtype) -> Collectives:
    """The last stage's final norm, LM head and vocab-parallel cross-entropy, forward and
    backward (one `pipeline_loss` branch): TP, the cross-entropy's all-reduces and f's
    all-reduce of dL/dz; SP, the all-gather in and the reduce-scatter of its transpose
    out, and the final norm gain's gradient all-reduce (d_model elements)."""
    b, tokens, tp = _rows(spec, batch_size), seq_len // spec.cp, spec.tp
    if tp == 1:
        return Collectives()
    kw = dict(cfg=cfg, batch_size=b, seq_len=tokens, dtype=dtype, tp=tp)
    if not spec.sequence_parallel:
        return tp_formulas.lm_loss_collectives(**kw) + tp_formulas.lm_loss_collectives(**kw, backward=True)
    item = np.dtype(dtype).itemsize
    act = b * tokens * cfg.d_model * item
    return tp_formulas.cross_entropy_collectives(**kw) + Collectives(
        {"all-gather": (1, act), "reduce-scatter": (1, act), "all-reduce": (1, cfg.d_model * item)})


def stage_collectives(*, cfg, spec, batch_size: int, seq_len: int, dtype, runs: dict[str, int],
                      depth: int | None = None) -> Collectives:
    """What one pp rank runs inside the pipeline's branches in one step, given `runs`
    (Plan.lane_runs(rank): how many times it runs each branch) and `depth`, the layers of
    the stage those branches run (default the even split, n_layers / (pp*chunks); uneven
    stages give each chunk's own count). At pp = 1 the same count of the one-stage
    program (pipeline.direct: runs of one F, one B and one loss per microbatch), which
    runs the forward and backward in one computation: XLA merges the ring's repeated
    K/V hops there (`_shared_hops`), and its all-reduces are counted one per psum
    (`_split_back`)."""
    if depth is None:
        depth = cfg.n_layers // (spec.pp * spec.resolved_chunks)
    if spec.pp == 1:        # the one-stage program's backward is whole, whatever the schedule splits
        runs = {**runs, "pipeline_W": 0}
    kw = dict(cfg=cfg, spec=spec, batch_size=batch_size, seq_len=seq_len, dtype=dtype)
    fwd, bwd = layer_collectives(**kw), layer_collectives(**kw, backward=True)
    # a split backward's W runs each layer's pullback as B does (dL/dW needs the output
    # gradient through the whole layer), so its collectives too; B, which keeps no weight
    # gradient, then runs none of those that only a weight gradient needs (`_weight_only`)
    pullbacks = runs["pipeline_B"] + runs["pipeline_W"]
    total = _times(fwd, depth * runs["pipeline_F"]) + _times(bwd, depth * pullbacks)
    if runs["pipeline_W"]:
        total = total + _times(_weight_only(**kw), -depth * runs["pipeline_B"])
    # one layer under its own jax.checkpoint: a one-layer stage, or every layer of the
    # one-stage program (pipeline.direct checkpoints layer by layer). Uneven stages are all
    # laid out as the deepest (padded, the padding skipped): a one-layer stage among them
    # is scanned like the rest, so nothing is merged away
    uneven = spec.layers_per_stage is not None and len(set(spec.layers_per_stage)) > 1
    alone = (depth == 1 and not uneven) or spec.pp == 1
    if spec.recompute == "full":
        again = _times(fwd, depth)
        if alone:
            again = again + _times(_output_only(**kw) + _shared_hops(**kw), -depth)
        total = total + _times(again, pullbacks)        # B and W each rerun the forward first
    elif spec.pp == 1:
        total = total + _times(_shared_hops(**kw), -depth * runs["pipeline_B"])
    if spec.pp == 1:
        total = total + _split_back(cfg=cfg, spec=spec, runs=runs, depth=depth)
    if cfg.n_experts:
        # the balance loss's sums over cp, in the forward that keeps what reads them: F's,
        # or under recompute B's rerun (F then keeps only the stage's input)
        balance = ep_formulas.balance_collectives(cfg=cfg, batch_size=_rows(spec, batch_size), seq_len=seq_len,
                                                  dtype=dtype, cp=spec.cp)
        total = total + _times(balance, depth * (pullbacks if spec.recompute == "full" else runs["pipeline_F"]))
    total = total + _times(embedding(**kw), runs["pipeline_first"])
    total = total + _times(embedding(**kw, backward=True), runs["pipeline_first_backward"])
    return total + _times(head(**kw), runs["pipeline_loss"])
