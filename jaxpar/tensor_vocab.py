"""Vocabulary-parallel embedding and cross-entropy, as Megatron does (Shoeybi et al. 2019, sec. 3).

The embedding embed[V_tp, D] and the output layer unembed[D, V_tp] are split over the
vocabulary, so each tp device holds V/t rows/columns and computes V/t of the logits. The
full logits [B, T, V] are never gathered: the cross-entropy needs, per token, only the
max, the sum of exponentials and the target's logit, three [B, T] reductions over tp.

    vocab_parallel_embedding   out[B, T, D] = psum_tp(rows of this shard, zeros elsewhere)
                               fwd: 1 all-reduce of B*T*D (g); bwd: none (scatter-add locally)
    vocab_parallel_cross_entropy  logits[B, T, V_tp] -> mean loss
                               fwd: all-reduces of [B, T] (max, sum exp, target logit);
                               bwd: none: dL/dlogits = (softmax - onehot)/n, computed locally
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.collectives import reduce_from_tp
from jaxpar.mesh import TP


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


def _check_vocab(v: int, mesh: Mesh) -> int:
    t = mesh.shape[TP]
    if v % t:
        raise ValueError(f"vocab V={v} is not divisible by tp={t}: each tp device holds V/tp rows. "
                         f"Fix: pad the vocabulary to a multiple of {t} (Megatron pads to 128*tp)")
    return t


def vocab_parallel_embedding(embed, tokens, *, mesh: Mesh):
    """embed[V_tp, D] looked up at tokens[B, T] -> [B, T, D] (replicated); equals embed[tokens]."""
    _check_vocab(embed.shape[0], mesh)
    return jax.shard_map(embedding_shard, mesh=mesh, in_specs=(P(TP, None), P()),
                         out_specs=P())(embed, tokens)


def vocab_parallel_cross_entropy(logits, targets, *, mesh: Mesh):
    """reference.cross_entropy(logits, targets) with logits[B, T, V_tp] never gathered."""
    _check_vocab(logits.shape[-1], mesh)
    return jax.shard_map(cross_entropy_shard, mesh=mesh, in_specs=(P(None, None, TP), P()),
                         out_specs=P())(logits, targets)
