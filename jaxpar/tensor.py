"""Megatron tensor parallelism, with a sequence-parallel switch (lecture sections 3 and 4.4).

The block is the reference's pre-norm block, `reference.block`, cut across the `tp` axis:

    column-parallel (split the output dim):  wq[D, N_tp, H], wk/wv[D, K_tp, H], w_up/w_gate[D, F_tp]
    row-parallel    (split the input dim):   wo[N_tp, H, D], w_down[F_tp, D]
    replicated:                              attn_norm[D], mlp_norm[D]

Tensor parallel (TP), x[B, T, D] replicated over tp:
    h = x + g(attn(f(norm(x))))        f: identity fwd / all-reduce bwd
    y = h + g(mlp(f(norm(h))))         g: all-reduce fwd / identity bwd
  forward: 2 all-reduces of b*s*h, backward: 2 more (lecture 3.4).

Sequence parallel (SP), x[B, T_tp, D]: norms and residuals run on T/t tokens; f becomes an
all-gather along T and g a reduce-scatter along T (the same bytes: AG + RS = one AR), and
the replicated norm gains go through f so their gradients are all-reduced over tp
(exercise 5c). The token-wise activations kept for the backward (norm inputs/outputs,
residual stream) are then 1/t of TP's (benchmarks/tensor.py measures it). Autodiff still
keeps the gathered input of each column-parallel layer for the weight gradient, whole;
Megatron re-gathers it in the backward instead (Korthikanti et al. 2022, sec. 4.2.2). We
do not, because on XLA:CPU a re-gather (jax.checkpoint, or an optimization barrier in a
custom_vjp) is CSE'd with the forward all-gather: measured there, the same program. That
is one backend's choice, not measured on GPU or TPU, where the re-gather may survive and
pay off.

Per device and layer, a ring all-reduce of b*s*h elements sends 2(t-1)/t of them, so TP
sends 4 * 2(t-1)/t * b*s*h = 8*b*s*h*(t-1)/t elements per layer (forward + backward);
SP's all-gathers and reduce-scatters send (t-1)/t each, the same total.

Papers: Shoeybi et al. 2019 (Megatron-LM); Korthikanti et al. 2022 (sequence parallelism).
The per-shard functions below are the lesson; `tp_block` wraps them in shard_map.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.collectives import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from jaxpar.mesh import DP, TP


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPSpecs:
    """Every PartitionSpec of the tensor-parallel block, in one place (names end in the
    dimension letters of the array). Build with `TPSpecs.megatron(...)`."""

    attn_norm_d: P = P()            # replicated: tiny, and needed whole by every token
    wq_dnh: P = P(None, TP, None)   # column-parallel: heads split
    wk_dkh: P = P(None, TP, None)   # heads split, or P() when tp > K (KV heads replicated)
    wv_dkh: P = P(None, TP, None)
    wo_nhd: P = P(TP, None, None)   # row-parallel: each device holds its heads' rows
    mlp_norm_d: P = P()
    w_up_df: P = P(None, TP)        # column-parallel (both SwiGLU up projections)
    w_gate_df: P = P(None, TP)
    w_down_fd: P = P(TP, None)      # row-parallel
    act_btd: P = P(None, None, None)  # block input/output: batch over dp; T over tp with SP

    @classmethod
    def megatron(cls, *, n_kv_heads: int, tp: int, sequence_parallel: bool = False,
                 data_axis: str | None = None) -> "TPSpecs":
        """Megatron's layout. With tp = 1 nothing is split (XLA would keep collectives
        over a size-1 axis)."""
        t = TP if tp > 1 else None
        kv = P(None, t, None) if n_kv_heads % tp == 0 else P()
        return cls(wq_dnh=P(None, t, None), wk_dkh=kv, wv_dkh=kv, wo_nhd=P(t, None, None),
                   w_up_df=P(None, t), w_gate_df=P(None, t), w_down_fd=P(t, None),
                   act_btd=P(data_axis, t if sequence_parallel else None, None))

    def params(self, p: dict) -> dict:
        """The in_specs for a block's param dict (the keys it has)."""
        table = {"attn_norm": self.attn_norm_d, "wq": self.wq_dnh, "wk": self.wk_dkh, "wv": self.wv_dkh,
                 "wo": self.wo_nhd, "mlp_norm": self.mlp_norm_d, "w_up": self.w_up_df,
                 "w_gate": self.w_gate_df, "w_down": self.w_down_fd}
        return {k: table[k] for k in p}


def block_param_shapes(cfg: reference.ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each of one block's params (reference.layer_params) under `cfg`."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, K, H), "wv": (D, K, H), "wo": (N, H, D),
              "mlp_norm": (D,), "w_up": (D, F), "w_down": (F, D)}
    return shapes | ({"w_gate": (D, F)} if cfg.mlp == "swiglu" else {})


