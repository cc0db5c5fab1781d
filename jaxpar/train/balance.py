"""MoE load balancing in the composed model: the Switch/GShard balance loss and
DeepSeek-V3's selection bias, each equal to the unsharded model's (`jaxpar/reference/`
defines both: per sequence, summed over layers).

The balance loss, alpha * sum over layers of the mean over sequences of
aux = E * sum_e f_e P_e, is taken per sequence so that a microbatch's term depends on
that microbatch alone. Its value and gradient, per axis:

  dp, ep, microbatches  each device routes whole sequences: local.
  cp                    a sequence is split over cp: the per-sequence sums (token-slots
                        and probabilities per expert) are summed over cp in the forward
                        (one all-reduce of [sequences, 2E] per layer). The backward
                        needs none: d aux / d (a rank's probability sums) is
                        E * counts / (T^2 k), from the summed counts the forward kept.
  tp                    every tp rank routes the same tokens (the MoE gathers them over tp
                        first): tp rank 0 alone carries the term, since the router's
                        gradient and the tokens' are summed over tp.
  pp                    only the last stage has a loss. `add_balance_loss` is an identity
                        on the MoE's output whose backward also gives the router its share
                        of the balance loss's gradient, alpha / batch_size per sequence
                        (Megatron's MoEAuxLossAutoScaler): the gradient enters the router
                        inside its own layer and stage; the value never travels.

The numbers the step needs after the pipeline (each layer's load over the whole batch,
for the bias; the aux values, for the reported loss) leave the stages as a gradient:
`report` is an identity whose backward hands them to a zero leaf, `STATS` [E + 1] per
layer, that the step adds to the blocks for the program alone. The pipeline adds a
weight's gradient over microbatches (and runs a backward once per F, whatever the
schedule: 1F1B, interleaved, zero-bubble W passes, recompute), so the step gets each
layer's sums over its microbatches; it sums them over the batch axes and tp (token
counts of tp ranks other than 0 and aux values of cp ranks other than 0 are zero, so
nothing is counted twice) in one all-reduce per step.

The bias (blocks["router_bias"], [L, E]) only chooses: its gradient is zero, so it adds
nothing to the gradient norm or the clipping, and AdamW's update of it is replaced by
DeepSeek-V3's rule, b += bias_rate * sign(mean load - load) (`expert.router.update_bias`),
in the sharded step and in `unsharded.reference_trainer` alike (`update_bias`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar import reference
from jaxpar.collectives import varying, varying_axes
from jaxpar.expert import router
from jaxpar.mesh import CP, TP

STATS = "balance_stats"     # a layer's statistics slot, inside the step only (never in the state)


def enabled(cfg: reference.ModelConfig) -> bool:
    """Whether the model balances its experts (a balance loss, or the bias)."""
    return bool(cfg.n_experts and (cfg.aux_loss or cfg.router_bias))


def stats_dtype(dtype):
    """Counts stay exact up to 2^24 token-slots per layer (float32; float64 models: float64)."""
    return jnp.promote_types(dtype, jnp.float32)


# ---- the two identities ---------------------------------------------------------------
#
# Inside a pipeline stage a residual is typed varying over every axis the activations
# vary over (cp among them), so a value made invariant over cp by a psum cannot be a
# residual the pullback reads: the cotangent would come back varying. Hence the loss's
# derivative is written by hand, from the counts, and each cotangent's type is set from
# its primal's static type.

def add_balance_loss(y, counts, prob_sums, weight, *, seq_len: int, top_k: int, cp: int):
    """(y unchanged, aux [s]): per sequence aux = E sum_e f_e P_e from this device's sums
    counts, prob_sums [s, E] (`router.sequence_sums`), added over cp first. Backward: y's
    cotangent passes through and prob_sums gets weight * d aux / d prob_sums =
    weight * E * counts / (seq_len^2 k), as if weight * sum(aux) were part of the loss
    (Megatron's MoEAuxLossAutoScaler), plus what the returned aux's own cotangent adds;
    counts get none (a choice has no gradient)."""
    weight = jnp.asarray(weight, counts.dtype)
    return _balance_loss(y, counts, prob_sums, weight,
                         (seq_len, top_k, cp, varying_axes(counts), varying_axes(prob_sums), varying_axes(weight)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _balance_loss(y, counts, prob_sums, weight, static):
    return _balance_loss_fwd(y, counts, prob_sums, weight, static)[0]


def _balance_loss_fwd(y, counts, prob_sums, weight, static):
    seq_len, top_k, cp = static[:3]
    if cp > 1:    # one all-reduce over cp: the whole sequence's sums
        counts, prob_sums = jnp.split(jax.lax.psum(jnp.concatenate([counts, prob_sums], axis=-1), CP), 2, axis=-1)
    aux = router.sequence_balance_loss(counts, prob_sums, tokens=seq_len, top_k=top_k)
    return (y, aux), (counts, weight)


def _balance_loss_bwd(static, res, cts):
    seq_len, top_k, _, count_axes, prob_axes, weight_axes = static
    counts, weight = res
    d_aux = weight + cts[1]                     # the hidden term's, and any use of the aux returned
    d_prob = d_aux[:, None] * counts.shape[-1] * counts / (seq_len * seq_len * top_k)
    zeros = lambda a, axes: varying(jnp.zeros(a.shape, a.dtype), axes)
    return cts[0], zeros(counts, count_axes), varying(d_prob, prob_axes), zeros(weight, weight_axes)


_balance_loss.defvjp(_balance_loss_fwd, _balance_loss_bwd)


def report(y, slot, values):
    """y, unchanged. Backward: `slot` gets `values` (no gradient of their own) as its
    cotangent: a way out of a pipeline stage for numbers its forward computed. values:
    slot's shape."""
    axes = varying_axes(slot)
    return _report(y, slot, varying(jax.lax.stop_gradient(values).astype(slot.dtype), axes), axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _report(y, slot, values, axes):
    return y


def _report_fwd(y, slot, values, axes):
    return y, values


def _report_bwd(axes, values, g):
    return g, varying(values, axes), jnp.zeros_like(values)


_report.defvjp(_report_fwd, _report_bwd)


# ---- per shard --------------------------------------------------------------------------

def _first(axis: str, size: int, dtype):
    """1 on rank 0 of `axis`, 0 elsewhere (1 when the axis has one device)."""
    return jnp.ones((), dtype) if size == 1 else (jax.lax.axis_index(axis) == 0).astype(dtype)


def moe_balance(y, p: dict, routing: router.Routing, *, cfg: reference.ModelConfig, sizes: dict,
                sequences: int, seq_len: int, batch_size: int):
    """The balancing of one MoE layer, on this device's routed tokens (`sequences` whole
    or cp-split sequences of the global length `seq_len`): y [t, D], the MoE's output,
    is returned with the balance loss's gradient (aux_loss / batch_size per sequence and
    layer, on tp rank 0) and the statistics (into p[STATS], when there) attached to its
    backward."""
    cp, tp = sizes[CP], sizes[TP]
    counts, prob_sums = router.sequence_sums(routing, sequences=sequences, scoring=cfg.router)   # [s, E] each
    on_tp0 = _first(TP, tp, counts.dtype)
    aux_sum = jnp.zeros((), counts.dtype)
    if cfg.aux_loss:
        y, aux = add_balance_loss(y, counts, prob_sums, on_tp0 * (cfg.aux_loss / batch_size), seq_len=seq_len,
                                  top_k=cfg.top_k, cp=cp)
        aux_sum = jnp.sum(aux) * on_tp0 * _first(CP, cp, counts.dtype)
    if STATS not in p:
        return y
    load = jnp.sum(counts, axis=0) * on_tp0                                                   # [E]
    return report(y, p[STATS], jnp.concatenate([load, aux_sum[None].astype(load.dtype)]))


# ---- the step -----------------------------------------------------------------------------

def slots(blocks: dict, cfg: reference.ModelConfig, tp: int, dtype):
    """The zero statistics leaf [chunks, Lc, E + 1] for per-device blocks [chunks, Lc, ...], typed
    varying over tp (each tp rank hands back its own; summed once, after the step)."""
    v, depth = blocks["attn_norm"].shape[:2]
    zeros = jnp.zeros((v, depth, cfg.n_experts + 1), stats_dtype(dtype))
    return varying(zeros, (TP,)) if tp > 1 else zeros


def totals(stats, axes: tuple[str, ...]):
    """(load [..., E], aux [...]): the statistics summed over the batch axes and tp."""
    stats = jax.lax.psum(stats, axes) if axes else stats
    return stats[..., :-1], stats[..., -1]


def update_bias(new: dict, old: dict, load, cfg: reference.ModelConfig) -> dict:
    """new with blocks["router_bias"] = old's moved by DeepSeek-V3's rule on `load` (the
    optimizer's update of it, from a zero gradient, is dropped)."""
    if not cfg.router_bias:
        return new
    bias = old["blocks"]["router_bias"]
    moved = router.update_bias(bias, load.reshape(bias.shape), rate=cfg.bias_rate)
    return {**new, "blocks": {**new["blocks"], "router_bias": moved}}
