"""The language model the trainer runs: `reference.ModelConfig`'s parameters (the plain
dict of reference.init_params), how each is split, and the per-shard functions that run
it on a ParallelSpec.

    partition_names(cfg, tp=2)   every weight's dimension names (the mesh axis of each)
    weight_pspecs(cfg, tp=2)   the same as PartitionSpecs: what the trainer lays out
    split(params), join(tree)    the stages' parts: blocks, first (embedding), last (head)

The same parameters as a flax NNX module with this partition metadata are
`nnx_model.LanguageModel`, a view for NNX users: the trainer does not go through it
(docs/design.md, "NNX").

Under ZeRO-3 (spec.zero == 3) each weight is stored as its dp-th along `zero3_dims`'s
dimension. What each shard runs (the block, the embedding, the head) is composed by
`recipe.py`; `keep_dots` is recompute="dots"'s policy, `to_layout` the tokens' order.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.context import zigzag
from jaxpar.context.ring import KV_NAME
from jaxpar.data import zero
from jaxpar.mesh import DP, EP, PP
from jaxpar.tensor.block import TPSpecs
from jaxpar.tensor.formulas import block_param_shapes
from jaxpar.tensor.vocab import VocabSpecs
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
    (`weight_pspecs`), and the metadata of the NNX view (`nnx_model.LanguageModel`).
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
def weight_pspecs(cfg: reference.ModelConfig, tp: int = 2) -> dict:
    """Every weight's PartitionSpec (`partition_names` as pspecs), in reference.init_params's
    structure. Shared: do not mutate."""
    return jax.tree.map(lambda names: P(*names), partition_names(cfg, tp), is_leaf=lambda x: isinstance(x, tuple))


def stage_pspecs(cfg: reference.ModelConfig, spec: ParallelSpec) -> tuple[dict, dict, dict]:
    """(one layer's PartitionSpecs over the non-pp axes, the first stage's pspecs, the last
    stage's pspecs) for the trainer on `spec`: the model's metadata (`weight_pspecs`)
    split by stage, the layers' pp dimension dropped, axes of one device left out."""
    sizes = spec.sizes
    keep = lambda names: P(*(n if n is not None and sizes.get(n, 1) > 1 else None for n in names))
    parts = split(weight_pspecs(cfg, spec.tp))
    return ({k: keep(tuple(s)[1:]) for k, s in parts["blocks"].items()},
            {k: keep(s) for k, s in parts["first"].items()}, {k: keep(s) for k, s in parts["last"].items()})


@functools.cache
def zero3_dims(cfg: reference.ModelConfig, spec: ParallelSpec) -> dict:
    """{"blocks": {name: dimension of one layer's weight}, "first": {...}, "last": {...}}:
    the dimension ZeRO-3 stores each weight split along over dp (`data.zero.plan` of its
    local shard under `stage_pspecs`; -1: whole). All -1 unless spec.zero == 3. The router
    bias stays whole: the bias rule moves it from the whole load, not AdamW from a gradient;
    so does every vector (a norm's gain).
    The trainer's state lays the blocks out [pp, chunks, Lc, ...]: there a dimension is 3 more."""
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


def to_layout(tokens, spec: ParallelSpec):
    """(inputs, targets) int[B, T] from tokens int[B, T+1], in the ring's token order."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if spec.cp > 1 and spec.layout != "contiguous":
        inputs, targets = (zigzag.to_layout(a, spec.cp, spec.layout, axis=1) for a in (inputs, targets))
    return inputs, targets

