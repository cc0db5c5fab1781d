"""Grouped matmuls as Pallas kernels: rows sorted by expert in whole tiles, each tile times
its own expert's matrix, read where it lies; and the weight gradient summed over each
expert's tiles. The grouped MoE layer's three matmuls (expert.grouped) without a copy of
any weight and with at most one partial tile per expert.

    tiles(sizes, n_tiles)                       -> Tiles(expert [n_tiles], first [E], count [E])
    grouped_matmul(h, w, tiles, *, interpret)   h [M, K] x w [E, K, N] -> [M, N], differentiable in h, w
    fits(k=, n=)                                 why the kernels cannot take K and N, or None
    choose(requested, *, d_model, d_ff, grouped, platform) -> "pallas" | "xla"   what a layer runs

The rows: expert e's n_e rows are one run of ceil(n_e / TILE_ROWS) tiles, the runs one
after another (expert.grouped.block_slots with block = TILE_ROWS); tiles past the last run
are empty (`Tiles.count` sums to the tiles in use). M = n_tiles * TILE_ROWS.

Forward, one program per (column block, row tile): e = expert[tile], and the
[TILE_ROWS, bn] output walks K in steps of bk <= DEPTH, loading h's tile and w[e]'s
[bk, bn] block, accumulating in float32. An empty tile skips the walk and writes zeros.
Backward:
  dh = dy @ w[e]^T, the same kernel with w read transposed;
  dw[e] = h_e^T @ dy_e, one program per (N block, K block, expert) walking that expert's
          tiles only (`first`, `count`): every row of every expert read once per block.
The grids put the column blocks first because a GPU starts programs in the order of the
grid's first axis: the programs running together then share one row tile of h (and, for
dW, one expert's rows), read once from memory and then from L2, while the weights, a few
MiB per expert, stay in L2. Row tiles first would stream all of h (t*k x D, 69 MB at the
benchmark's MoE, more than an H200's 50 MB of L2) once per column block.
The XLA form of the same layer (expert.grouped.block_matmul) gathers one copy of the
expert's matrix per block, so its blocks must be large (t*k/2E rows), and pays for it
in rows: the static bound t*k + E*(b-1) is 1.44 t*k at 8 experts. Here the bound is
t*k + E*(TILE_ROWS - 1): 1.03 t*k at t*k = 32768.

On a GPU the kernels lower through Pallas' Triton backend; elsewhere they run in Pallas'
interpreter (`interpret=None`, the default, picks by backend; False lowers for Triton from
any machine). float32 and float64 inputs are multiplied at full precision
(not TF32), accumulating in float32 (float64 for float64); 16-bit inputs accumulate in
float32 and are written back in their dtype.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxpar import errors
from jaxpar.collectives import varying, varying_axes
from jaxpar.errors import ConfigError
from jaxpar.kernels.flash import interpreting, out_struct, params

IMPLEMENTATIONS = ("auto", "xla", "pallas")
# Whether "auto" takes the kernel on a GPU. It matches the XLA grouped matmuls and the
# reference in Pallas' interpreter (tests/kernels/test_grouped.py), but it has neither run
# nor been timed on a GPU yet: until it has (benchmarks/expert_gpu.py, and the tests with
# JAXPAR_TEST_PLATFORM=gpu), "auto" keeps the XLA path and "pallas" asks for the kernel.
PALLAS_AUTO = False
TILE_ROWS = 128          # rows per tile: the granularity of each expert's run, a tensor-core tile
TILES = (128, 64, 32, 16)   # the output's column tiles, largest first: powers of two (Triton's loads)
# the contracted step: each pipelined stage loads a [128, 64] block of each operand, 32 KiB
# in bf16, so Triton's 3 stages hold 96 KiB of shared memory (227 KiB per H100/H200 SM)
DEPTH = 64


def tile(n: int, most: int = TILES[0]) -> int | None:
    """The largest of TILES up to `most` dividing n, or None."""
    return next((t for t in TILES if t <= most and n % t == 0), None)


def fits(*, k: int, n: int) -> str | None:
    """Why the kernels cannot multiply [., k] by [k, n] blocks, or None."""
    for name, d in (("K (the contracted width)", k), ("N (the output width)", n)):
        if tile(d) is None:
            return f"{name}={d}: the grouped kernel tiles it by a power of two, so it must be a multiple of 16"
    return None


def choose(requested: str, *, d_model: int, d_ff: int, grouped: bool, platform: str) -> str:
    """What runs a MoE layer's grouped matmuls for `requested` ("auto", "xla", "pallas"):
    "pallas" where the layer runs grouped (dropless, every expert on the device), the
    widths fit (`fits`, d_ff this device's share) and the platform is a GPU (elsewhere the
    kernel runs interpreted, which a shard_map checking varying axes cannot hold: a
    ConfigError naming that, before anything compiles); "auto" takes it there once
    PALLAS_AUTO, else "xla"."""
    errors.one_of("expert_kernel", requested, IMPLEMENTATIONS)
    refusal = (None if grouped else "the kernel runs the grouped experts, which need dropless routing with every "
               "expert on the device (ep = 1)") or fits(k=d_model, n=d_ff)
    if refusal is None and platform not in ("gpu", "cuda"):
        refusal = (f"on {platform} the Pallas kernel runs in Pallas' interpreter, which the trainer's shard_map "
                   "cannot hold (it compiles through Triton on NVIDIA GPUs)")
    if requested == "pallas" and refusal:
        raise ConfigError(f"expert_kernel='pallas' cannot run here: {refusal}. Fix: 'auto' or 'xla'")
    return "pallas" if refusal is None and (requested == "pallas" or requested == "auto" and PALLAS_AUTO) else "xla"


def describe(implementation: str, ep: int) -> str:
    """One line for a summary: what ran the experts' matmuls."""
    if ep > 1:
        return f"padded buffers over ep={ep} (all-to-all), one einsum per local expert"
    return {"pallas": "grouped, pallas kernel (128-row tiles, weights read in place)",
            "xla": "grouped, xla batched matmuls (blocks of t*k/2E rows, one weight copy per block)"}[implementation]


