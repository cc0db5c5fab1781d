"""The language model the trainer runs: `reference.ModelConfig`'s parameters (the plain
dict of reference.init_params), how each is split, and the per-shard functions that run
it on a ParallelSpec.

    partition_names(cfg, tp=2)   every weight's dimension names (the mesh axis of each)
    partition_specs(cfg, tp=2)   the same as PartitionSpecs: what the trainer lays out
    split(params), join(tree)    the stages' parts: blocks, first (embedding), last (head)

The same parameters as a flax NNX module with this partition metadata are
`nnx_model.LanguageModel`, a view for NNX users: the trainer does not go through it
(docs/design.md, "NNX").

Per shard (inside the step's one shard_map; `shard_fns(cfg, spec, seq_len)`):
  block   `tensor.layers.block_shard` over tp (Megatron, SP when asked), its attention
          ring or Ulysses attention over cp, rotary embedding at this cp rank's
          positions (zigzag aware), its MLP either Megatron's or the MoE: the tokens
          enter the tp region (f, or the SP all-gather), `expert.dispatch.ep_moe_shard`
          sends them over ep to experts whose FFN is split over tp, and g (or the SP
          reduce-scatter) sums the tp partial outputs; its load balancing (the balance
          loss's gradient, the statistics for the bias) is `balance.moe_balance`;
  embed   the vocab-parallel embedding (first stage);
  head    the final norm, LM head and vocab-parallel cross-entropy (last stage).
Under ZeRO-3 (spec.zero == 3) each of the three holds its weights as their dp-th
(`zero3_dims`: the dimension of each) and gathers them over dp on entry
(`data.zero.gathered`: re-gathered in the backward, the gradient reduce-scattered).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.context import zigzag
from jaxpar.context.ring import KV_NAME, ring_attention_shard
from jaxpar.context.ulysses import ulysses_attention_shard
from jaxpar.data import zero
from jaxpar.errors import ConfigError
from jaxpar.kernels.attention import attention as attention_kernel
from jaxpar.expert.dispatch import MoEOptions, ep_moe_shard
from jaxpar.expert.router import route
from jaxpar.mesh import CP, DP, EP, PP, TP
from jaxpar.pipeline import runtime
from jaxpar.tensor.block import TPSpecs
from jaxpar.tensor.formulas import block_param_shapes
from jaxpar.tensor.layers import block_shard
from jaxpar.tensor.ops import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from jaxpar.tensor.vocab import VocabSpecs, embedding_shard, lm_head_loss_shard
from jaxpar.train import balance
from jaxpar.train.spec import ParallelSpec


def split(tree: dict) -> dict:
    """reference.init_params's structure (params, their gradients or pspecs) -> {"blocks",
    "first": {"embed"}, "last": {"final_norm", "unembed"}}: what the pipeline's stages
    own, the first stage the embedding, the last the LM head (blocks still [L, ...])."""
    return {"blocks": tree["blocks"], "first": {"embed": tree["embed"]},
            "last": {"final_norm": tree["final_norm"], "unembed": tree["unembed"]}}


def join(tree: dict) -> dict:
    """`split`'s inverse."""
    return {"embed": tree["first"]["embed"], "blocks": tree["blocks"], **tree["last"]}


def _names(pspec: P, ndim: int) -> tuple:
    """A PartitionSpec's entries, one per dimension of an ndim array (None: not split)."""
    return tuple(pspec) + (None,) * (ndim - len(pspec))


def partition_names(cfg: reference.ModelConfig, tp: int = 2) -> dict:
    """Every weight's dimension names, the mesh axis each dimension is split over (None:
    not split), in reference.init_params's structure: the trainer's pspecs
    (`partition_specs`), and the metadata of the NNX view (`nnx_model.LanguageModel`).
    Megatron's layout over tp is the tensor package's (`TPSpecs.named`: the KV
    heads replicated when tp > K; `VocabSpecs`); on top of it the L layers are stacked
    over pp and an MoE's experts split over ep, each expert's FFN over tp as the dense
    MLP's, its router (and selection bias) replicated."""
    shapes = block_param_shapes(cfg)                  # one dense block's; the MoE adds E first
    layer = {k: _names(s, len(shapes[k])) for k, s in TPSpecs.named(n_kv_heads=cfg.n_kv_heads, tp=tp).params(
        shapes).items()}
    if cfg.n_experts:
        layer |= {k: (EP, *v) for k, v in layer.items() if k in ("w_up", "w_gate", "w_down")}
        layer["router"] = (None, None)
        if cfg.router_bias:
            layer["router_bias"] = (None,)
    vocab = VocabSpecs()
    return {"embed": _names(vocab.embed_vd, 2), "final_norm": _names(vocab.final_norm_d, 1),
            "unembed": _names(vocab.unembed_dv, 2), "blocks": {k: (PP, *v) for k, v in layer.items()}}


