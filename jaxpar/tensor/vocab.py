"""Vocabulary-parallel embedding, output layer and cross-entropy, as Megatron does
(Shoeybi et al. 2019, sec. 3).

The embedding embed[V_tp, D] and the output layer unembed[D, V_tp] are split over the
vocabulary (`VocabSpecs`), so each tp device holds V/t rows/columns and computes V/t of
the logits. The
full logits [B, T, V] never exist anywhere: the cross-entropy needs, per token, only the
max, the sum of exponentials and the target's logit, three [B, T] reductions over tp.
`tp_loss` composes embedding -> tp_block per layer -> LM head + loss: reference.loss,
tensor parallel end to end.

    vocab_parallel_embedding   out[B_dp, T, D] = psum_tp(rows of this shard, zeros elsewhere)
                               fwd: 1 all-reduce of b*T*D over tp (g); bwd: none over tp
                               (scatter-add locally), and with dp > 1 the all-reduce over dp
                               of this device's embedding gradient, V/t*D (data parallelism)
    vocab_parallel_cross_entropy  logits[B_dp, T, V_tp] -> mean loss
                               fwd: all-reduces of [b, T] over tp: the max (its own, a max
                               does not combine with sums) and the sum of exp with the
                               target's logit (XLA combines the two sums): 2 ops, 3*b*T
                               elements; with dp > 1 the mean over dp, 1 scalar.
                               bwd: none: dL/dlogits = (softmax - onehot)/n, computed locally
    vocab_parallel_lm_loss     x[B_dp, T, D] -> rms_norm -> f -> @ unembed[D, V_tp] -> the loss
                               above; logits[B_dp, T, V_tp] per device (Megatron's
                               parallel_lm_logits). fwd: the loss's all-reduces only (f is
                               the identity); bwd: f's all-reduce of dL/dz over tp, b*T*D,
                               and with dp > 1 the all-reduce over dp of this device's
                               unembed and final_norm gradients, (V/t + 1)*D
    (b = B/dp; `formulas.embedding_collectives`, `cross_entropy_collectives` and
    `lm_loss_collectives` state these as Collectives.)

Token ids and targets must lie in [0, V). They are checked when they are concrete arrays
(numpy, or jax arrays outside jit); under jit they are traced and cannot be: an id >= V
(or < 0) is in no shard's range, so the embedding returns a zero vector where
reference's `embed[tokens]` clamps to the nearest row, and the cross-entropy reads the
target's logit as the max, finite and wrong, where reference.cross_entropy gives NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, TP, axis_size, require_mesh
from jaxpar.tensor.block import tp_block, validate_batch, without_axis
from jaxpar.tensor.layers import column_parallel
from jaxpar.tensor.ops import copy_to_tp, reduce_from_tp, reduce_scatter_to_sp


@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabSpecs:
    """Megatron's vocabulary-parallel layout, in one place (names end in the dimension
    letters): the embedding's rows and the LM head's columns split over tp, V/tp of the
    vocabulary per device; the final norm's gain replicated. The defaults ARE the layout;
    `megatron(tp=)` on a mesh."""

    embed_vd: P = P(TP, None)
    final_norm_d: P = P()
    unembed_dv: P = P(None, TP)

    @classmethod
    def megatron(cls, *, tp: int) -> "VocabSpecs":
        """The layout on `tp` devices; with tp = 1 nothing is split (XLA would keep
        collectives over a size-1 axis)."""
        errors.whole("tp", tp)
        return cls() if tp > 1 else without_axis(cls(), TP)


def _vocab_range(v_local: int, axis: str):
    start = jax.lax.axis_index(axis) * v_local
    return start, start + v_local


def embedding_shard(embed, tokens, *, axis: str = TP, sequence_parallel: bool = False):
    """embed: [V/t, D] (this device's rows), tokens: int[B, T] (all) -> [B, T, D], invariant
    (sequence_parallel: [B, T/t, D], this device's tokens, by a reduce-scatter along T).

    A token outside this shard's range reads row 0 and is zeroed; g (all-reduce) adds the
    shards, exactly one of which holds each token's row.
    """
    v_local = embed.shape[0]
    start, stop = _vocab_range(v_local, axis)
    mine = (tokens >= start) & (tokens < stop)                       # [B, T]
    rows = jnp.where(mine[..., None], embed[jnp.where(mine, tokens - start, 0)], 0)   # [B, T, D]
    return reduce_scatter_to_sp(rows, axis, 1) if sequence_parallel else reduce_from_tp(rows, axis)


def cross_entropy_shard(logits, targets, *, axis: str = TP):
    """logits: [B, T, V/t] (this device's vocab slice), targets: int[B, T] -> mean loss.

    targets must lie in [0, V) (see the module docstring for what happens otherwise).

    loss = log sum_v exp(l_v) - l_target, with the max subtracted for stability: global
    max (pmax), global sum of exp (psum), the target's logit from the one shard that has
    it (psum). Autodiff of these gives softmax - onehot on each shard, with no collective.
    bf16 logits (mixed precision) are cast to float32 first: the max, the sum of exp, the
    target's logit and the loss are float32, and so are the all-reduces over tp.
    """
    stats = reference.statistics_dtype(logits.dtype)
    if stats != logits.dtype:
        logits = logits.astype(stats)
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


def lm_head_loss_shard(x, final_norm, unembed, targets, *, eps: float, axis: str = TP,
                       sequence_parallel: bool = False):
    """The output layer and loss on one tp shard (Megatron's parallel_lm_logits + vocab CE).

    x: [B, T, D] invariant over tp; final_norm: [D] replicated; unembed: [D, V/t] (this
    device's columns); targets: int[B, T] in [0, V) -> mean loss. The norm runs on every
    device alike; its output enters the column-parallel layer through f, whose backward
    all-reduces dL/dz (every device's V/t logits depend on all of z), so x's and the gain's
    gradients are whole. logits [B, T, V/t] stay on this device.
    Sequence parallel: x [B, T/t, D] (this device's tokens), the norm on them (its gain
    through f: exercise 5c), then the all-gather along T into the column-parallel layer.
    """
    if sequence_parallel:
        final_norm = copy_to_tp(final_norm, axis)
    z = reference.rms_norm(x, final_norm, eps)                          # [B, T(/t), D]
    (logits,) = column_parallel(z, unembed, axis=axis, sequence_parallel=sequence_parallel)  # [B, T, V/t]
    return cross_entropy_shard(logits, targets, axis=axis)


def _split(v: int, batch_size: int, mesh: Mesh, needed_by: str) -> tuple[str | None, str | None]:
    """Refuse a split the mesh cannot make; return the (data, vocab) axis names that really
    split (size > 1: XLA keeps a collective over a group of one, so a size-1 axis is left unsplit)."""
    require_mesh(mesh, axes=(TP,), needed_by=needed_by)
    t, dp = axis_size(mesh, TP), axis_size(mesh, DP)
    if v % t:
        raise ConfigError(f"vocab V={v} is not divisible by tp={t}: each tp device holds V/tp rows. "
                          f"Fix: pad the vocabulary to a multiple of {t} (Megatron pads to 128*tp)")
    validate_batch(batch_size, mesh)
    return (DP if dp > 1 else None), (TP if t > 1 else None)


def _ids(name: str, ids, vocab: int, shape: tuple[int, ...] | None = None) -> None:
    """Refuse token ids that are not an int[B, T] array (of `shape`, when given), or, when
    they are concrete (not traced), that fall outside [0, vocab)."""
    got = errors.array(name, ids, ndim=2, kinds="iu", shape_doc=f"{name}[batch, seq] of token ids")
    if shape is not None and got != shape:
        raise ConfigError(f"{name} has shape {got}, the logits give [B, T] = {list(shape)}: one target per "
                          "position. Fix: pass the targets of these logits")
    errors.ids_below(name, ids, vocab, of=f"vocab={vocab}", fix="every id must name a row of the vocabulary. "
                     "Fix: map them into range, or grow the vocabulary")


def vocab_parallel_embedding(embed, tokens, *, mesh: Mesh):
    """embed[V_tp, D] looked up at tokens[B_dp, T] -> [B_dp, T, D]; equals embed[tokens]."""
    shape = errors.array("embed", embed, ndim=2, kinds="f", shape_doc="embed[vocab, d_model]")
    _ids("tokens", tokens, shape[0])
    data, vocab = _split(shape[0], tokens.shape[0], mesh, "the vocabulary-parallel embedding")
    body = embedding_shard if vocab else (lambda embed, tokens: embed[tokens])
    layout = VocabSpecs.megatron(tp=axis_size(mesh, TP))
    return jax.shard_map(body, mesh=mesh, in_specs=(layout.embed_vd, P(data)),
                         out_specs=P(data))(embed, tokens)


def vocab_parallel_cross_entropy(logits, targets, *, mesh: Mesh):
    """reference.cross_entropy(logits, targets) with logits[B_dp, T, V_tp] never gathered.
    targets: int[B_dp, T] in [0, V) (checked when concrete; see the module docstring)."""
    shape = errors.array("logits", logits, ndim=3, kinds="f", shape_doc="logits[batch, seq, vocab]")
    _ids("targets", targets, shape[-1], shape[:2])
    data, vocab = _split(shape[-1], shape[0], mesh, "the vocabulary-parallel cross-entropy")

    def body(logits, targets):                         # logits: [B/dp, T, V/t]
        loss = cross_entropy_shard(logits, targets) if vocab else reference.cross_entropy(logits, targets)
        return jax.lax.pmean(loss, DP) if data else loss   # equal shards: mean of means

    return jax.shard_map(body, mesh=mesh, in_specs=(P(data, None, vocab), P(data)),
                         out_specs=P())(logits, targets)


def vocab_parallel_lm_loss(x, final_norm, unembed, targets, *, mesh: Mesh, cfg: reference.ModelConfig):
    """reference.cross_entropy(reference.rms_norm(x, final_norm) @ unembed, targets), with
    unembed[D, V_tp] split over tp and x[B_dp, T, D]: each device computes logits[B_dp, T, V_tp]
    and the loss from them (lm_head_loss_shard); the full logits never exist.
    targets: int[B_dp, T] in [0, V) (checked when concrete). Returns the mean loss,
    replicated; gradients come back sharded like the inputs.
    """
    if not isinstance(cfg, reference.ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig (the LM head reads norm_eps)")
    D, V = errors.array("unembed", unembed, ndim=2, kinds="f", shape_doc="unembed[d_model, vocab]")
    xs = errors.array("x", x, kinds="f", shape_doc="x[batch, seq, d_model]")
    gs = errors.array("final_norm", final_norm, kinds="f", shape_doc="final_norm[d_model]")
    ts = errors.array("targets", targets, shape_doc="targets[batch, seq]")
    if len(xs) != 3 or xs[-1] != D or gs != (D,) or ts != xs[:2]:
        raise ConfigError(f"x {xs}, final_norm {gs}, unembed {(D, V)}, targets {ts}: the LM head takes x[B, T, D], "
                          "final_norm[D], unembed[D, V] and targets[B, T]. Fix: pass the last block's output and "
                          "params['final_norm'], params['unembed'] of the same model")
    _ids("targets", targets, V)
    data, vocab = _split(V, xs[0], mesh, "the vocabulary-parallel LM head")

    def body(x, g, w, targets):                        # x: [B/dp, T, D], w: [D, V/t]
        if vocab:
            loss = lm_head_loss_shard(x, g, w, targets, eps=cfg.norm_eps)
        else:
            loss = reference.cross_entropy(reference.rms_norm(x, g, cfg.norm_eps) @ w, targets)
        return jax.lax.pmean(loss, DP) if data else loss

    layout = VocabSpecs.megatron(tp=axis_size(mesh, TP))
    return jax.shard_map(body, mesh=mesh, in_specs=(P(data), layout.final_norm_d, layout.unembed_dv, P(data)),
                         out_specs=P())(x, final_norm, unembed, targets)


def tp_loss(params: dict, tokens, *, mesh: Mesh, cfg: reference.ModelConfig):
    """reference.loss(params, tokens, cfg), tensor parallel end to end: vocab-parallel
    embedding, tp_block for each layer, vocab-parallel LM head and loss. params: the whole
    model (reference.init_params); tokens: int[B_dp, T+1] in [0, V)."""
    if not isinstance(cfg, reference.ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig")
    if not isinstance(params, dict) or not {"embed", "blocks", "final_norm", "unembed"} <= set(params):
        raise ConfigError("params must be the whole model, reference.init_params(key, cfg): a dict with embed, "
                          "blocks, final_norm and unembed")
    shape = errors.array("tokens", tokens, ndim=2, kinds="iu", shape_doc="tokens[batch, seq + 1] of token ids")
    if shape[1] < 2:
        raise ConfigError(f"tokens has shape {shape}: next-token prediction needs at least 2 positions per row "
                          "(position t predicts token t+1)")
    x = vocab_parallel_embedding(params["embed"], tokens[:, :-1], mesh=mesh)        # [B, T, D]
    for i in range(cfg.n_layers):
        x = tp_block(reference.layer_params(params, i), x, mesh=mesh, cfg=cfg)
    return vocab_parallel_lm_loss(x, params["final_norm"], params["unembed"], tokens[:, 1:],
                                  mesh=mesh, cfg=cfg)
