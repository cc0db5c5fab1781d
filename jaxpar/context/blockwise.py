"""One block of attention as (out, lse), the online-softmax merge, and the block's backward.

Ring attention (and FlashAttention before it) never forms softmax over all keys at once:
each block of keys gives a partial result, the attention of the queries over that block
alone, o_b = softmax(s_b) v_b, and its log-sum-exp lse_b = log sum_j exp(s_bj). Two
partial results over disjoint key sets merge exactly (lecture 5.2, exercise 6):

    lse = log(exp(lse_1) + exp(lse_2))
    o   = o_1 exp(lse_1 - lse) + o_2 exp(lse_2 - lse)

so the blocks can arrive in any order, one ring step at a time. The backward of a block
needs only q, k, v, the final lse and delta = rowsum(dO * O) (FlashAttention-2):
p = exp(s - lse), dV = p^T dO, dS = p (dO V^T - delta), dQ = dS K, dK = dS^T Q.

Shapes (grouped-query attention without repeating K/V: query head n = k*G + g reads KV
head k, G = N/K): q and o [B, Tq, K, G, H], k and v [B, Tk, K, H], lse [B, Tq, K, G],
scores [B, Tq, K, G, Tk]. A row whose every key is masked has lse = -inf and o = 0, and
merges as the identity: nothing here divides by zero or subtracts infinities.
Everything is computed in `acc_dtype(q.dtype)`: float32 at least (bf16 inputs
accumulate in float32), float64 under x64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError


def acc_dtype(dtype):
    """The dtype scores, softmax sums and accumulators are kept in: float32 or wider."""
    return jnp.promote_types(dtype, jnp.float32)


def check_qkv(q, k, v, *, needed_by: str) -> tuple[int, int, int, int, int]:
    """Refuse q, k, v that are not self-attention inputs [B, T, N, H], [B, T, K, H] (K
    dividing N) of a floating dtype; return (B, T, N, K, H)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        errors.array(name, a, ndim=4, kinds="f", shape_doc=f"{name}[batch, seq, heads, head_dim]")
    B, T, N, H = (int(d) for d in q.shape)
    K = int(k.shape[2])
    if tuple(k.shape) != tuple(v.shape) or tuple(k.shape) != (B, T, K, H):
        raise ConfigError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: {needed_by} is self-"
                          f"attention, so k and v need the shape [B={B}, T={T}, K, H={H}], q's batch, sequence "
                          "and head_dim")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ConfigError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: give them one dtype "
                          f"(e.g. k.astype(q.dtype))")
    if N % K:
        raise ConfigError(f"query heads N={N} must be a multiple of KV heads K={K}: each KV head serves N/K "
                          f"query heads. Fix: K in ({errors.divisors(N)})")
    return B, T, N, K, H


def group(x, n_kv: int):
    """[B, T, N, H] -> [B, T, K, N/K, H]: query heads grouped by the KV head they read."""
    B, T, N, H = x.shape
    return x.reshape(B, T, n_kv, N // n_kv, H)


def ungroup(x):
    """[B, T, K, G, H] -> [B, T, K*G, H]."""
    B, T, K, G, H = x.shape
    return x.reshape(B, T, K * G, H)


def causal_mask(tq: int, tk: int):
    """[tq, tk] bool: query i sees key j <= i (the diagonal block of equal positions)."""
    return jnp.arange(tq)[:, None] >= jnp.arange(tk)[None, :]


def _masked(s, mask):
    return s if mask is None else jnp.where(mask[None, :, None, None, :], s, -jnp.inf)


def _finite(x):
    """x with -inf replaced by 0, for use as a shift."""
    return jnp.where(jnp.isneginf(x), jnp.zeros_like(x), x)


def softmax_block(s, v, mask=None):
    """(o, lse) of scores s [B, Tq, K, G, Tk] over values v [B, Tk, K, H]; masked scores
    (mask [Tq, Tk] False) take no part. Fully masked rows give o = 0, lse = -inf."""
    s = _masked(s, mask)
    m = jax.lax.stop_gradient(_finite(jnp.max(s, axis=-1)))  # a shift: o and lse do not depend on it
    p = jnp.exp(s - m[..., None])
    total = jnp.sum(p, axis=-1)
    safe = jnp.where(total > 0, total, jnp.ones_like(total))
    o = jnp.einsum("bqkgs,bskh->bqkgh", p, v.astype(p.dtype)) / safe[..., None]
    lse = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    return o, lse


def scores(q, k, scale):
    """s = q k^T * scale in acc_dtype: [B, Tq, K, G, Tk]."""
    dt = acc_dtype(q.dtype)
    return jnp.einsum("bqkgh,bskh->bqkgs", q.astype(dt), k.astype(dt)) * jnp.asarray(scale, dt)


def attend(q, k, v, *, scale, mask=None):
    """(o, lse) of grouped queries q over one block of keys k and values v."""
    return softmax_block(scores(q, k, scale), v, mask)


def merge(o1, lse1, o2, lse2):
    """The online-softmax merge of two partial results over disjoint key sets."""
    m = _finite(jnp.maximum(lse1, lse2))
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    total = w1 + w2
    safe = jnp.where(total > 0, total, jnp.ones_like(total))
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / safe[..., None]
    return o, jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)


def attend_backward(q, k, v, do, lse, delta, *, scale, mask=None):
    """(dq, dk, dv) of one block, in acc_dtype, from the final lse and delta =
    sum(do * o, -1) of the whole attention (not the block's)."""
    dt = acc_dtype(q.dtype)
    q, k, v, do = (a.astype(dt) for a in (q, k, v, do))
    s = _masked(scores(q, k, scale), mask)
    p = jnp.exp(s - _finite(lse)[..., None])            # masked scores are -inf: p = 0
    dv = jnp.einsum("bqkgs,bqkgh->bskh", p, do)
    dp = jnp.einsum("bqkgh,bskh->bqkgs", do, v)
    ds = p * (dp - delta[..., None]) * jnp.asarray(scale, dt)
    dq = jnp.einsum("bqkgs,bskh->bqkgh", ds, k)
    dk = jnp.einsum("bqkgs,bqkgh->bskh", ds, q)
    return dq, dk, dv
