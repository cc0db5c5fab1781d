"""One block of attention as a fused Pallas kernel: (out, lse) forward, and the backward
from the merged statistics, the two calls a ring's block needs.

    block_forward(q, k, v, *, scale, causal, interpret)                     -> (o, lse)
    block_backward(q, k, v, do, lse, delta, *, scale, causal, interpret)    -> (dq, dk, dv)

The arrays are those of `context.blockwise` (heads-major, grouped-query): q, o, do
[B, K, G, Tq, H], k, v [B, K, Tk, H], lse and delta [B, K, G, Tq]; o, lse, dq, dk and dv
come back in float32 (the ring merges and sums them in float32). causal=True is the
diagonal block of equal positions (Tq = Tk, query i sees key j <= i).

Why a kernel of our own: the ring's backward of a block needs p = exp(s - lse) with the
lse of the *whole* attention (and delta = rowsum(dO * O) of the merged output), while a
block's own forward only knew its local lse. cuDNN's flash attention, through
`jax.nn.dot_product_attention(..., return_residual=True)`, returns the lse in the input
dtype (bf16: three significant digits, so a 3 % error in each merge weight) and its
backward ignores a cotangent on the lse and recomputes from its own saved one: neither
can be handed the merged statistics. These kernels take them as inputs.

The algorithm is FlashAttention-2's. Forward: a program per (batch x KV head, query head
of the group, block of `bq` queries) walks the key blocks with a running max, sum and
accumulator in registers; a diagonal block stops at the last key block its queries see.
Backward: one program per key block walks the query blocks of every query head of its
group (dK and dV of a KV head are summed over its G query heads in the kernel, so
nothing [G]-times larger is written), and one program per query block walks the key
blocks for dQ. Scores exist only as a [bq, bk] tile.

On a GPU the kernels lower through Pallas' Triton backend; elsewhere they run the same
kernels in Pallas' interpreter (`interpret=None`, the default, picks by backend; True or
False forces either, False lowering for Triton from any machine). `fits` says which
shapes they take: power-of-two tiles dividing the block, a head_dim that is a power of
two from 16 to 256.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from jaxpar import errors
from jaxpar.errors import ConfigError

TILE = 64               # queries and keys per tile (a power of two, >= 16 for the tensor cores)
# float32 and float64 tiles: their dots run at full precision on FMAs, not tensor cores, and
# 64-wide tiles then spill 8 to 16 KiB per thread on Hopper; 16-wide ones spill nothing but
# 360 B in dK/dV at heads of 128 (benchmarks/triton_sm90.py, PyPI's Triton for sm_90)
WIDE_TILE = 16
MASKED = -1e30          # a masked score: exp(MASKED - anything finite) is 0, with no inf arithmetic


def tile(tokens: int, dtype=jnp.bfloat16) -> int:
    """The tile for a block of `tokens` of `dtype`: TILE for 16-bit inputs, WIDE_TILE for
    wider ones, or the whole block when it is smaller."""
    return min(TILE if jnp.dtype(dtype).itemsize <= 2 else WIDE_TILE, tokens)


def fits(*, tq: int, tk: int, head_dim: int) -> str | None:
    """Why the kernels cannot take a block of tq queries, tk keys and head_dim, or None."""
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    if not pow2(head_dim) or head_dim > 256:
        return f"head_dim={head_dim}: the Pallas block kernel needs a power of two from 16 to 256"
    for name, n in (("queries", tq), ("keys", tk)):
        if not pow2(tile(n)) or n % tile(n):
            return f"{n} {name} per block: the Pallas block kernel needs a multiple of {TILE} or a power of two >= 16"
    return None


def interpret_here() -> bool:
    """Whether the kernels run in Pallas' interpreter here: on every backend but a GPU."""
    return jax.default_backend() not in ("gpu", "cuda")


def interpreting(interpret: bool | None) -> bool:
    """A kernel's `interpret` argument: None (the default) is `interpret_here()`; False
    lowers for Triton on any backend (cross-platform lowering; running it needs a GPU)."""
    return interpret_here() if interpret is None else bool(interpret)