def check_block_inputs(params: dict, x, cfg: reference.ModelConfig) -> None:
    """ValueError, naming the value, the constraint and a fix, if one block's `params` or
    x[B, T, D] do not fit `cfg` (checked on shapes, before any compute)."""
    layer = "Fix: pass one layer's params, reference.layer_params(params, i)"
    if "blocks" in params:
        raise ValueError(f"params has keys {sorted(params)}: the whole model, but tp_block runs one block. {layer}")
    want = block_param_shapes(cfg)
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(f"block params {sorted(params)} do not fit cfg (mlp={cfg.mlp!r}; SwiGLU has w_gate, "
                         f"GeLU does not): missing {missing}, unexpected {extra}. Fix: build the params with "
                         "reference.init_params(key, cfg) for this cfg, or set mlp to match them")
    for k, shape in want.items():
        got = tuple(params[k].shape)
        if got != shape and got[1:] == shape:
            raise ValueError(f"params[{k!r}] has shape {got}, one block's is {shape}: a leading layer axis, "
                             f"the stacked params['blocks']. {layer}")
        if got != shape:
            raise ValueError(f"params[{k!r}] has shape {got}, cfg gives {shape} (D={cfg.d_model}, "
                             f"N={cfg.n_heads}, K={cfg.n_kv_heads}, H={cfg.head_dim}, F={cfg.d_ff}). "
                             "Fix: use the cfg the params were built with")
    if x.ndim != 3 or x.shape[-1] != cfg.d_model:
        raise ValueError(f"x has shape {tuple(x.shape)}; tp_block takes x[B, T, D] with D = cfg.d_model = "
                         f"{cfg.d_model}. Fix: pass a [batch, sequence, {cfg.d_model}] array (x[None] adds "
                         "a batch axis)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tp(cfg: reference.ModelConfig, tp: int, *, seq: int | None = None,
             sequence_parallel: bool = False) -> None:
    """ValueError, naming the constraint and a fix, if `cfg` cannot be split `tp` ways."""
    if cfg.n_experts:
        raise ValueError(f"tp_block runs dense MLP blocks; n_experts={cfg.n_experts} is an MoE block. "
                         "Fix: use expert.ep_moe for MoE, or n_experts=0")
    if cfg.n_heads % tp:
        raise ValueError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}: each tp device computes "
                         f"n_heads/tp whole heads. Fix: use tp in ({_divisors(cfg.n_heads)}) or change n_heads")
    K = cfg.n_kv_heads
    if K % tp and tp % K:
        raise ValueError(f"n_kv_heads={K} and tp={tp}: KV heads are split when tp divides n_kv_heads and "
                         "replicated when n_kv_heads divides tp, neither holds. Fix: use tp in "
                         f"({_divisors(K)}) or a multiple of {K} dividing n_heads={cfg.n_heads}")
    if cfg.d_ff % tp:
        raise ValueError(f"d_ff={cfg.d_ff} (FFN width) is not divisible by tp={tp}: the column-parallel "
                         f"up projection gives d_ff/tp columns per device. Fix: use tp in ({_divisors(cfg.d_ff)})")
    if sequence_parallel and seq is not None and seq % tp:
        raise ValueError(f"sequence length T={seq} is not divisible by tp={tp}: sequence parallelism keeps "
                         f"T/tp tokens per device. Fix: pad the sequence to a multiple of {tp} or "
                         "use sequence_parallel=False")


# --- per-shard layers (run inside shard_map over `axis`) --------------------------------

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
                    sequence_parallel: bool = False):
    """Attention split by heads. x: [B, T, D] (TP) or [B, T_tp, D] (SP) -> same shape.

    wq[D, N_tp, H], wk/wv[D, K_tp, H] (or [D, K, H] replicated when tp > K), wo[N_tp, H, D].
    A head's Q, K and V live on one device, so attention itself needs no communication.
    """
    t = jax.lax.axis_size(axis)
    wk, wv = p["wk"], p["wv"]
    if cfg.n_kv_heads % t:                                      # tp > K: replicated KV heads
        wk = _kv_shard(wk, axis=axis, n_kv_heads=cfg.n_kv_heads)
        wv = _kv_shard(wv, axis=axis, n_kv_heads=cfg.n_kv_heads)
    q, k, v = column_parallel(x, p["wq"], wk, wv, axis=axis, sequence_parallel=sequence_parallel)
    # q: [B, T, N/t, H]; k, v: [B, T, K/t or 1, H]
    assert q.shape[2] == cfg.n_heads // t, q.shape
    o = reference.attention(q, k, v, causal=cfg.causal)        # [B, T, N/t, H]
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
                sequence_parallel: bool = False):
    """One pre-norm block on one tp shard. x, y: [B, T, D] (TP) or [B, T_tp, D] (SP).

    Norms and residuals are replicated (TP) or run on this device's T/t tokens (SP). Under
    SP the gains go through f: each device saw only its tokens, so dL/dgain is the psum
    over tp of the local parts (exercise 5c).
    """
    kw = dict(cfg=cfg, axis=axis, sequence_parallel=sequence_parallel)
    g_attn, g_mlp = p["attn_norm"], p["mlp_norm"]
    if sequence_parallel:
        g_attn, g_mlp = copy_to_tp(g_attn, axis), copy_to_tp(g_mlp, axis)
    h = x + attention_shard(p, reference.rms_norm(x, g_attn, cfg.norm_eps), **kw)
    return h + mlp_shard(p, reference.rms_norm(h, g_mlp, cfg.norm_eps), **kw)


