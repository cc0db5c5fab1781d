"""A pipeline stage from a flax NNX module: the way a JAX user brings a model.

    blocks = [MyBlock(d, rngs=nnx.Rngs(i)) for i in range(L)]      # one per layer
    stage_fn, params = modules.nnx_layers(blocks)
    loss, grads = runtime.run(s, stage_fn, params, batch, mesh=m)
    grads.params      # an nnx.State of the blocks' Params, stacked on a leading layer axis

`nnx_layers` splits each module (`nnx.split(module, nnx.Param, ...)`): the graph, which
must be the same for every layer, becomes the per-layer function `nnx.merge(graph,
params, rest)(x)`, and the Params of the L modules are stacked into one nnx.State whose
leaves have the layer axis first, as `runtime.run` takes them. `unstack` gives each
layer's State back (`nnx.update(block, state)` writes it into a module).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.pipeline import stage
from jaxpar.pipeline.stage import layers


class _Layer:
    """layer_fn(params, x) = nnx.merge(graph, params, rest)(x): one module as a function."""

    def __init__(self, graph, rest):
        self.graph, self.rest = graph, rest
        self.__name__ = f"nnx_layer[{type(graph).__name__}]"

    def __call__(self, params, x):
        return nnx.merge(self.graph, params, self.rest)(x)


def nnx_layers(blocks: Sequence[nnx.Module]) -> tuple[layers, nnx.State]:
    """(stage_fn, stacked params) for `blocks`, one nnx.Module per layer, all built alike;
    their non-Param state (if any) must be equal and is held constant."""
    if isinstance(blocks, nnx.Module) or not isinstance(blocks, Sequence) or not blocks:
        raise ConfigError(f"blocks is a {type(blocks).__name__}: give a non-empty list of nnx.Module, one per "
                          "layer, e.g. [Block(d, rngs=nnx.Rngs(i)) for i in range(L)]")
    for j, b in enumerate(blocks):
        if not isinstance(b, nnx.Module):
            raise ConfigError(f"blocks[{j}] is a {type(b).__name__}, not a flax nnx.Module")
    graphs, params, rests = zip(*(nnx.split(b, nnx.Param, ...) for b in blocks))
    for j, g in enumerate(graphs):
        if g != graphs[0]:
            raise ConfigError(f"blocks[{j}] is not built like blocks[0] (another structure or hyperparameters): "
                              "a pipeline stacks layers of one kind")
    leaves = [jax.tree.leaves(r) for r in rests]
    if any(len(lv) != len(leaves[0]) or any(a is not b and not jnp.array_equal(a, b) for a, b in zip(lv, leaves[0]))
           for lv in leaves):
        raise ConfigError("the blocks' non-Param state differs between layers (e.g. RNG or batch statistics): "
                          "nnx_layers holds it constant, the same for every layer; give blocks whose only "
                          "per-layer state is nnx.Param")
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params)
    return layers(_Layer(graphs[0], rests[0])), stacked


unstack = stage.unstack   # the per-layer States of a stacked one (params or their gradients)