class Tiles(NamedTuple):
    """Which expert each row tile belongs to, and each expert's run of tiles."""
    expert: jax.Array      # [n_tiles] int32: the expert of each tile (E-1 past the last run)
    first: jax.Array       # [E] int32: expert e's first tile
    count: jax.Array       # [E] int32: its tiles, ceil(n_e / TILE_ROWS)


def tiles(sizes, n_tiles: int, rows: int = TILE_ROWS) -> Tiles:
    """The tiles of runs of sizes[e] rows each, rounded up to whole tiles of `rows` (the
    kernel's are TILE_ROWS; expert.grouped.block_slots reads the blocks of its XLA path
    the same way)."""
    sizes = jnp.asarray(sizes, jnp.int32)
    count = -(-sizes // rows)
    ends = jnp.cumsum(count)
    starts = jnp.arange(n_tiles, dtype=jnp.int32)
    expert = jnp.minimum(jnp.sum(ends[None, :] <= starts[:, None], axis=1), sizes.shape[0] - 1)
    return Tiles(expert.astype(jnp.int32), (ends - count).astype(jnp.int32), count.astype(jnp.int32))


class _Static(NamedTuple):
    """A kernel's compile-time settings: the depth tile it walks, whether w is read
    transposed, the accumulator's dtype and the matmul precision."""
    depth: int
    transpose: bool
    acc: Any
    precision: Any


def _dot(a, b, st: _Static, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=st.acc, precision=st.precision)


def _matmul_kernel(expert_ref, used_ref, h_ref, w_ref, o_ref, *, st: _Static):
    j, i = pl.program_id(0), pl.program_id(1)
    bm, bn = o_ref.shape
    bk = st.depth
    e = expert_ref[i]
    # an empty tile: no steps, zeros. Not jnp.where(pred, steps, 0): jax 0.10's Triton
    # lowering of select_n types its Python-number operands as the predicate (i1), and the
    # loop's bound then fails MLIR's verifier (kernels.triton_ir.modules)
    steps = (i < used_ref[0]).astype(jnp.int32) * (h_ref.shape[1] // bk)

    def body(s, acc):
        a = h_ref[:, pl.ds(s * bk, bk)]
        if st.transpose:                      # w [E, N_out, K_in]: [bn, bk] read, contracted on its dim 1
            return acc + _dot(a, w_ref[e, pl.ds(j * bn, bn), pl.ds(s * bk, bk)], st, ((1,), (1,)))
        return acc + _dot(a, w_ref[e, pl.ds(s * bk, bk), pl.ds(j * bn, bn)], st)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), st.acc))
    o_ref[...] = acc.astype(o_ref.dtype)


def _weight_grad_kernel(first_ref, count_ref, h_ref, dy_ref, dw_ref, *, st: _Static):
    b, a, e = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, bn = dw_ref.shape
    bm = st.depth                              # rows per step: TILE_ROWS // bm steps a tile
    per_tile = TILE_ROWS // bm
    first = first_ref[e] * per_tile

    def body(r, acc):
        rows = pl.ds(r * bm, bm)
        return acc + _dot(h_ref[rows, pl.ds(a * bk, bk)], dy_ref[rows, pl.ds(b * bn, bn)], st, ((0,), (0,)))

    acc = jax.lax.fori_loop(first, first + count_ref[e] * per_tile, body, jnp.zeros((bk, bn), st.acc))
    dw_ref[...] = acc.astype(dw_ref.dtype)


def _static(dtype, depth: int, transpose: bool = False) -> _Static:
    wide = jnp.dtype(dtype).itemsize >= 4
    acc = jnp.promote_types(dtype, jnp.float32)
    return _Static(depth, transpose, acc, jax.lax.Precision.HIGHEST if wide else None)