# --- global wrapper ---------------------------------------------------------------------

def tp_block(params: dict, x, *, mesh: Mesh, cfg: reference.ModelConfig,
             sequence_parallel: bool = False):
    """reference.block(params, x, cfg), tensor parallel over mesh axis `tp`.

    params: one block's params (reference.layer_params), global arrays; laid out by
      TPSpecs.megatron. x: [B, T, D] global; batch split over `dp` if the mesh has it.
    Returns y[B, T, D] sharded as TPSpecs.act_btd: P(dp, None, None), or P(dp, tp, None)
    with sequence_parallel. Gradients (jax.grad around this call) come back as global
    arrays, sharded like the params.
    """
    if TP not in mesh.shape:
        raise ValueError(f"tp_block needs a mesh with a '{TP}' axis; got axes {tuple(mesh.shape)}. "
                         "Fix: jaxpar.mesh.make_mesh(tp=..., dp=...)")
    t = mesh.shape[TP]
    check_tp(cfg, t, seq=x.shape[1] if x.ndim == 3 else None, sequence_parallel=sequence_parallel)
    check_block_inputs(params, x, cfg)
    dp = mesh.shape.get(DP, 1)
    if x.shape[0] % dp:
        raise ValueError(f"batch B={x.shape[0]} is not divisible by dp={dp}. Fix: use a batch that is a "
                         f"multiple of {dp}")
    specs = TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=t, sequence_parallel=sequence_parallel,
                             data_axis=DP if dp > 1 else None)
    body = partial(block_shard, cfg=cfg, axis=TP, sequence_parallel=sequence_parallel)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs.params(params), specs.act_btd),
                       out_specs=specs.act_btd)
    return fn(params, x)


# --- collective formulas ------------------------------------------------------------------

def block_param_bytes(cfg: reference.ModelConfig, dtype, tp: int = 1) -> int:
    """Bytes of one block's params held by one device under TPSpecs.megatron: the matrices
    are 1/tp (wk/wv whole when tp > n_kv_heads), the two norm gains are replicated."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    kv = 2 * D * K * H // (tp if K % tp == 0 else 1)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    return (2 * D + (2 * D * N * H + (n_up + 1) * D * F) // tp + kv) * jnp.dtype(dtype).itemsize


def tp_block_collectives(cfg: reference.ModelConfig, batch: int, seq: int, dtype, tp: int, *,
                         sequence_parallel: bool = False, backward: bool = False,
                         dp: int = 1) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} of the compiled tp_block (the form comms.nonzero gives).

    backward=False: the forward program, jit(tp_block). backward=True: the backward
    program alone, jit of the function jax.vjp returns (residuals in, gradients out), so
    neither pass hides in the other. b = batch/dp is the batch one tp group sees (the local
    batch on a dp x tp mesh); one act = b*seq*d_model elements.
      TP  forward: 2 all-reduces of act (the g after attention and after the MLP).
          backward: 2 all-reduces of act (the two f's), lecture 3.4's 2*s*d each way.
      SP  forward: 2 all-gathers + 2 reduce-scatters of act (the bytes of TP's 2 AR).
          backward: their transposes, 2 RS + 2 AG, and the gains' gradient all-reduce
          (the f of exercise 5c), 2*d_model elements.
      tp > n_kv_heads (KV heads replicated): the backward all-reduces wk's and wv's
          gradients over tp too, 2*D*K*H elements. XLA's all-reduce combiner merges it
          with another all-reduce of the tp group ready at the same time: the attention
          f's (TP) or the gains' (SP), so it adds bytes but no instruction.
      dp > 1: the backward all-reduces this device's parameter gradients over dp
          (data parallelism, not TP), combined into one instruction of
          block_param_bytes(cfg, dtype, tp). With replicated KV heads XLA all-reduces the
          wk/wv gradients over dp *before* the tp all-reduce (both are sums: they
          commute), on this device's KV-head slice, 2*D*H elements instead of 2*D*K*H;
          whether that joins the other dp gradients or stays its own instruction is the
          combiner's choice (it does with SP, not with TP on CPU), so for that case only
          the bytes are a contract.
    With tp = 1 there are no tp collectives.
    Bytes are those of `dtype`, what the program asks for. XLA:CPU runs bf16 collectives
    in f32 (it converts around them), so in bf16 every kind measures twice these bytes on
    CPU (measured); other backends are not measured here.
    """
    item = jnp.dtype(dtype).itemsize
    act = batch // dp * seq * cfg.d_model * item
    kv_rep = tp > 1 and cfg.n_kv_heads % tp != 0
    out: dict[str, tuple[int, int]] = {}

    def add(kind, count, nbytes):
        c, b = out.get(kind, (0, 0))
        out[kind] = (c + count, b + nbytes)

    if tp > 1:
        if sequence_parallel:
            add("all-gather", 2, 2 * act)
            add("reduce-scatter", 2, 2 * act)
            if backward:
                add("all-reduce", 1, 2 * cfg.d_model * item)
        else:
            add("all-reduce", 2, 2 * act)
        if backward and kv_rep:
            add("all-reduce", 0, 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim * item)
    if backward and dp > 1:
        kv_full = 2 * cfg.d_model * cfg.n_kv_heads * cfg.head_dim * item
        kv_slice = 2 * cfg.d_model * cfg.head_dim * item
        add("all-reduce", 1, block_param_bytes(cfg, dtype, tp) - (kv_full - kv_slice if kv_rep else 0))
    return out


