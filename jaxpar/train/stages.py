"""The reference model as per-shard pipeline stages over a dp x pp x tp mesh.

`pipeline.runtime` runs inside one shard_map over every axis and knows nothing of tp:
each stage is `tensor.layers.block_shard` over tp (Megatron's f and g inside), the first
stage's function is the vocab-parallel embedding of the token ids, and the last stage's
loss is the LM head and the vocab-parallel cross-entropy, each with its own parameters
and gradients, as Megatron places them. `pspecs` says how every parameter is split over
tp; the runtime sums the gradients over dp once, at the end.

    loss, grads = pp_tp_loss(params, tokens, mesh=mesh, cfg=cfg, schedule=s)
    grads   # d loss / d params, the structure of reference.init_params: reference.loss's
"""

from __future__ import annotations

import functools

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.mesh import PP, TP, axis_size, require_mesh
from jaxpar.pipeline import runtime
from jaxpar.schedules.schedule import Schedule
from jaxpar.tensor.block import TPSpecs, validate_tp
from jaxpar.tensor.formulas import block_param_shapes
from jaxpar.tensor.layers import block_shard
from jaxpar.tensor.vocab import VocabSpecs, embedding_shard, lm_head_loss_shard
from jaxpar.train.model import split


def embed(first: dict, tokens):
    """First stage: token ids int[mb, T] -> activations [mb, T, D] (vocab-parallel)."""
    return embedding_shard(first["embed"], tokens, axis=TP)


def _head_loss(last: dict, y, targets, *, eps: float):
    return lm_head_loss_shard(y, last["final_norm"], last["unembed"], targets, eps=eps, axis=TP)


@functools.cache
def stage_fns(cfg: reference.ModelConfig):
    """(stage_fn, first_fn, loss_fn) for `cfg`: one object each per config, so that
    runtime.run's cache finds them again."""
    stage = runtime.layers(functools.partial(block_shard, cfg=cfg, axis=TP))
    return stage, embed, functools.partial(_head_loss, eps=cfg.norm_eps)


def pspecs(cfg: reference.ModelConfig, mesh) -> tuple[dict, dict, dict]:
    """(the pspecs of one block, of the first stage's params, of the last stage's):
    Megatron's layout over tp (the tensor package's TPSpecs and VocabSpecs)."""
    tp = axis_size(mesh, TP)
    vocab = VocabSpecs.megatron(tp=tp)
    block = TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=tp).params(block_param_shapes(cfg))
    return block, {"embed": vocab.embed_vd}, {"final_norm": vocab.final_norm_d, "unembed": vocab.unembed_dv}


def arguments(params: dict, tokens, *, mesh, cfg: reference.ModelConfig) -> tuple:
    """(stage_fn, blocks, batch, keyword arguments) of runtime.run / runtime.pipeline for
    reference.loss(params, tokens, cfg) over `mesh`, checked first. tokens: int[B, T+1]."""
    if not isinstance(cfg, reference.ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig")
    if not isinstance(params, dict) or not {"embed", "blocks", "final_norm", "unembed"} <= set(params):
        raise ConfigError("params must be the whole model, reference.init_params(key, cfg): a dict with embed, "
                          "blocks, final_norm and unembed")
    require_mesh(mesh, axes=(PP, TP), needed_by="pp_tp_loss")
    shape = errors.array("tokens", tokens, ndim=2, kinds="iu", shape_doc="tokens[batch, seq + 1] of token ids")
    if shape[1] < 2:
        raise ConfigError(f"tokens has shape {shape}: next-token prediction needs at least 2 positions per row")
    validate_tp(cfg, axis_size(mesh, TP))
    errors.divisible("vocab", cfg.vocab, "tp", axis_size(mesh, TP), why="each tp device holds vocab/tp rows of the "
                     "embedding and columns of the LM head", fix="a vocabulary padded to a multiple of tp")
    stage, first_fn, loss_fn = stage_fns(cfg)
    param_pspecs, first_pspecs, last_pspecs = pspecs(cfg, mesh)
    parts = split(params)
    blocks, first, last = parts["blocks"], parts["first"], parts["last"]
    return stage, blocks, (tokens[:, :-1], tokens[:, 1:]), dict(
        mesh=mesh, loss_fn=loss_fn, param_pspecs=param_pspecs, first_fn=first_fn, first_params=first,
        first_pspecs=first_pspecs, last_params=last, last_pspecs=last_pspecs)


def pp_tp_loss(params: dict, tokens, *, mesh, cfg: reference.ModelConfig, schedule: Schedule):
    """reference.loss(params, tokens, cfg) and its gradient, pipelined over pp with
    tensor-parallel stages over tp and data parallelism over dp. tokens: int[B, T+1]."""
    stage, blocks, batch, kwargs = arguments(params, tokens, mesh=mesh, cfg=cfg)
    loss, grads = runtime.run(schedule, stage, blocks, batch, **kwargs)
    return loss, dict(blocks=grads.params, **grads.first, **grads.last)
