"""Vocabulary-parallel embedding, output layer and cross-entropy, as Megatron does
(Shoeybi et al. 2019, sec. 3).

The embedding embed[V_tp, D] and the output layer unembed[D, V_tp] are split over the
vocabulary, so each tp device holds V/t rows/columns and computes V/t of the logits. The
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
    (b = B/dp; `vocab_collectives` states these as {kind: (count, bytes)}.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import reference, tensor
from jaxpar.collectives import reduce_from_tp
from jaxpar.mesh import DP, TP


def _vocab_range(v_local: int, axis: str):
    start = jax.lax.axis_index(axis) * v_local
    return start, start + v_local


def embedding_shard(embed, tokens, *, axis: str = TP):
    """embed: [V/t, D] (this device's rows), tokens: int[B, T] (all) -> [B, T, D], invariant.

    A token outside this shard's range reads row 0 and is zeroed; g (all-reduce) adds the
    shards, exactly one of which holds each token's row.
    """
    v_local = embed.shape[0]
    start, stop = _vocab_range(v_local, axis)
    mine = (tokens >= start) & (tokens < stop)                       # [B, T]
    rows = embed[jnp.where(mine, tokens - start, 0)]                 # [B, T, D]
    return reduce_from_tp(jnp.where(mine[..., None], rows, 0), axis)


def cross_entropy_shard(logits, targets, *, axis: str = TP):
    """logits: [B, T, V/t] (this device's vocab slice), targets: int[B, T] -> mean loss.

    targets must lie in [0, V): they are traced values, so nothing checks them before the
    compute. An id >= V (or < 0) is in no shard's range: its target logit reads as the max
    and the loss comes out finite and wrong, where reference.cross_entropy gives NaN.

    loss = log sum_v exp(l_v) - l_target, with the max subtracted for stability: global
    max (pmax), global sum of exp (psum), the target's logit from the one shard that has
    it (psum). Autodiff of these gives softmax - onehot on each shard, with no collective.
    """
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


def lm_head_loss_shard(x, final_norm, unembed, targets, *, eps: float, axis: str = TP):
    """The output layer and loss on one tp shard (Megatron's parallel_lm_logits + vocab CE).

    x: [B, T, D] invariant over tp; final_norm: [D] replicated; unembed: [D, V/t] (this
    device's columns); targets: int[B, T] in [0, V) -> mean loss. The norm runs on every
    device alike; its output enters the column-parallel layer through f, whose backward
    all-reduces dL/dz (every device's V/t logits depend on all of z), so x's and the gain's
    gradients are whole. logits [B, T, V/t] stay on this device.
    """
    z = reference.rms_norm(x, final_norm, eps)                          # [B, T, D]
    (logits,) = tensor.column_parallel(z, unembed, axis=axis)            # f; [B, T, V/t]
    return cross_entropy_shard(logits, targets, axis=axis)


def _check(v: int, batch: int, mesh: Mesh) -> tuple[str | None, str | None]:
    """Validate the split; returns the (data, vocab) axis names that really split (size > 1:
    XLA keeps a collective over a group of one, so a size-1 axis is left unsplit)."""
    if TP not in mesh.shape:
        raise ValueError(f"vocabulary parallelism needs a mesh with a '{TP}' axis; got {tuple(mesh.shape)}. "
                         "Fix: jaxpar.mesh.make_mesh(tp=..., dp=...)")
    t, dp = mesh.shape[TP], mesh.shape.get(DP, 1)
    if v % t:
        raise ValueError(f"vocab V={v} is not divisible by tp={t}: each tp device holds V/tp rows. "
                         f"Fix: pad the vocabulary to a multiple of {t} (Megatron pads to 128*tp)")
    if batch % dp:
        raise ValueError(f"batch B={batch} is not divisible by dp={dp}. Fix: use a batch that is a "
                         f"multiple of {dp}")
    return (DP if dp > 1 else None), (TP if t > 1 else None)


def vocab_parallel_embedding(embed, tokens, *, mesh: Mesh):
    """embed[V_tp, D] looked up at tokens[B_dp, T] -> [B_dp, T, D]; equals embed[tokens]."""
    data, vocab = _check(embed.shape[0], tokens.shape[0], mesh)
    body = embedding_shard if vocab else (lambda embed, tokens: embed[tokens])
    return jax.shard_map(body, mesh=mesh, in_specs=(P(vocab, None), P(data)),
                         out_specs=P(data))(embed, tokens)


def vocab_parallel_cross_entropy(logits, targets, *, mesh: Mesh):
    """reference.cross_entropy(logits, targets) with logits[B_dp, T, V_tp] never gathered.
    targets: int[B_dp, T] in [0, V) (not checked: traced values; see cross_entropy_shard)."""
    data, vocab = _check(logits.shape[-1], logits.shape[0], mesh)

    def body(logits, targets):                         # logits: [B/dp, T, V/t]
        loss = cross_entropy_shard(logits, targets) if vocab else reference.cross_entropy(logits, targets)
        return jax.lax.pmean(loss, DP) if data else loss   # equal shards: mean of means

    return jax.shard_map(body, mesh=mesh, in_specs=(P(data, None, vocab), P(data)),
                         out_specs=P())(logits, targets)


def vocab_parallel_lm_loss(x, final_norm, unembed, targets, *, mesh: Mesh, cfg: reference.ModelConfig):
    """reference.cross_entropy(reference.rms_norm(x, final_norm) @ unembed, targets), with
    unembed[D, V_tp] split over tp and x[B_dp, T, D]: each device computes logits[B_dp, T, V_tp]
    and the loss from them (lm_head_loss_shard); the full logits never exist.
    targets: int[B_dp, T] in [0, V) (not checked: traced values). Returns the mean loss,
    replicated; gradients come back sharded like the inputs.
    """
    D, V = unembed.shape
    if x.ndim != 3 or x.shape[-1] != D or final_norm.shape != (D,) or targets.shape != x.shape[:2]:
        raise ValueError(f"x {tuple(x.shape)}, final_norm {tuple(final_norm.shape)}, unembed {(D, V)}, targets "
                         f"{tuple(targets.shape)}: the LM head takes x[B, T, D], final_norm[D], unembed[D, V] "
                         "and targets[B, T]. Fix: pass the last block's output and params['final_norm'], "
                         "params['unembed'] of the same model")
    data, vocab = _check(V, x.shape[0], mesh)

    def body(x, g, w, targets):                        # x: [B/dp, T, D], w: [D, V/t]
        if vocab:
            loss = lm_head_loss_shard(x, g, w, targets, eps=cfg.norm_eps)
        else:
            loss = reference.cross_entropy(reference.rms_norm(x, g, cfg.norm_eps) @ w, targets)
        return jax.lax.pmean(loss, DP) if data else loss

    return jax.shard_map(body, mesh=mesh, in_specs=(P(data), P(), P(None, vocab), P(data)),
                         out_specs=P())(x, final_norm, unembed, targets)


def tp_loss(params: dict, tokens, *, mesh: Mesh, cfg: reference.ModelConfig):
    """reference.loss(params, tokens, cfg), tensor parallel end to end: vocab-parallel
    embedding, tp_block for each layer, vocab-parallel LM head and loss. params: the whole
    model (reference.init_params); tokens: int[B_dp, T+1] in [0, V)."""
    x = vocab_parallel_embedding(params["embed"], tokens[:, :-1], mesh=mesh)        # [B, T, D]
    for i in range(cfg.n_layers):
        x = tensor.tp_block(reference.layer_params(params, i), x, mesh=mesh, cfg=cfg)
    return vocab_parallel_lm_loss(x, params["final_norm"], params["unembed"], tokens[:, 1:],
                                  mesh=mesh, cfg=cfg)


def vocab_collectives(*, batch: int, seq: int, d_model: int, vocab: int, dtype, tp: int, dp: int = 1,
                      what: str, backward: bool = False) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} of the compiled forward program (backward=False) or of the
    backward one alone (jit of the function jax.vjp returns) of `what` = "cross_entropy",
    "embedding" or "lm_loss" (vocab_parallel_lm_loss), as comms.nonzero reports them.
    b = batch/dp."""
    item = jnp.dtype(dtype).itemsize
    b = batch // dp
    ops: list[tuple[int, int]] = []          # (count, bytes) of all-reduces
    if what not in ("cross_entropy", "embedding", "lm_loss"):
        raise ValueError(f"what={what!r}: use 'cross_entropy', 'embedding' or 'lm_loss'")
    if what in ("cross_entropy", "lm_loss") and not backward:
        if tp > 1:
            ops += [(1, b * seq * item), (1, 2 * b * seq * item)]   # max; sum exp + target logit
        if dp > 1:
            ops.append((1, item))                                   # mean of the loss over dp
    # The cross-entropy's backward is local (softmax - onehot); the LM head's is not:
    if what == "lm_loss" and backward:
        if tp > 1:
            ops.append((1, b * seq * d_model * item))               # f: dL/dz summed over tp
        if dp > 1:
            ops.append((1, (vocab // tp + 1) * d_model * item))     # dL/dunembed, dL/dfinal_norm over dp
    if what == "embedding":
        if tp > 1 and not backward:
            ops.append((1, b * seq * d_model * item))               # g: the rows of every shard
        if dp > 1 and backward:
            ops.append((1, vocab // tp * d_model * item))           # dL/dembed summed over dp
    if not ops:
        return {}
    return {"all-reduce": (sum(c for c, _ in ops), sum(n for _, n in ops))}