@functools.cache
def partition_specs(cfg: reference.ModelConfig, tp: int = 2) -> dict:
    """Every weight's PartitionSpec (`partition_names` as pspecs), in reference.init_params's
    structure. Shared: do not mutate."""
    return jax.tree.map(lambda names: P(*names), partition_names(cfg, tp), is_leaf=lambda x: isinstance(x, tuple))


def stage_pspecs(cfg: reference.ModelConfig, spec: ParallelSpec) -> tuple[dict, dict, dict]:
    """(one layer's PartitionSpecs over the non-pp axes, the first stage's pspecs, the last
    stage's pspecs) for the trainer on `spec`: the model's metadata (`partition_specs`)
    split by stage, the layers' pp dimension dropped, axes of one device left out."""
    sizes = spec.sizes
    keep = lambda names: P(*(n if n is not None and sizes.get(n, 1) > 1 else None for n in names))
    parts = split(partition_specs(cfg, spec.tp))
    return ({k: keep(tuple(s)[1:]) for k, s in parts["blocks"].items()},
            {k: keep(s) for k, s in parts["first"].items()}, {k: keep(s) for k, s in parts["last"].items()})


@functools.cache
def zero3_dims(cfg: reference.ModelConfig, spec: ParallelSpec) -> dict:
    """{"blocks": {name: dimension of one layer's weight}, "first": {...}, "last": {...}}:
    the dimension ZeRO-3 stores each weight split along over dp (`data.zero.plan` of its
    local shard under `stage_pspecs`; -1: whole). All -1 unless spec.zero == 3. The router
    bias stays whole: the bias rule moves it from the whole load, not AdamW from a gradient;
    so does every vector (a norm's gain).
    The trainer's state lays the blocks out [pp, v, Lc, ...]: there a dimension is 3 more."""
    shapes = split(jax.eval_shape(lambda: reference.init_params(jax.random.key(0), cfg)))
    layer = {k: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for k, a in shapes["blocks"].items()}
    layer_pspecs, first_pspecs, last_pspecs = stage_pspecs(cfg, spec)
    sizes = spec.sizes if spec.zero == 3 else {**spec.sizes, DP: 1}
    # the first dimension dp divides: the weights come out of the flat gathered buffer
    # without a transpose (`zero.gathered(fuse=True)`), as FSDP shards a flat parameter
    plan = functools.partial(zero.plan, sizes=sizes, first=True)
    dims = {"blocks": plan(layer, layer_pspecs), "first": plan(shapes["first"], first_pspecs),
            "last": plan(shapes["last"], last_pspecs)}
    # a vector stays whole. A norm's gain (d_model numbers), as DeepSpeed's ZeRO-3 keeps a
    # parameter below its persistence threshold: its dp-th saves d_model/dp numbers a
    # layer, and gathering it would cost one more all-gather and reduce-scatter each, a
    # rendezvous of every dp device. The router bias [E], which the bias rule moves from
    # the whole load, not AdamW from a gradient
    for part, leaves in (("blocks", layer), ("first", shapes["first"]), ("last", shapes["last"])):
        for name, a in leaves.items():
            if len(a.shape) == 1:
                dims[part][name] = -1
    return dims


# ---- per shard ------------------------------------------------------------------------------

def _positions(seq_len: int, spec: ParallelSpec):
    """int[T/cp]: the positions of this cp rank's tokens (in the ring's layout)."""
    local = seq_len // spec.cp
    if spec.cp == 1:
        return jnp.arange(local)
    if spec.layout == "contiguous":      # (a contiguous sequence need not cut into 2 cp halves)
        return jax.lax.axis_index(CP) * local + jnp.arange(local)
    table = jnp.asarray(zigzag.positions(seq_len, spec.cp, spec.layout).reshape(spec.cp, local), jnp.int32)
    return jax.lax.dynamic_index_in_dim(table, jax.lax.axis_index(CP), 0, keepdims=False)


def _attend(cfg: reference.ModelConfig, spec: ParallelSpec, kernel: str):
    """attend(q, k, v) of this shard's heads: the whole sequence at cp = 1 (through
    `kernel`, kernels.attention), else ring or Ulysses attention over cp (Ulysses' whole
    sequence per device through `kernel` too; the ring's blocks blockwise in XLA)."""
    if spec.cp == 1:
        return lambda q, k, v: attention_kernel(q, k, v, causal=cfg.causal, implementation=kernel)
    if spec.attention == "ulysses":
        return lambda q, k, v: ulysses_attention_shard(q, k, v, axis=CP, causal=cfg.causal, layout=spec.layout,
                                                       kernel=kernel)
    hop = "all_to_all" if spec.pp > 1 else "ppermute"     # inside a stage: collectives.ring_shift
    return lambda q, k, v: ring_attention_shard(q, k, v, axis=CP, causal=cfg.causal, layout=spec.layout, hop=hop)


