"""Megatron's layers on one tp shard: column- and row-parallel linears, attention split by
heads, the MLP, the pre-norm block (lecture sections 3.2-3.4 and 4.4), and the lecture's
counterexample (a row-split A before the GeLU).

Each function runs inside shard_map over the tensor-parallel `axis`; the local shapes are
in the docstrings, in the notation A[B, T_tp, D] (T split over tp). `block.tp_block`
wraps `block_shard` for a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.mesh import TP, axis_size, require_mesh
from jaxpar.tensor.ops import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp


def column_parallel(x, *ws, axis: str, sequence_parallel: bool = False):
    """Column-parallel linear layers sharing one input: Y_i[B, T, *O_tp] = X[B, T, D] @ W_i[D, *O_tp].

    Enters the tensor-parallel region once for all of `ws` (Megatron fuses Q, K, V, and
    SwiGLU's two up projections, behind one f):
      TP: x[B, T, D] invariant over tp; f: identity fwd, all-reduce of dL/dX bwd.
      SP: x[B, T_tp, D]; all-gather along T fwd, reduce-scatter of dL/dX bwd.
    No communication in the matmuls: each device owns whole output columns.
    """
    xg = gather_from_sp(x, axis, 1) if sequence_parallel else copy_to_tp(x, axis)   # [B, T, D]
    return tuple(jnp.tensordot(xg, w, axes=1) for w in ws)      # [B, T, D] @ [D, ...]


def row_parallel(h, w, *, axis: str, sequence_parallel: bool = False):
    """Row-parallel linear: Y[B, T, D] = sum over tp of H[B, T, *I_tp] @ W[*I_tp, D].

    Each device's product is a partial sum {U_tp}; g all-reduces it (TP; identity bwd),
    or a reduce-scatter along T leaves y[B, T_tp, D] (SP; all-gather bwd).
    """
    partial_sum = jnp.tensordot(h, w, axes=w.ndim - 1)          # [B, T, D]{U_tp}
    if sequence_parallel:
        return reduce_scatter_to_sp(partial_sum, axis, 1)       # [B, T/t, D]
    return reduce_from_tp(partial_sum, axis)                     # [B, T, D]


def _kv_shard(w, *, axis: str, n_kv_heads: int):
    """This device's KV-head slice of wk/wv[D, K, H] when tp > K (KV heads replicated).

    Device i serves query heads [i N/t, (i+1) N/t), all in KV group i K/t. Every device
    holds the whole wk/wv; f makes the backward all-reduce their gradients over tp (the
    t/K devices sharing a KV head each add their part; the others add zeros).
    """
    t = jax.lax.axis_size(axis)
    i = jax.lax.axis_index(axis) * n_kv_heads // t
    return jax.lax.dynamic_slice_in_dim(copy_to_tp(w, axis), i, 1, axis=1)   # [D, 1, H]


def attention_shard(p, x, *, cfg: reference.ModelConfig, axis: str,
                    sequence_parallel: bool = False, positions=None, attend=None):
    """Attention split by heads. x: [B, T, D] (TP) or [B, T_tp, D] (SP) -> same shape.

    wq[D, N_tp, H], wk/wv[D, K_tp, H] (or [D, K, H] replicated when tp > K), wo[N_tp, H, D].
    A head's Q, K and V live on one device, so attention itself needs no communication.
    positions: int[T] of the (gathered) tokens for the rotary embedding (default 0..T-1);
    attend(q, k, v) -> o: the attention of the local heads (default reference.attention;
    ring or Ulysses attention over a context axis for a composed model).
    """
    t = jax.lax.axis_size(axis)
    wk, wv = p["wk"], p["wv"]
    if cfg.n_kv_heads % t:                                      # tp > K: replicated KV heads
        wk = _kv_shard(wk, axis=axis, n_kv_heads=cfg.n_kv_heads)
        wv = _kv_shard(wv, axis=axis, n_kv_heads=cfg.n_kv_heads)
    q, k, v = column_parallel(x, p["wq"], wk, wv, axis=axis, sequence_parallel=sequence_parallel)
    # q: [B, T, N/t, H]; k, v: [B, T, K/t or 1, H]
    assert q.shape[2] == cfg.n_heads // t, q.shape
    if cfg.rope_theta:
        positions = jnp.arange(q.shape[1]) if positions is None else positions
        q, k = (reference.rope(a, positions, cfg.rope_theta) for a in (q, k))
    o = (attend or (lambda q, k, v: reference.attention(q, k, v, causal=cfg.causal)))(q, k, v)  # [B, T, N/t, H]
    return row_parallel(o, p["wo"], axis=axis, sequence_parallel=sequence_parallel)


def mlp_shard(p, x, *, cfg: reference.ModelConfig, axis: str,
              sequence_parallel: bool = False):
    """Megatron MLP: Z = act(X A) B with A column-split, B row-split (section 3.2).

    x: [B, T, D] (TP) or [B, T_tp, D] (SP). w_up, w_gate: [D, F_tp]; w_down: [F_tp, D].
    The activation is elementwise on whole columns, so it needs no communication.
    """
    ws = (p["w_up"], p["w_gate"]) if cfg.mlp == "swiglu" else (p["w_up"],)
    outs = column_parallel(x, *ws, axis=axis, sequence_parallel=sequence_parallel)
    if cfg.mlp == "swiglu":
        hidden = jax.nn.silu(outs[1]) * outs[0]                  # [B, T, F/t]
    else:
        hidden = jax.nn.gelu(outs[0], approximate=False)         # [B, T, F/t]
    return row_parallel(hidden, p["w_down"], axis=axis, sequence_parallel=sequence_parallel)


def block_shard(p, x, *, cfg: reference.ModelConfig, axis: str = TP,
                sequence_parallel: bool = False, positions=None, attend=None, ffn=None):
    """One pre-norm block on one tp shard. x, y: [B, T, D] (TP) or [B, T_tp, D] (SP).

    Norms and residuals are replicated (TP) or run on this device's T/t tokens (SP). Under
    SP the gains go through f: each device saw only its tokens, so dL/dgain is the psum
    over tp of the local parts (exercise 5c). positions and attend: see attention_shard;
    ffn(p, z) -> the feed-forward output in z's layout (default: the Megatron MLP; an
    expert-parallel MoE for a composed model).
    """
    kw = dict(cfg=cfg, axis=axis, sequence_parallel=sequence_parallel)
    g_attn, g_mlp = p["attn_norm"], p["mlp_norm"]
    if sequence_parallel:
        g_attn, g_mlp = copy_to_tp(g_attn, axis), copy_to_tp(g_mlp, axis)
    h = x + attention_shard(p, reference.rms_norm(x, g_attn, cfg.norm_eps), positions=positions, attend=attend,
                            **kw)
    z = reference.rms_norm(h, g_mlp, cfg.norm_eps)
    return h + (mlp_shard(p, z, **kw) if ffn is None else ffn(p, z))


# --- the lecture's counterexample -----------------------------------------------------------

def row_split_gelu(x, a, *, mesh: Mesh):
    """The wrong way (lecture 3.2): split A[D_tp, F] by rows, apply GeLU to the partial sums.

    x[B, D_tp] @ a[D_tp, F] gives each device a partial sum {U_tp} of the pre-activation;
    GeLU(p_1 + ... + p_t) != GeLU(p_1) + ... + GeLU(p_t), so psum(GeLU(partial)) is wrong.
    Returns (wrong, right): right all-reduces first, then applies GeLU (one more all-reduce
    than column-splitting A, which needs none).
    """
    require_mesh(mesh, axes=(TP,), needed_by="row_split_gelu")
    (B, D), (D2, F) = (errors.array("x", x, ndim=2, kinds="f", shape_doc="x[batch, d_model]"),
                       errors.array("a", a, ndim=2, kinds="f", shape_doc="a[d_model, d_ff]"))
    if D != D2:
        raise ConfigError(f"x {(B, D)} and a {(D2, F)}: a's rows must be x's columns (x @ a)")
    errors.divisible("d_model", D, "tp", axis_size(mesh, TP), why="A is split by rows over tp",
                     fix=f"use d_model a multiple of {axis_size(mesh, TP)}")

    def body(x, a):                                    # x: [B, D/t], a: [D/t, F]
        partial_sum = x @ a                            # [B, F]{U_tp}
        wrong = jax.lax.psum(jax.nn.gelu(partial_sum, approximate=False), TP)
        right = jax.nn.gelu(jax.lax.psum(partial_sum, TP), approximate=False)
        return wrong, right

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, TP), P(TP, None)),
                         out_specs=(P(), P()))(x, a)


def row_split_gelu_error(*, mesh: Mesh, batch_size: int = 16, d_model: int = 64, d_ff: int = 256,
                         seed: int = 0) -> float:
    """Max |psum(GeLU(partial sums)) - GeLU(X A)| for X[batch_size, d_model] ~ N(0, 1),
    A ~ N(0, 1/D) (lecture: 0.82)."""
    kx, ka = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (batch_size, d_model))
    a = jax.random.normal(ka, (d_model, d_ff)) / np.sqrt(d_model)
    wrong, _ = row_split_gelu(x, a, mesh=mesh)
    return float(jnp.max(jnp.abs(wrong - jax.nn.gelu(x @ a, approximate=False))))
