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
The per-shard functions of `layers.py` are the lesson; `tp_block` wraps them in shard_map,
laid out by `TPSpecs`, after refusing (ConfigError) whatever the split cannot take.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import errors, reference
from jaxpar.errors import ConfigError, divisors
from jaxpar.mesh import DP, TP, axis_size, require_divisible, require_mesh
from jaxpar.tensor.formulas import block_param_shapes
from jaxpar.tensor.layers import block_shard


def without_axis(pspecs, axis: str):
    """A frozen dataclass of PartitionSpecs (TPSpecs, vocab.VocabSpecs) with `axis` taken
    out of every pspec, its dimensions left unsplit."""
    def drop(pspec: P) -> P:
        entries = []
        for e in pspec:
            kept = tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a is not None and a != axis)
            entries.append(kept if len(kept) > 1 else kept[0] if kept else None)
        return P(*entries)
    return dataclasses.replace(pspecs, **{f.name: drop(getattr(pspecs, f.name)) for f in dataclasses.fields(pspecs)})


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPSpecs:
    """Megatron's layout of the block: every PartitionSpec of the tensor-parallel block,
    in one place (names end in the dimension letters of the array). The defaults ARE the
    layout, over tp devices that divide the KV heads; `named` and `megatron` adapt it to a
    model and a mesh, and the composed model's partition metadata is read from it
    (`train.model.partition_names`)."""

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
    def named(cls, *, n_kv_heads: int, tp: int) -> "TPSpecs":
        """The layout for `n_kv_heads` KV heads on `tp` devices, every tp name kept (also
        at tp = 1): the KV heads replicated when tp does not divide them (tp > K, each
        device slices its group's head). What a model's partition metadata states."""
        errors.whole("n_kv_heads", n_kv_heads)
        errors.whole("tp", tp)
        return cls() if n_kv_heads % tp == 0 else cls(wk_dkh=P(), wv_dkh=P())

    @classmethod
    def megatron(cls, *, n_kv_heads: int, tp: int, sequence_parallel: bool = False,
                 data_axis: str | None = None) -> "TPSpecs":
        """Megatron's layout on a mesh: `named`, the activations' batch over `data_axis`
        and, with sequence_parallel, their tokens over tp. With tp = 1 nothing is split
        (XLA would keep collectives over a size-1 axis)."""
        pspecs = cls.named(n_kv_heads=n_kv_heads, tp=tp)
        pspecs = pspecs if tp > 1 else without_axis(pspecs, TP)
        return dataclasses.replace(pspecs, act_btd=P(data_axis, TP if sequence_parallel and tp > 1 else None, None))

    def params(self, p: dict) -> dict:
        """The in_specs for a block's param dict (the keys it has)."""
        table = {"attn_norm": self.attn_norm_d, "wq": self.wq_dnh, "wk": self.wk_dkh, "wv": self.wv_dkh,
                 "wo": self.wo_nhd, "mlp_norm": self.mlp_norm_d, "w_up": self.w_up_df,
                 "w_gate": self.w_gate_df, "w_down": self.w_down_fd}
        return {k: table[k] for k in p}