def _moe(p, z, *, cfg: reference.ModelConfig, spec: ParallelSpec, seq_len: int, batch_size: int | None):
    """The MoE on this device's tokens z [mb, T', D]: experts over ep, their FFN over tp."""
    sp = spec.sequence_parallel
    zg = gather_from_sp(z, TP, 1) if sp else copy_to_tp(z, TP)                    # [mb, Tc, D]
    B, T, D = zg.shape
    experts = {k: p[k] for k in ("router", "w_up", "w_gate", "w_down") if k in p}
    x = zg.reshape(B * T, D)
    r = route(p["router"], x, top_k=cfg.top_k, scoring=cfg.router, renormalize=cfg.moe_renormalize,
              bias=p.get("router_bias"))
    y, _, _ = ep_moe_shard(experts, x, axis=EP if spec.ep > 1 else None, options=MoEOptions.of(cfg), routing=r)
    if balance.enabled(cfg):
        y = balance.moe_balance(y, p, r, cfg=cfg, sizes=spec.sizes, sequences=B, seq_len=seq_len,
                                batch_size=batch_size)
    y = y.reshape(B, T, D)                                                         # partial sums over tp
    return reduce_scatter_to_sp(y, TP, 1) if sp else reduce_from_tp(y, TP)


def _block(p, x, *, cfg: reference.ModelConfig, spec: ParallelSpec, seq_len: int, batch_size: int | None,
           kernel: str):
    ffn = functools.partial(_moe, cfg=cfg, spec=spec, seq_len=seq_len, batch_size=batch_size) \
        if cfg.n_experts else None
    return block_shard(p, x, cfg=cfg, axis=TP, sequence_parallel=spec.sequence_parallel,
                       positions=_positions(seq_len, spec), attend=_attend(cfg, spec, kernel), ffn=ffn)


def _embed(first: dict, tokens, *, sp: bool):
    return embedding_shard(first["embed"], tokens, axis=TP, sequence_parallel=sp)


def _head(last: dict, y, targets, *, eps: float, sp: bool):
    return lm_head_loss_shard(y, last["final_norm"], last["unembed"], targets, eps=eps, axis=TP,
                              sequence_parallel=sp)


# what recompute="dots" keeps; a collective's output is kept, so B runs none again
_KEPT = ("psum", "all_gather", "reduce_scatter", "all_to_all", "ragged_all_to_all", "ppermute", "custom_vjp_call")


def keep_dots(prim, *_, **params) -> bool:
    """The jax.checkpoint policy of recompute="dots": keep the output of a matmul without
    batch dimensions (the projections, the MLP's and the experts' matrices: the outputs
    MaxText's remat_policy=minimal keeps by name; JAX's checkpoint_dots_with_no_batch_dims),
    of a collective and of a custom-vjp function (ring attention, whose forward sends K/V
    round the ring);
    recompute the rest in B: the norms, rotary embedding, attention scores and softmax, the
    activation function. F then stores about half the bytes, and B's recompute is
    elementwise work and attention's two batched matmuls."""
    if prim.name == "dot_general":
        (_, _), (lhs_batch, rhs_batch) = params["dimension_numbers"]
        return not lhs_batch and not rhs_batch
    if prim.name == "name":
        return params["name"] == KV_NAME
    return prim.name.startswith(_KEPT)


@functools.cache
def shard_fns(cfg: reference.ModelConfig, spec: ParallelSpec, seq_len: int, batch_size: int | None = None,
              kernel: str = "xla"):
    """(stage_fn, first_fn, loss_fn) per shard, one object each per (cfg, spec, seq_len,
    batch_size, kernel). batch_size (sequences per step, all devices): the balance loss's
    weight per sequence is aux_loss / batch_size; needed when cfg.aux_loss > 0. kernel:
    the attention implementation that runs, "xla" or "cudnn" (kernels.attention.choose)."""
    if cfg.n_experts and cfg.aux_loss and batch_size is None:
        raise ConfigError(f"aux_loss={cfg.aux_loss}: the balance loss is a mean over the step's sequences; "
                          "give shard_fns(..., batch_size=) (sequences per step)")
    # ZeRO-3: each function gathers its weights over dp on entry, and again in its backward
    dims = zero3_dims(cfg, spec)
    block = functools.partial(_block, cfg=cfg, spec=spec, seq_len=seq_len, batch_size=batch_size, kernel=kernel)
    if spec.recompute == "dots":     # inside the ZeRO-3 gather: its backward gathers the weights again
        block = jax.checkpoint(block, policy=keep_dots)
    # one flat all-gather per function (per dtype and type), FSDP's flat parameter: a
    # layer's weights in one collective, not one each
    stage = runtime.layers(zero.gathered(block, dims["blocks"], fuse=True))
    sp = spec.sequence_parallel
    return (stage, zero.gathered(functools.partial(_embed, sp=sp), dims["first"], fuse=True),
            zero.gathered(functools.partial(_head, eps=cfg.norm_eps, sp=sp), dims["last"], fuse=True))


def to_layout(tokens, spec: ParallelSpec):
    """(inputs, targets) int[B, T] from tokens int[B, T+1], in the ring's token order."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if spec.cp > 1 and spec.layout != "contiguous":
        inputs, targets = (zigzag.to_layout(a, spec.cp, spec.layout, axis=1) for a in (inputs, targets))
    return inputs, targets

