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

Shapes, heads-major so that every contraction is a plain batched matmul with no transpose
of the scores (grouped-query attention without repeating K/V: query head n = k*G + g
reads KV head k, G = N/K): q and o [B, K, G, Tq, H], k and v [B, K, Tk, H], lse
[B, K, G, Tq], scores [B, K, G, Tq, Tk]; `group` / `ungroup` / `heads_major` convert from
and to the [B, T, heads, H] of the public functions. A row whose every key is masked has lse = -inf and o = 0, and
merges as the identity: nothing here divides by zero or subtracts infinities.
Everything is computed in `acc_dtype(q.dtype)`: float32 at least (bf16 inputs
accumulate in float32), float64 under x64.

`Blocks` is how a ring computes its blocks: these XLA ops, keys `chunk` at a time, or
the fused Pallas kernel of `kernels.flash` (the same contract: (o, lse) forward, and a
backward from the merged lse and delta), chosen by `kernels.attention.choose_block`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from typing import NamedTuple

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.kernels import flash


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
    """[B, T, N, H] -> [B, K, N/K, T, H]: query heads grouped by the KV head they read."""
    B, T, N, H = x.shape
    return x.reshape(B, T, n_kv, N // n_kv, H).transpose(0, 2, 3, 1, 4)


def ungroup(x):
    """[B, K, G, T, H] -> [B, T, K*G, H]."""
    B, K, G, T, H = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def heads_major(x):
    """[B, T, K, H] <-> [B, K, T, H] (its own inverse)."""
    return x.transpose(0, 2, 1, 3)


def causal_mask(tq: int, tk: int):
    """[tq, tk] bool: query i sees key j <= i (the diagonal block of equal positions)."""
    return jnp.arange(tq)[:, None] >= jnp.arange(tk)[None, :]


def _masked(s, mask):
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _finite(x):
    """x with -inf replaced by 0, for use as a shift."""
    return jnp.where(jnp.isneginf(x), jnp.zeros_like(x), x)


def unnormalised(s, v, mask=None):
    """(numerator, denominator, shift) of scores s [B, K, G, Tq, Tk] over values v
    [B, K, Tk, H]: sum_j exp(s_j - m) v_j, sum_j exp(s_j - m) and m, the row max (0 for a
    row with every key masked). The shift is a stop_gradient: o and lse do not depend on it."""
    s = _masked(s, mask)
    m = jax.lax.stop_gradient(_finite(jnp.max(s, axis=-1)))
    p = jnp.exp(s - m[..., None])
    return jnp.einsum("bkgqs,bksh->bkgqh", p, v.astype(p.dtype)), jnp.sum(p, axis=-1), m


def normalised(num, den, m):
    """(o, lse) from unnormalised sums: o = num / den, lse = m + log(den); a row with
    den = 0 (every key masked) gives o = 0, lse = -inf."""
    safe = jnp.where(den > 0, den, jnp.ones_like(den))
    return num / safe[..., None], jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def softmax_block(s, v, mask=None):
    """(o, lse) of scores s [B, K, G, Tq, Tk] over values v [B, K, Tk, H]; masked scores
    (mask [Tq, Tk] False) take no part. Fully masked rows give o = 0, lse = -inf."""
    return normalised(*unnormalised(s, v, mask))


def scores(q, k, scale):
    """s = q k^T * scale in acc_dtype: [B, K, G, Tq, Tk]."""
    dt = acc_dtype(q.dtype)
    return jnp.einsum("bkgqh,bksh->bkgqs", q.astype(dt), k.astype(dt)) * jnp.asarray(scale, dt)


def attend(q, k, v, *, scale, mask=None):
    """(o, lse) of grouped queries q over one block of keys k and values v."""
    return softmax_block(scores(q, k, scale), v, mask)


def merge(o1, lse1, o2, lse2):
    """The online-softmax merge of two partial results over disjoint key sets."""
    m = _finite(jnp.maximum(lse1, lse2))
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    return normalised(o1 * w1[..., None] + o2 * w2[..., None], w1 + w2, m)


def attend_backward(q, k, v, do, lse, delta, *, scale, mask=None):
    """(dq, dk, dv) of one block, in acc_dtype, from the final lse and delta =
    sum(do * o, -1) of the whole attention (not the block's)."""
    dt = acc_dtype(q.dtype)
    q, k, v, do = (a.astype(dt) for a in (q, k, v, do))
    s = _masked(scores(q, k, scale), mask)
    p = jnp.exp(s - _finite(lse)[..., None])            # masked scores are -inf: p = 0
    dv = jnp.einsum("bkgqs,bkgqh->bksh", p, do)
    dp = jnp.einsum("bkgqh,bksh->bkgqs", do, v)
    ds = p * (dp - delta[..., None]) * jnp.asarray(scale, dt)
    dq = jnp.einsum("bkgqs,bksh->bkgqh", ds, k)
    dk = jnp.einsum("bkgqs,bkgqh->bksh", ds, q)
    return dq, dk, dv


def chunk_size(tokens: int, chunk: int) -> int:
    """The key-chunk length for a block of `tokens` keys: the largest divisor of tokens
    that is <= chunk, or the whole block when that divisor would be under chunk/4 (a
    length with no useful divisor is not cut into slivers)."""
    if tokens <= chunk:
        return tokens
    size = max(d for d in range(1, chunk + 1) if tokens % d == 0)
    return size if 4 * size >= chunk else tokens


def _split_keys(x, size: int):
    """[B, K, T, H] -> [T/size, B, K, size, H]: the chunks as a scan's leading axis."""
    B, K, T, H = x.shape
    return x.reshape(B, K, T // size, size, H).transpose(2, 0, 1, 3, 4)


def _join_keys(x):
    n, B, K, size, H = x.shape
    return x.transpose(1, 2, 0, 3, 4).reshape(B, K, n * size, H)


def _chunk_mask(tq: int, size: int, j, causal: bool):
    """Key chunk j of a diagonal block: query i sees key j*size + s when it is <= i."""
    if not causal:
        return None
    return jnp.arange(tq)[:, None] >= j * size + jnp.arange(size)[None, :]


def attend_chunked(q, k, v, *, scale, causal: bool = False, chunk: int):
    """attend() with the keys taken `chunk` at a time (lax.scan): scores of Tq x chunk at a
    time instead of Tq x Tk. Inside the block the sums stay unnormalised (numerator,
    denominator, running max, as FlashAttention keeps them) and are divided once at the
    end, so cutting a block into chunks adds no rounding. causal=True is the diagonal
    block (query i sees key j <= i, equal positions)."""
    size = chunk_size(k.shape[2], chunk)
    n = k.shape[2] // size
    tq = q.shape[3]
    if n == 1:
        return attend(q, k, v, scale=scale, mask=causal_mask(tq, size) if causal else None)
    ks, vs = _split_keys(k, size), _split_keys(v, size)
    first = unnormalised(scores(q, ks[0], scale), vs[0], _chunk_mask(tq, size, 0, causal))

    def body(carry, xs):
        num, den, m = carry
        kc, vc, j = xs
        cnum, cden, cm = unnormalised(scores(q, kc, scale), vc, _chunk_mask(tq, size, j, causal))
        new = jnp.maximum(m, cm)
        a, b = jnp.exp(m - new), jnp.exp(cm - new)
        return (num * a[..., None] + cnum * b[..., None], den * a + cden * b, new), None
    return normalised(*jax.lax.scan(body, first, (ks[1:], vs[1:], jnp.arange(1, n)))[0])


def attend_backward_chunked(q, k, v, do, lse, delta, *, scale, causal: bool = False, chunk: int):
    """attend_backward() with the keys taken `chunk` at a time: dq accumulates over the
    chunks, each chunk's dk and dv are its own."""
    size = chunk_size(k.shape[2], chunk)
    n = k.shape[2] // size
    tq = q.shape[3]
    if n == 1:
        return attend_backward(q, k, v, do, lse, delta, scale=scale, mask=causal_mask(tq, size) if causal else None)
    ks, vs = _split_keys(k, size), _split_keys(v, size)
    dq, dk0, dv0 = attend_backward(q, ks[0], vs[0], do, lse, delta, scale=scale, mask=_chunk_mask(tq, size, 0, causal))

    def body(dq, xs):
        kc, vc, j = xs
        bq, bk, bv = attend_backward(q, kc, vc, do, lse, delta, scale=scale, mask=_chunk_mask(tq, size, j, causal))
        return dq + bq, (bk, bv)
    dq, (dk, dv) = jax.lax.scan(body, dq, (ks[1:], vs[1:], jnp.arange(1, n)))
    join = lambda first, rest: _join_keys(jnp.concatenate([first[None], rest]))
    return dq, join(dk0, dk), join(dv0, dv)


def _halve(x, axis: int):
    h = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, 0, h, axis=axis), jax.lax.slice_in_dim(x, h, 2 * h, axis=axis)


DIAGONAL_DEPTH = 3   # halvings of a diagonal block: 2^3 masked leaves, so the program does not grow with T


def attend_diagonal(q, k, v, *, scale, chunk: int, depth: int = DIAGONAL_DEPTH):
    """(o, lse) of the diagonal block (query i sees key j <= i) without computing most of
    what lies above the diagonal: halve it into [first q x first k] (diagonal again),
    [late q x first k] (whole, no mask) and [late q x late k] (diagonal again), `depth`
    times or down to `chunk` tokens. The leaves are masked blocks: t^2/2 + t^2/2^(depth+1)
    score elements instead of the masked block's t^2, with a program of fixed size."""
    t = q.shape[3]
    if t <= chunk or t % 2 or depth == 0:
        return attend_chunked(q, k, v, scale=scale, causal=True, chunk=chunk)
    (q1, q2), (k1, k2), (v1, v2) = _halve(q, 3), _halve(k, 2), _halve(v, 2)
    o1, lse1 = attend_diagonal(q1, k1, v1, scale=scale, chunk=chunk, depth=depth - 1)
    o2, lse2 = merge(*attend_chunked(q2, k1, v1, scale=scale, chunk=chunk),
                     *attend_diagonal(q2, k2, v2, scale=scale, chunk=chunk, depth=depth - 1))
    return jnp.concatenate([o1, o2], axis=3), jnp.concatenate([lse1, lse2], axis=-1)


def attend_diagonal_backward(q, k, v, do, lse, delta, *, scale, chunk: int, depth: int = DIAGONAL_DEPTH):
    """(dq, dk, dv) of attend_diagonal, by the same halving."""
    t = q.shape[3]
    if t <= chunk or t % 2 or depth == 0:
        return attend_backward_chunked(q, k, v, do, lse, delta, scale=scale, causal=True, chunk=chunk)
    (q1, q2), (k1, k2), (v1, v2), (do1, do2) = _halve(q, 3), _halve(k, 2), _halve(v, 2), _halve(do, 3)
    (l1, l2), (d1, d2) = _halve(lse, lse.ndim - 1), _halve(delta, delta.ndim - 1)
    dq1, dk1, dv1 = attend_diagonal_backward(q1, k1, v1, do1, l1, d1, scale=scale, chunk=chunk, depth=depth - 1)
    dq2, dk1b, dv1b = attend_backward_chunked(q2, k1, v1, do2, l2, d2, scale=scale, chunk=chunk)
    dq2b, dk2, dv2 = attend_diagonal_backward(q2, k2, v2, do2, l2, d2, scale=scale, chunk=chunk, depth=depth - 1)
    return (jnp.concatenate([dq1, dq2 + dq2b], axis=3), jnp.concatenate([dk1 + dk1b, dk2], axis=2),
            jnp.concatenate([dv1 + dv1b, dv2], axis=2))


class Blocks(NamedTuple):
    """How a ring computes one block: kernel "xla" runs the ops above with the keys taken
    `chunk` at a time (the diagonal by halving), "pallas" the fused kernel (kernels.flash,
    in its interpreter off a GPU). causal=True is the diagonal block."""
    chunk: int
    kernel: str = "xla"

    def forward(self, q, k, v, *, scale, causal: bool):
        """(o, lse) of q over one block of k, v."""
        if self.kernel == "pallas":
            return flash.block_forward(q, k, v, scale=scale, causal=causal)
        if causal:
            return attend_diagonal(q, k, v, scale=scale, chunk=self.chunk)
        return attend_chunked(q, k, v, scale=scale, chunk=self.chunk)

    def backward(self, q, k, v, do, lse, delta, *, scale, causal: bool):
        """(dq, dk, dv) of one block from the merged lse and delta."""
        if self.kernel == "pallas":
            return flash.block_backward(q, k, v, do, lse, delta, scale=scale, causal=causal)
        if causal:
            return attend_diagonal_backward(q, k, v, do, lse, delta, scale=scale, chunk=self.chunk)
        return attend_backward_chunked(q, k, v, do, lse, delta, scale=scale, chunk=self.chunk)