def validate_block_inputs(params: dict, x, cfg: reference.ModelConfig) -> None:
    """Refuse (ConfigError, naming the value, the constraint and a fix) one block's `params`
    or x[B, T, D] that do not fit `cfg` (checked on shapes, before any compute)."""
    layer = "Fix: pass one layer's params, reference.layer_params(params, i)"
    if not isinstance(cfg, reference.ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig")
    if not isinstance(params, dict):
        raise ConfigError(f"params is a {type(params).__name__}: give one block's dict of arrays, "
                          "reference.layer_params(params, i)")
    if "blocks" in params:
        raise ConfigError(f"params has keys {sorted(params)}: the whole model, but tp_block runs one block. {layer}")
    want = block_param_shapes(cfg)
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    if missing or extra:
        raise ConfigError(f"block params {sorted(params)} do not fit cfg (mlp={cfg.mlp!r}; SwiGLU has w_gate, "
                          f"GeLU does not): missing {missing}, unexpected {extra}. Fix: build the params with "
                          "reference.init_params(key, cfg) for this cfg, or set mlp to match them")
    for k, shape in want.items():
        got = errors.array(f"params[{k!r}]", params[k], kinds="f", shape_doc=f"params[{k!r}]{list(shape)}")
        if got != shape and got[1:] == shape:
            raise ConfigError(f"params[{k!r}] has shape {got}, one block's is {shape}: a leading layer axis, "
                              f"the stacked params['blocks']. {layer}")
        if got != shape:
            raise ConfigError(f"params[{k!r}] has shape {got}, cfg gives {shape} (D={cfg.d_model}, "
                              f"N={cfg.n_heads}, K={cfg.n_kv_heads}, H={cfg.head_dim}, F={cfg.d_ff}). "
                              "Fix: use the cfg the params were built with")
    shape = errors.array("x", x, kinds="f", shape_doc=f"x[batch, seq, d_model={cfg.d_model}]")
    if len(shape) != 3 or shape[-1] != cfg.d_model:
        raise ConfigError(f"x has shape {shape}; tp_block takes x[B, T, D] with D = cfg.d_model = "
                          f"{cfg.d_model}. Fix: pass a [batch, sequence, {cfg.d_model}] array (x[None] adds "
                          "a batch axis)")


def validate_batch(batch_size: int, mesh: Mesh) -> None:
    """Refuse a batch that does not split over the mesh's dp axis."""
    require_divisible("batch B", batch_size, mesh, (DP,), why="each data-parallel group takes B/dp rows")


def validate_tp(cfg: reference.ModelConfig, tp: int, *, seq_len: int | None = None,
                sequence_parallel: bool = False) -> None:
    """Refuse (ConfigError, naming the constraint and a fix) a `cfg` that cannot be split `tp` ways."""
    if cfg.n_experts:
        raise ConfigError(f"tp_block runs dense MLP blocks; n_experts={cfg.n_experts} is an MoE block. "
                          "Fix: n_experts=0, or expert.ep_moe for the MoE layer (jaxpar.train composes both: "
                          "the experts over ep, each expert's FFN over tp)")
    if cfg.n_heads % tp:
        raise ConfigError(f"n_heads={cfg.n_heads} is not divisible by tp={tp}: each tp device computes "
                          f"n_heads/tp whole heads. Fix: use tp in ({divisors(cfg.n_heads)}) or change n_heads")
    K = cfg.n_kv_heads
    if K % tp and tp % K:
        raise ConfigError(f"n_kv_heads={K} and tp={tp}: KV heads are split when tp divides n_kv_heads and "
                          "replicated when n_kv_heads divides tp, neither holds. Fix: use tp in "
                          f"({divisors(K)}) or a multiple of {K} dividing n_heads={cfg.n_heads}")
    if cfg.d_ff % tp:
        raise ConfigError(f"d_ff={cfg.d_ff} (FFN width) is not divisible by tp={tp}: the column-parallel "
                          f"up projection gives d_ff/tp columns per device. Fix: use tp in ({divisors(cfg.d_ff)})")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ConfigError(f"sequence length T={seq_len} is not divisible by tp={tp}: sequence parallelism keeps "
                          f"T/tp tokens per device. Fix: pad the sequence to a multiple of {tp} or "
                          "use sequence_parallel=False")


def tp_block(params: dict, x, *, mesh: Mesh, cfg: reference.ModelConfig,
             sequence_parallel: bool = False):
    """reference.block(params, x, cfg), tensor parallel over mesh axis `tp`.

    params: one block's params (reference.layer_params), global arrays; laid out by
      TPSpecs.megatron. x: [B, T, D] global; batch split over `dp` if the mesh has it.
    Returns y[B, T, D] sharded as TPSpecs.act_btd: P(dp, None, None), or P(dp, tp, None)
    with sequence_parallel. Gradients (jax.grad around this call) come back as global
    arrays, sharded like the params.
    """
    require_mesh(mesh, axes=(TP,), needed_by="tp_block")
    errors.flag("sequence_parallel", sequence_parallel)
    validate_block_inputs(params, x, cfg)
    t, dp = axis_size(mesh, TP), axis_size(mesh, DP)
    validate_tp(cfg, t, seq_len=x.shape[1], sequence_parallel=sequence_parallel)
    validate_batch(x.shape[0], mesh)
    pspecs = TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=t, sequence_parallel=sequence_parallel,
                              data_axis=DP if dp > 1 else None)
    body = partial(block_shard, cfg=cfg, axis=TP, sequence_parallel=sequence_parallel)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(pspecs.params(params), pspecs.act_btd),
                       out_specs=pspecs.act_btd)
    return fn(params, x)