def params(interpret: bool, *, num_warps: int = 4, num_stages: int = 2) -> dict:
    """pallas_call's keywords: the interpreter, or Triton's launch (warps per program, the
    stages its loops' loads are pipelined over)."""
    if interpret:
        return {"interpret": True}
    return {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def _dot(a, b, precision):
    """a [m, k] x b [k, n] -> [m, n] float32 (float32 inputs at full precision, not TF32)."""
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _scores(q, k, qi, kj, bq, bk, scale, causal, precision):
    """The [bq, bk] tile of scaled scores of query tile qi and key tile kj, masked above
    the diagonal when causal."""
    s = _dot(q, k.T, precision) * scale
    if not causal:
        return s
    rows = qi * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = kj * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return jnp.where(rows >= cols, s, MASKED)


class _Static(NamedTuple):
    """A kernel's compile-time settings: the score scale, the diagonal mask, the tile of
    the axis it walks (keys for the forward and dQ, queries for dK and dV), and the
    matmul precision (float32 inputs at full precision, not TF32)."""
    scale: float
    causal: bool
    tile: int
    precision: Any


def _last_key_tile(qi, bq, bk, n_k, causal):
    """One past the last key tile query tile qi sees."""
    return jnp.minimum(n_k, pl.cdiv((qi + 1) * bq, bk)) if causal else n_k


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static):
    scale, causal, bk, precision = st
    bq, H = q_ref.shape
    qi = pl.program_id(2)
    q = q_ref[...]

    def body(kj, carry):
        acc, m, l = carry
        k = k_ref[pl.ds(kj * bk, bk), :]
        v = v_ref[pl.ds(kj * bk, bk), :]
        s = _scores(q, k, qi, kj, bq, bk, scale, causal, precision)
        new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - new[:, None])
        alpha = jnp.exp(m - new)
        return acc * alpha[:, None] + _dot(p.astype(v.dtype), v, precision), new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((bq, H), jnp.float32), jnp.full((bq,), MASKED, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, _last_key_tile(qi, bq, bk, k_ref.shape[0] // bk, causal), body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, st: _Static):
    scale, causal, bq, precision = st
    G, Tq, H = q_ref.shape
    bk = k_ref.shape[0]
    kj = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]
    first = (kj * bk) // bq if causal else 0          # the first query tile that sees this key tile

    def query_tile(qi, carry, g):
        dk, dv = carry
        rows = pl.ds(qi * bq, bq)
        q, do = q_ref[g, rows, :], do_ref[g, rows, :]
        p = jnp.exp(_scores(q, k, qi, kj, bq, bk, scale, causal, precision) - lse_ref[g, rows][:, None])
        dv = dv + _dot(p.astype(do.dtype).T, do, precision)
        ds = p * (_dot(do, v.T, precision) - delta_ref[g, rows][:, None]) * scale
        return dk + _dot(ds.astype(q.dtype).T, q, precision), dv

    def head(g, carry):
        return jax.lax.fori_loop(first, Tq // bq, functools.partial(query_tile, g=g), carry)

    zeros = jnp.zeros((bk, H), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, st: _Static):
    scale, causal, bk, precision = st
    bq, H = q_ref.shape
    qi = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(kj, dq):
        k = k_ref[pl.ds(kj * bk, bk), :]
        v = v_ref[pl.ds(kj * bk, bk), :]
        p = jnp.exp(_scores(q, k, qi, kj, bq, bk, scale, causal, precision) - lse[:, None])
        ds = p * (_dot(do, v.T, precision) - delta[:, None]) * scale
        return dq + _dot(ds.astype(k.dtype), k, precision)

    dq = jax.lax.fori_loop(0, _last_key_tile(qi, bq, bk, k_ref.shape[0] // bk, causal), body,
                           jnp.zeros((bq, H), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


_VARYING = next((n for n in ("manual_axis_type", "vma")
                 if n in inspect.signature(jax.ShapeDtypeStruct.__init__).parameters), None)


def out_struct(shape, dtype, *inputs):
    """A pallas_call output of `shape` and `dtype` that varies over the mesh axes any of
    `inputs` varies over (inside shard_map; the keyword is jax's of this version)."""
    if _VARYING is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    together = sum(jnp.zeros((), jnp.float32) * jnp.ravel(a)[0].astype(jnp.float32) for a in inputs)
    return jax.ShapeDtypeStruct(shape, dtype, **{_VARYING: getattr(jax.typeof(together), _VARYING)})


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


def _flat(q, k):
    """[B, K, G, T, H], [B, K, T, H] -> [B*K, G, T, H], [B*K, T, H]."""
    B, K, G, T, H = q.shape
    return q.reshape(B * K, G, T, H), k.reshape(B * K, k.shape[2], H)


def _check(q, k, v, causal: bool, **stats) -> None:
    """Refuse a block the kernels cannot take, before anything traces: q [B, K, G, Tq, H],
    k and v [B, K, Tk, H] of float dtypes, a causal block square, the tiles `fits` takes,
    and the backward's do [B, K, G, Tq, H], lse and delta [B, K, G, Tq]."""
    B, K, G, Tq, H = errors.array("q", q, ndim=5, kinds="f", shape_doc="q[B, K, G, Tq, H]")
    for name, a in (("k", k), ("v", v)):
        shape = errors.array(name, a, ndim=4, kinds="f", shape_doc=f"{name}[B, K, Tk, H]")
        if shape[:2] != (B, K) or shape[3] != H or shape != tuple(k.shape):
            raise ConfigError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have one "
                              f"shape [B={B}, K={K}, Tk, H={H}]")
    Tk = int(k.shape[2])
    if causal and Tq != Tk:
        raise ConfigError(f"causal=True with Tq={Tq} queries and Tk={Tk} keys: a causal block is the diagonal "
                          "one, of equal positions. Fix: causal=False for an off-diagonal block")
    for name, a in stats.items():
        want = (B, K, G, Tq, H) if name == "do" else (B, K, G, Tq)
        if tuple(errors.array(name, a, kinds="f", shape_doc=name)) != want:
            raise ConfigError(f"{name} has shape {tuple(a.shape)}; the block's {name} is {list(want)}")
    refusal = fits(tq=Tq, tk=Tk, head_dim=H)
    if refusal:
        raise ConfigError(refusal)


def block_forward(q, k, v, *, scale: float, causal: bool, interpret: bool | None = None):
    """(o, lse) of grouped queries q [B, K, G, Tq, H] over one block of keys k, v
    [B, K, Tk, H], both float32: blockwise.attend's contract."""
    _check(q, k, v, causal)
    interpret = interpreting(interpret)
    B, K, G, Tq, H = q.shape
    Tk = k.shape[2]
    bq, bk = tile(Tq, q.dtype), tile(Tk, q.dtype)
    (qf, kf), vf = _flat(q, k), v.reshape(B * K, Tk, H)
    kernel = functools.partial(_forward_kernel, st=_Static(float(scale), causal, bk, _precision(q.dtype)))
    whole = pl.BlockSpec((None, Tk, H), lambda b, g, i: (b, 0, 0))
    o, lse = pl.pallas_call(
        kernel, grid=(B * K, G, Tq // bq),
        in_specs=[pl.BlockSpec((None, None, bq, H), lambda b, g, i: (b, g, i, 0)), whole, whole],
        out_specs=[pl.BlockSpec((None, None, bq, H), lambda b, g, i: (b, g, i, 0)),
                   pl.BlockSpec((None, None, bq), lambda b, g, i: (b, g, i))],
        out_shape=[out_struct(qf.shape, jnp.float32, qf, kf, vf), out_struct(qf.shape[:-1], jnp.float32, qf, kf, vf)],
        name="jaxpar_block_forward", **params(interpret),
    )(qf, kf, vf)
    return o.reshape(q.shape), lse.reshape(q.shape[:-1])


def block_backward(q, k, v, do, lse, delta, *, scale: float, causal: bool, interpret: bool | None = None):
    """(dq, dk, dv) of one block from the final lse and delta = sum(do * o, -1) of the
    whole attention, float32: blockwise.attend_backward's contract."""
    _check(q, k, v, causal, do=do, lse=lse, delta=delta)
    interpret = interpreting(interpret)
    B, K, G, Tq, H = q.shape
    Tk = k.shape[2]
    bq, bk = tile(Tq, q.dtype), tile(Tk, q.dtype)
    (qf, kf), vf = _flat(q, k), v.reshape(B * K, Tk, H)
    dof = do.astype(q.dtype).reshape(qf.shape)
    lsef, deltaf = (a.astype(jnp.float32).reshape(qf.shape[:-1]) for a in (lse, delta))
    inputs = (qf, kf, vf, dof, lsef, deltaf)
    static = functools.partial(_Static, float(scale), causal, precision=_precision(q.dtype))
    heads = pl.BlockSpec((None, G, Tq, H), lambda b, j: (b, 0, 0, 0))
    stats = pl.BlockSpec((None, G, Tq), lambda b, j: (b, 0, 0))
    key_tile = pl.BlockSpec((None, bk, H), lambda b, j: (b, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, st=static(tile=bq)), grid=(B * K, Tk // bk),
        in_specs=[heads, key_tile, key_tile, heads, stats, stats], out_specs=[key_tile, key_tile],
        out_shape=[out_struct(kf.shape, jnp.float32, *inputs)] * 2, name="jaxpar_block_dkv", **params(interpret),
    )(*inputs)
    rows = pl.BlockSpec((None, None, bq, H), lambda b, g, i: (b, g, i, 0))
    row_stats = pl.BlockSpec((None, None, bq), lambda b, g, i: (b, g, i))
    whole = pl.BlockSpec((None, Tk, H), lambda b, g, i: (b, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=static(tile=bk)), grid=(B * K, G, Tq // bq),
        in_specs=[rows, whole, whole, rows, row_stats, row_stats], out_specs=rows,
        out_shape=out_struct(qf.shape, jnp.float32, *inputs), name="jaxpar_block_dq", **params(interpret),
    )(*inputs)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)