def ring_bytes_per_device(cfg: reference.ModelConfig, batch: int, seq: int, dtype, tp: int) -> float:
    """Bytes one device sends per layer, forward + backward, on a ring: 8*b*s*h*(t-1)/t
    elements (4 all-reduces of b*s*h, each 2(t-1)/t of it; the same for SP's 4 AG + 4 RS)."""
    return 8 * batch * seq * cfg.d_model * (tp - 1) / tp * jnp.dtype(dtype).itemsize


# --- the lecture's counterexample -----------------------------------------------------------

def row_split_gelu(x, a, *, mesh: Mesh):
    """The wrong way (lecture 3.2): split A[D_tp, F] by rows, apply GeLU to the partial sums.

    x[B, D_tp] @ a[D_tp, F] gives each device a partial sum {U_tp} of the pre-activation;
    GeLU(p_1 + ... + p_t) != GeLU(p_1) + ... + GeLU(p_t), so psum(GeLU(partial)) is wrong.
    Returns (wrong, right): right all-reduces first, then applies GeLU (one more all-reduce
    than column-splitting A, which needs none).
    """
    def body(x, a):                                    # x: [B, D/t], a: [D/t, F]
        partial_sum = x @ a                            # [B, F]{U_tp}
        wrong = jax.lax.psum(jax.nn.gelu(partial_sum, approximate=False), TP)
        right = jax.nn.gelu(jax.lax.psum(partial_sum, TP), approximate=False)
        return wrong, right

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, TP), P(TP, None)),
                         out_specs=(P(), P()))(x, a)


def row_split_gelu_error(*, mesh: Mesh, batch: int = 16, d_model: int = 64, d_ff: int = 256,
                         seed: int = 0) -> float:
    """Max |psum(GeLU(partial sums)) - GeLU(X A)| for X ~ N(0, 1), A ~ N(0, 1/D) (lecture: 0.82)."""
    kx, ka = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (batch, d_model))
    a = jax.random.normal(ka, (d_model, d_ff)) / np.sqrt(d_model)
    wrong, _ = row_split_gelu(x, a, mesh=mesh)
    return float(jnp.max(jnp.abs(wrong - jax.nn.gelu(x @ a, approximate=False))))


# --- `jaxpar verify tp` / `jaxpar verify sp` (in tensor_checks.py, to keep this file short) ---

def tour_check_tp():
    """The TP block against reference.block: output, input and all parameter gradients,
    collectives vs tp_block_collectives; the row-split GeLU counterexample; and the
    vocabulary-parallel embedding and LM head with its cross-entropy."""
    from jaxpar.tensor_checks import check_block, check_counterexample, check_vocab
    return [check_block(sequence_parallel=False), check_counterexample(), check_vocab()]


def tour_check_sp():
    """The sequence-parallel block against reference.block, collectives vs formula."""
    from jaxpar.tensor_checks import check_block
    return [check_block(sequence_parallel=True)]
