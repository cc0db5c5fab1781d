"""reference.ModelConfig's decoder as a flax NNX module: the trainer's parameters with
their partition metadata, for users of NNX's own tools (nnx.split, nnx.get_partition_spec).

    model = LanguageModel(cfg, key=jax.random.key(0))
    nnx.get_partition_spec(nnx.state(model))   # = model.weight_pspecs(cfg, tp): how each weight is split
    model(tokens)                               # logits, unsharded (reference.forward)
    model.params()                              # the plain dict reference.init_params gives

A view: the trainer reads the same layout from `train.model.partition_names` and runs
plain dicts (docs/design.md, "NNX"); the pipeline's NNX stages (`pipeline.modules`) are
the lesson of running NNX modules as stages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import reference
from jaxpar.train.model import partition_names


class LanguageModel(nnx.Module):
    """reference.ModelConfig's decoder as NNX parameters with partition metadata
    (`out_sharding`: the mesh axis of each dimension, `partition_names`; flax's
    get_partition_spec reads it, and so does the trainer). The blocks stack their L
    layers on a leading axis, split over pp. tp: the KV heads are replicated when it
    exceeds n_kv_heads (the names are the same for every tp that divides them)."""

    def __init__(self, cfg: reference.ModelConfig, *, key=None, params: dict | None = None,
                 dtype=jnp.float32, tp: int = 2):
        self.cfg = cfg
        params = reference.init_params(jax.random.key(0) if key is None else key, cfg, dtype) \
            if params is None else params
        names = partition_names(cfg, tp)
        param = lambda a, n: nnx.Param(jnp.asarray(a), out_sharding=n, eager_sharding=False)
        self.embed = param(params["embed"], names["embed"])
        self.final_norm = param(params["final_norm"], names["final_norm"])
        self.unembed = param(params["unembed"], names["unembed"])
        self.blocks = nnx.Dict({k: param(a, names["blocks"][k]) for k, a in params["blocks"].items()})

    def params(self) -> dict:
        """The plain dict of arrays (reference.init_params's structure)."""
        return {"embed": self.embed[...], "final_norm": self.final_norm[...], "unembed": self.unembed[...],
                "blocks": {k: v[...] for k, v in self.blocks.items()}}

    def __call__(self, tokens):
        return reference.forward(self.params(), tokens, self.cfg)

    def loss(self, tokens):
        return reference.loss(self.params(), tokens, self.cfg)