def _whole(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _matmul(h, w, t: Tiles, *, transpose: bool, interpret: bool):
    """h [M, K] x w[e] ([E, K, N], or [E, N, K] read transposed) -> [M, N] in h's dtype."""
    M, K = h.shape
    N = w.shape[1] if transpose else w.shape[2]
    bn = tile(N)
    used = jnp.sum(t.count, keepdims=True)
    kernel = functools.partial(_matmul_kernel, st=_static(h.dtype, tile(K, DEPTH), transpose))
    return pl.pallas_call(
        kernel, grid=(N // bn, M // TILE_ROWS),
        in_specs=[_whole(t.expert.shape), _whole((1,)), pl.BlockSpec((TILE_ROWS, K), lambda j, i: (i, 0)),
                  _whole(w.shape)],
        out_specs=pl.BlockSpec((TILE_ROWS, bn), lambda j, i: (i, j)),
        out_shape=out_struct((M, N), h.dtype, h, w), name="jaxpar_grouped_matmul",
        **params(interpret, num_warps=8, num_stages=3),
    )(t.expert, used, h, w)


def _weight_grad(h, dy, t: Tiles, n_experts: int, *, interpret: bool):
    """[E, K, N]: expert e's h rows transposed times its dy rows, over its tiles only."""
    K, N = h.shape[1], dy.shape[1]
    bk, bn = tile(K), tile(N)
    kernel = functools.partial(_weight_grad_kernel, st=_static(h.dtype, DEPTH))
    return pl.pallas_call(
        kernel, grid=(N // bn, K // bk, n_experts),
        in_specs=[_whole(t.first.shape), _whole(t.count.shape), _whole(h.shape), _whole(dy.shape)],
        out_specs=pl.BlockSpec((None, bk, bn), lambda b, a, e: (e, a, b)),
        out_shape=out_struct((n_experts, K, N), h.dtype, h, dy), name="jaxpar_grouped_weight_grad",
        **params(interpret, num_warps=8, num_stages=3),
    )(t.first, t.count, h, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(h, w, t: Tiles, interpret: bool):
    return _matmul(h, w, t, transpose=False, interpret=interpret)


def _grouped_fwd(h, w, t, interpret):
    return _matmul(h, w, t, transpose=False, interpret=interpret), (h, w, t)


def _grouped_bwd(interpret, res, dy):
    h, w, t = res
    dy = dy.astype(h.dtype)
    dh = _matmul(dy, w, t, transpose=True, interpret=interpret)
    dw = _weight_grad(h, dy, t, w.shape[0], interpret=interpret).astype(w.dtype)
    return dh, dw, jax.tree.map(lambda a: None, t)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _check(h, w, t: Tiles) -> None:
    """Refuse operands the kernel cannot take, before anything compiles."""
    M, K = errors.array("h", h, ndim=2, kinds="f", shape_doc="h[rows, K]")
    E, K_w, N = errors.array("w", w, ndim=3, kinds="f", shape_doc="w[experts, K, N]")
    if K_w != K or h.dtype != w.dtype:
        raise ConfigError(f"h {h.dtype}{[M, K]} and w {w.dtype}{[E, K_w, N]}: the kernel multiplies h [rows, K] by "
                          "w [E, K, N] of one dtype. Fix: promote both to one dtype, with w's K h's")
    if M % TILE_ROWS:
        raise ConfigError(f"h has {M} rows: the kernel runs whole tiles of TILE_ROWS={TILE_ROWS}. Fix: pad the "
                          f"rows to a multiple of {TILE_ROWS} (expert.grouped.block_slots with block={TILE_ROWS})")
    if not isinstance(t, Tiles) or tuple(t.expert.shape) != (M // TILE_ROWS,) or tuple(t.count.shape) != (E,):
        raise ConfigError(f"tiles={t!r:.120}: give tiles(sizes [E={E}], n_tiles={M // TILE_ROWS})")
    refusal = fits(k=K, n=N)
    if refusal:
        raise ConfigError(refusal)


def grouped_matmul(h, w, t: Tiles, *, interpret: bool | None = None):
    """Each TILE_ROWS-row tile of h [M, K] times its expert's matrix w[t.expert[tile]]
    ([E, K, N]) -> [M, N]; h and w of one dtype (the caller promotes), M a multiple of
    TILE_ROWS, K and N as `fits` says. Tiles past t.count's sum come back zero.

    Inside shard_map every operand is first typed varying over every axis any of them
    varies over, as an einsum's implicit pvary would: the kernel's gradient of an
    invariant w is then summed over those axes by pvary's transpose, as XLA's would be."""
    _check(h, w, t)
    interpret = interpreting(interpret)
    axes = sorted(set().union(*map(varying_axes, (h, w, *t))))
    h, w, t = varying((h, w, t), axes)
    return _grouped(h, w, t, interpret)
