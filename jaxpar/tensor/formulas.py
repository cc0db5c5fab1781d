"""The tensor-parallel collectives and bytes, in closed form (pure Python: the planner reads it).

Every `*_collectives` function has one signature shape, (*, cfg, batch_size, seq_len,
dtype, dp, tp, ..., backward), and returns the `comms.Collectives` that the compiled
program must show: the forward program (backward=False), or the backward alone (jit of
the function jax.vjp returns), so neither pass hides in the other. `cfg` is a
`reference.ModelConfig` (only its sizes are read). Bytes are those of `dtype`, what the
program asks for. XLA:CPU runs bf16 collectives in f32 (it converts around them), so in
bf16 every kind measures twice these bytes on CPU (measured); other backends are not
measured here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError


@runtime_checkable
class ModelSizes(Protocol):
    """The sizes of `reference.ModelConfig` these formulas read (importing it would start JAX)."""

    vocab: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    mlp: str


def _sizes(batch_size, seq_len, dp, tp, cfg) -> int:
    """Refuse sizes that are not whole numbers >= 1, a batch that dp does not split, or a
    cfg without a model's sizes; return the batch one tp group sees, batch_size/dp."""
    if not isinstance(cfg, ModelSizes):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("dp", dp), ("tp", tp)):
        errors.whole(name, value)
    errors.divisible("batch_size", batch_size, "dp", dp, why="each data-parallel group takes batch_size/dp rows",
                     fix=f"a batch_size that is a multiple of {dp}")
    return batch_size // dp


def block_param_shapes(cfg: ModelSizes) -> dict[str, tuple[int, ...]]:
    """The shape of each of one block's params (reference.layer_params) under `cfg`."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    shapes = {"attn_norm": (D,), "wq": (D, N, H), "wk": (D, K, H), "wv": (D, K, H), "wo": (N, H, D),
              "mlp_norm": (D,), "w_up": (D, F), "w_down": (F, D)}
    return shapes | ({"w_gate": (D, F)} if cfg.mlp == "swiglu" else {})


def block_param_bytes(*, cfg: ModelSizes, dtype, tp: int = 1) -> int:
    """Bytes of one block's params held by one device under TPSpecs.megatron: the matrices
    are 1/tp (wk/wv whole when tp > n_kv_heads), the two norm gains are replicated."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    kv = 2 * D * K * H // (tp if K % tp == 0 else 1)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    return (2 * D + (2 * D * N * H + (n_up + 1) * D * F) // tp + kv) * np.dtype(dtype).itemsize


def tp_block_collectives(*, cfg: ModelSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, tp: int = 1,
                         sequence_parallel: bool = False, backward: bool = False) -> Collectives:
    """The collectives of the compiled tp_block, as comms.nonzero measures them.

    backward=False: the forward program, jit(tp_block). backward=True: the backward
    program alone, jit of the function jax.vjp returns (residuals in, gradients out), so
    neither pass hides in the other. b = batch_size/dp is the batch one tp group sees (the local
    batch on a dp x tp mesh); one act = b*seq_len*d_model elements.
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
          block_param_bytes(cfg=cfg, dtype=dtype, tp=tp). With replicated KV heads XLA all-reduces the
          wk/wv gradients over dp *before* the tp all-reduce (both are sums: they
          commute), on this device's KV-head slice, 2*D*H elements instead of 2*D*K*H;
          whether that joins the other dp gradients or stays its own instruction is the
          combiner's choice (it does with SP, not with TP on CPU), so for that case only
          the bytes are a contract.
    With tp = 1 there are no tp collectives.
    """
    item = np.dtype(dtype).itemsize
    act = _sizes(batch_size, seq_len, dp, tp, cfg) * seq_len * cfg.d_model * item
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
        add("all-reduce", 1, block_param_bytes(cfg=cfg, dtype=dtype, tp=tp) - (kv_full - kv_slice if kv_rep else 0))
    return Collectives(out)


def ring_bytes_per_device(*, cfg: ModelSizes, batch_size: int, seq_len: int, dtype, tp: int) -> float:
    """Bytes one device sends per layer, forward + backward, on a ring: 8*b*s*h*(t-1)/t
    elements (4 all-reduces of b*s*h, each 2(t-1)/t of it; the same for SP's 4 AG + 4 RS),
    b = batch_size the tp group sees."""
    return 8 * batch_size * seq_len * cfg.d_model * (tp - 1) / tp * np.dtype(dtype).itemsize


def _vocab_all_reduces(ops: list[tuple[int, int]]) -> Collectives:
    return Collectives({"all-reduce": (sum(c for c, _ in ops), sum(n for _, n in ops))} if ops else {})


def embedding_collectives(*, cfg: ModelSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, tp: int = 1,
                          backward: bool = False) -> Collectives:
    """vocab_parallel_embedding of tokens[batch_size, seq_len]: forward, g's all-reduce of the
    rows of every shard over tp, b*T*D (b = batch_size/dp); backward, a local scatter-add,
    and with dp > 1 the all-reduce over dp of this device's embedding gradient, V/t*D."""
    item, b = np.dtype(dtype).itemsize, _sizes(batch_size, seq_len, dp, tp, cfg)
    ops = []
    if tp > 1 and not backward:
        ops.append((1, b * seq_len * cfg.d_model * item))
    if dp > 1 and backward:
        ops.append((1, cfg.vocab // tp * cfg.d_model * item))
    return _vocab_all_reduces(ops)


def cross_entropy_collectives(*, cfg: ModelSizes, batch_size: int, seq_len: int, dtype, dp: int = 1,
                              tp: int = 1, backward: bool = False) -> Collectives:
    """vocab_parallel_cross_entropy of logits[batch_size, seq_len, V_tp]: forward, the
    all-reduces over tp of the max (its own: a max does not combine with sums) and of the
    sum of exp with the target's logit (XLA combines the two sums), 2 ops of 3*b*T
    elements; with dp > 1 the mean over dp, one scalar. Backward: none, softmax - onehot
    is local."""
    item, b = np.dtype(dtype).itemsize, _sizes(batch_size, seq_len, dp, tp, cfg)
    ops = []
    if not backward:
        if tp > 1:
            ops += [(1, b * seq_len * item), (1, 2 * b * seq_len * item)]
        if dp > 1:
            ops.append((1, item))
    return _vocab_all_reduces(ops)


def lm_loss_collectives(*, cfg: ModelSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, tp: int = 1,
                        backward: bool = False) -> Collectives:
    """vocab_parallel_lm_loss (final norm, f, unembed[D, V_tp], cross-entropy): forward, the
    cross-entropy's; backward, f's all-reduce of dL/dz over tp, b*T*D, and with dp > 1 the
    all-reduce over dp of this device's unembed and final_norm gradients, (V/t + 1)*D."""
    if not backward:
        return cross_entropy_collectives(cfg=cfg, batch_size=batch_size, seq_len=seq_len, dtype=dtype, dp=dp, tp=tp)
    item, b = np.dtype(dtype).itemsize, _sizes(batch_size, seq_len, dp, tp, cfg)
    ops = []
    if tp > 1:
        ops.append((1, b * seq_len * cfg.d_model * item))
    if dp > 1:
        ops.append((1, (cfg.vocab // tp + 1) * cfg.d_model * item))
    return _vocab_all_reduces(ops)
