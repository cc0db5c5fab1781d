"""The dropless MoE layer of one device as grouped matmuls (MegaBlocks' dropless MoE, in
whole blocks): about t*k rows of expert work instead of the padded buffer's E*t.

    grouped_moe(p, x, experts, weights, *, mlp, kernel)   x [t, D] -> (y [t, D], tokens per expert [E])

The padded path (dispatch.py) gives each expert a buffer of C = t slots, the most it can
be sent, and runs every expert on all of them: E*t rows, E/k times the t*k a routed
token needs (4x for 8 experts top-2). Here expert e's n_e assignments (token, choice)
get one run of rows, rounded up to whole blocks of b rows, the runs one after another
(`block_slots`): at most t*k + E*(b-1) rows in all, a static bound. Each block belongs to
one expert, so each matmul of the experts' MLP is one matmul batched over the blocks,
[n_blocks, b, D] x [n_blocks, D, F], each block with its expert's matrix
(`block_matmul`); the rows are then gathered back and mixed by the gates, as
dispatch.unpack does. Nothing is dropped, no collective.

b = t*k / (2E) (`block_rows`): at an even load each expert fills two blocks, and the
bound is 1.5 t*k rows; smaller blocks waste fewer rows but copy each weight matrix once
per block (on an H200 at t*k = 32768, E = 8, bf16, b = t*k/2E ran a layer's forward and
backward in 8.3 ms, t*k/4E in 9.1, /8E in 11.0, /16E in 16.0; the padded buffer 11.3).

Why not `jax.lax.ragged_dot`: it is the same contract (rows sorted by expert, group
sizes), but it is lowered densely on CPU and, by default, on GPUs (jax 0.10.2 and
0.11.2): every group masked over every row, E*t*k rows, k times the padded buffer's
(22.8 ms for the layer above, the XLA flags xla_gpu_experimental_use_ragged_dot_fusion
and _grouped_gemm changing nothing).

kernel="pallas" runs the three matmuls through kernels.grouped instead: blocks of
TILE_ROWS = 128 rows (at most t*k + E*127 rows: 1.03 t*k at t*k = 32768, E = 8), each
tile reading its expert's matrix in place, so no weight is copied per block; the weight
gradient walks each expert's tiles only. A Pallas kernel: Triton on a GPU, the
interpreter elsewhere.

Backward: the buffer is a scatter of x's rows to their slots (distinct), whose
transpose is a gather (no atomics); the weight gathers' transposes add each block's
weight gradient into its expert's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.kernels import grouped as grouped_kernel

KERNELS = ("xla", "pallas")
MLPS = ("gelu", "swiglu")       # each expert's FFN

BLOCKS_PER_EXPERT = 2
"""Blocks an expert fills at an even load (t*k/E rows): b = t*k / (E * this)."""


def block_rows(rows: int, n_experts: int) -> int:
    """b: the even share rows/E over BLOCKS_PER_EXPERT, a multiple of 128 (a matmul tile)
    when larger than 128."""
    b = -(-rows // (n_experts * BLOCKS_PER_EXPERT))
    return -(-b // 128) * 128 if b > 128 else b


def block_slots(experts, n_experts: int, block: int):
    """Where each assignment's row goes: (slot [t, k] in [0, n_blocks * block),
    block_expert [n_blocks]: the expert of each block, sizes [E] int32: assignments per
    expert). Expert e's rows are one run, in token order, rounded up to whole blocks;
    blocks past the last run are empty (their expert is E-1, their rows zero)."""
    t, k = experts.shape
    E = n_experts
    one_hot = jax.nn.one_hot(experts.reshape(-1), E, dtype=jnp.int32)               # [t*k, E]
    rank = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=-1) - 1             # among its expert's rows
    sizes = jnp.sum(one_hot, axis=0, dtype=jnp.int32)                               # [E]
    runs = -(-sizes // block) * block
    ends = jnp.cumsum(runs)
    slot = (ends - runs)[experts] + rank.reshape(t, k)
    n_blocks = (t * k + E * (block - 1)) // block                                   # the most runs can fill
    return slot.astype(jnp.int32), grouped_kernel.tiles(sizes, n_blocks, block).expert, sizes


def block_matmul(h, w, block_expert):
    """h [n_blocks, b, D_in] x w [E, D_in, D_out] -> [n_blocks, b, D_out]: each block
    times its expert's matrix (both promoted to one dtype, as an einsum would)."""
    dtype = jnp.result_type(h, w)
    return jnp.einsum("nbd,ndf->nbf", h.astype(dtype), jnp.take(w.astype(dtype), block_expert, axis=0))


