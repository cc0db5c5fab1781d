"""Vocabulary-parallel embedding and cross-entropy, as Megatron does (Shoeybi et al. 2019, sec. 3).

The embedding embed[V_tp, D] and the output layer unembed[D, V_tp] are split over the
vocabulary, so each tp device holds V/t rows/columns and computes V/t of the logits. The
full logits [B, T, V] are never gathered: the cross-entropy needs, per token, only the
max, the sum of exponentials and the target's logit, three [B, T] reductions over tp.

    vocab_parallel_embedding   out[B_dp, T, D] = psum_tp(rows of this shard, zeros elsewhere)
                               fwd: 1 all-reduce of b*T*D over tp (g); bwd: none over tp
                               (scatter-add locally), and with dp > 1 the all-reduce over dp
                               of this device's embedding gradient, V/t*D (data parallelism)
    vocab_parallel_cross_entropy  logits[B_dp, T, V_tp] -> mean loss
                               fwd: all-reduces of [b, T] over tp: the max (its own, a max
                               does not combine with sums) and the sum of exp with the
                               target's logit (XLA combines the two sums): 2 ops, 3*b*T
                               elements; with dp > 1 the mean over dp, 1 scalar.
                               bwd: none: dL/dlogits = (softmax - onehot)/n, computed locally
    (b = B/dp; `vocab_collectives` states these as {kind: (count, bytes)}.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.collectives import reduce_from_tp
from jaxpar.mesh import DP, TP


def _vocab_range(v_local: int, axis: str):
    start = jax.lax.axis_index(axis) * v_local
    return start, start + v_local


def embedding_shard(embed, tokens, *, axis: str = TP):
    """embed: [V/t, D] (this device's rows), tokens: int[B, T] (all) -> [B, T, D], invariant.

    A token outside this shard's range reads row 0 and is zeroed; g (all-reduce) adds the
    shards, exactly one of which holds each token's row.
    """
    v_local = embed.shape[0]
    start, stop = _vocab_range(v_local, axis)
    mine = (tokens >= start) & (tokens < stop)                       # [B, T]
    rows = embed[jnp.where(mine, tokens - start, 0)]                 # [B, T, D]
    return reduce_from_tp(jnp.where(mine[..., None], rows, 0), axis)


def cross_entropy_shard(logits, targets, *, axis: str = TP):
    """logits: [B, T, V/t] (this device's vocab slice), targets: int[B, T] -> mean loss.

    loss = log sum_v exp(l_v) - l_target, with the max subtracted for stability: global
    max (pmax), global sum of exp (psum), the target's logit from the one shard that has
    it (psum). Autodiff of these gives softmax - onehot on each shard, with no collective.
    """
    v_local = logits.shape[-1]
    start, stop = _vocab_range(v_local, axis)
    # The max only stabilises; its gradient cancels, so it is held constant.
    m = jax.lax.pmax(jnp.max(jax.lax.stop_gradient(logits), axis=-1), axis)   # [B, T]
    shifted = logits - m[..., None]
    sum_exp = jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=-1), axis)           # [B, T]
    mine = (targets >= start) & (targets < stop)
    local_t = jnp.where(mine, targets - start, 0)
    picked = jnp.take_along_axis(shifted, local_t[..., None], axis=-1)[..., 0]
    target_logit = jax.lax.psum(jnp.where(mine, picked, 0), axis)              # [B, T]
    return jnp.mean(jnp.log(sum_exp) - target_logit)


def _check(v: int, batch: int, mesh: Mesh) -> tuple[str | None, str | None]:
    """Validate the split; returns the (data, vocab) axis names that really split (size > 1:
    XLA keeps a collective over a group of one, so a size-1 axis is left unsplit)."""
    if TP not in mesh.shape:
        raise ValueError(f"vocabulary parallelism needs a mesh with a '{TP}' axis; got {tuple(mesh.shape)}. "
                         "Fix: jaxpar.mesh.make_mesh(tp=..., dp=...)")
    t, dp = mesh.shape[TP], mesh.shape.get(DP, 1)
    if v % t:
        raise ValueError(f"vocab V={v} is not divisible by tp={t}: each tp device holds V/tp rows. "
                         f"Fix: pad the vocabulary to a multiple of {t} (Megatron pads to 128*tp)")
    if batch % dp:
        raise ValueError(f"batch B={batch} is not divisible by dp={dp}. Fix: use a batch that is a "
                         f"multiple of {dp}")
    return (DP if dp > 1 else None), (TP if t > 1 else None)


def vocab_parallel_embedding(embed, tokens, *, mesh: Mesh):
    """embed[V_tp, D] looked up at tokens[B_dp, T] -> [B_dp, T, D]; equals embed[tokens]."""
    data, vocab = _check(embed.shape[0], tokens.shape[0], mesh)
    body = embedding_shard if vocab else (lambda embed, tokens: embed[tokens])
    return jax.shard_map(body, mesh=mesh, in_specs=(P(vocab, None), P(data)),
                         out_specs=P(data))(embed, tokens)


def vocab_parallel_cross_entropy(logits, targets, *, mesh: Mesh):
    """reference.cross_entropy(logits, targets) with logits[B_dp, T, V_tp] never gathered."""
    data, vocab = _check(logits.shape[-1], logits.shape[0], mesh)

    def body(logits, targets):                         # logits: [B/dp, T, V/t]
        loss = cross_entropy_shard(logits, targets) if vocab else reference.cross_entropy(logits, targets)
        return jax.lax.pmean(loss, DP) if data else loss   # equal shards: mean of means

    return jax.shard_map(body, mesh=mesh, in_specs=(P(data, None, vocab), P(data)),
                         out_specs=P())(logits, targets)


def vocab_collectives(*, batch: int, seq: int, d_model: int, vocab: int, dtype, tp: int, dp: int = 1,
                      what: str, backward: bool = False) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} of the compiled forward program (backward=False) or of the
    backward one alone (jit of the function jax.vjp returns) of `what` = "cross_entropy"
    or "embedding", as comms.nonzero reports them. b = batch/dp."""
    item = jnp.dtype(dtype).itemsize
    b = batch // dp
    ops: list[tuple[int, int]] = []          # (count, bytes) of all-reduces
    if what == "cross_entropy":                     # the backward is local: softmax - onehot
        if tp > 1 and not backward:
            ops += [(1, b * seq * item), (1, 2 * b * seq * item)]   # max; sum exp + target logit
        if dp > 1 and not backward:
            ops.append((1, item))                                   # mean of the loss over dp
    elif what == "embedding":
        if tp > 1 and not backward:
            ops.append((1, b * seq * d_model * item))               # g: the rows of every shard
        if dp > 1 and backward:
            ops.append((1, vocab // tp * d_model * item))           # dL/dembed summed over dp
    else:
        raise ValueError(f"what={what!r}: use 'cross_entropy' or 'embedding'")
    if not ops:
        return {}
    return {"all-reduce": (sum(c for c, _ in ops), sum(n for _, n in ops))}