def tile_matmul(h, w, tiles: grouped_kernel.Tiles):
    """h [n_tiles * TILE_ROWS, D_in] x w [E, D_in, D_out] -> [n_tiles * TILE_ROWS, D_out]
    through the grouped kernel (both promoted to one dtype, as an einsum would)."""
    dtype = jnp.result_type(h, w)
    return grouped_kernel.grouped_matmul(h.astype(dtype), w.astype(dtype), tiles)


def block_experts(p: dict, h, matmul, mlp: str):
    """Each block's expert MLP on h (the rows, however `matmul(h, w)` blocks them)."""
    up = matmul(h, p["w_up"])
    if mlp == "swiglu":
        up = jax.nn.silu(matmul(h, p["w_gate"])) * up
    else:
        up = jax.nn.gelu(up, approximate=False)
    return matmul(up, p["w_down"])


def check_grouped_inputs(p: dict, x, experts, weights, *, mlp: str, kernel: str) -> int:
    """Refuse (ConfigError) what `grouped_moe` cannot run: mlp not in MLPS, kernel not in
    KERNELS, expert weights that are not float [E, ., .] arrays, x not a float [t, D]
    array, experts not an int [t, k] array, weights not a float array of experts' shape,
    and, where experts is concrete (not a jax.core.Tracer: under jit only its shape is
    known), an expert id outside [0, E). Returns E."""
    errors.one_of("mlp", mlp, MLPS)
    errors.one_of("kernel", kernel, KERNELS)
    errors.mapping("p", p, "reference.layer_params(params, 0)")
    for name in ("w_up", "w_down") + (("w_gate",) if mlp == "swiglu" else ()):
        if name not in p:
            raise ConfigError(f"p has no {name!r}: give the experts' weights (w_up [E, D, F], w_down [E, F, D], "
                              "and w_gate for SwiGLU), e.g. reference.layer_params(params, 0)")
        errors.array(name, p[name], ndim=3, kinds="f", shape_doc=f"{name}[n_experts, d_in, d_out]")
    E = p["w_up"].shape[0]
    t, _ = errors.array("x", x, ndim=2, kinds="f", shape_doc="x[tokens, d_model]")
    shape = errors.array("experts", experts, ndim=2, kinds="iu", shape_doc="experts[tokens, top_k] of expert ids")
    if shape[0] != t:
        raise ConfigError(f"experts has shape {shape} for x of {t} tokens: one row of expert ids per token. "
                          "Fix: pass router.route(router, x, ...).experts")
    if errors.array("weights", weights, ndim=2, kinds="f", shape_doc="weights[tokens, top_k]") != shape:
        raise ConfigError(f"weights has shape {tuple(weights.shape)}, experts {shape}: one gate per chosen "
                          "expert. Fix: pass the weights and experts of one router.route")
    errors.ids_below("experts", experts, E, of=f"n_experts={E}",
                     fix="each names one of the experts w_up holds. Fix: route with a router of E columns")
    return E


def grouped_moe(p: dict, x, experts, weights, *, mlp: str, kernel: str = "xla"):
    """The MoE layer of one device holding all E experts (p: "w_up" [E, D, F], "w_down"
    [E, F, D], and "w_gate" for SwiGLU) on tokens x [t, D] routed to experts [t, k] with
    gates weights [t, k]: (y [t, D], assignments per expert [E] int32, all kept). kernel:
    "xla" (block_matmul's batched einsums) or "pallas" (kernels.grouped; D and F as its
    `fits` says, checked by the caller). Checked first (`check_grouped_inputs`)."""
    E = check_grouped_inputs(p, x, experts, weights, mlp=mlp, kernel=kernel)
    t, D = x.shape
    k = experts.shape[1]
    b = grouped_kernel.TILE_ROWS if kernel == "pallas" else block_rows(t * k, E)
    slot, block_expert, sizes = block_slots(experts, E, b)
    rows = block_expert.shape[0] * b
    # each row of x to its k slots (distinct): the transpose gathers, no scatter-add
    buf = jnp.zeros((rows, D), x.dtype).at[slot.reshape(-1)].set(jnp.repeat(x, k, axis=0), unique_indices=True)
    if kernel == "pallas":
        tiles = grouped_kernel.tiles(sizes, block_expert.shape[0])
        out = block_experts(p, buf, functools.partial(tile_matmul, tiles=tiles), mlp)        # [n_blocks * b, D]
    else:
        matmul = functools.partial(block_matmul, block_expert=block_expert)
        out = block_experts(p, buf.reshape(-1, b, D), matmul, mlp).reshape(rows, D)
    got = jnp.take(out, slot.reshape(-1), axis=0, unique_indices=True).reshape(t, k, D)
    return jnp.einsum("tk,tkd->td", weights.astype(out.dtype), got), sizes
