"""Stage functions for the pipeline runtime, and the unsharded model they are checked against.

The lecture's model (script 02_pipeline_parallel.py): 8 layers of Linear(1024) + ReLU,
2 per stage on 4 stages, trained with a mean squared error. And the reference transformer
blocks (`reference.block`), stacked on a leading layer axis, as a stage.

`unsharded(stage_fn, params, batch, loss_fn)` is the reference: the whole stack as one
stage on one device, differentiated by jax.value_and_grad; every pipeline run is tested
against it (loss, input gradient, every parameter gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import reference
from jaxpar.pipeline.runtime import Grads, layers, mse


def mlp_params(n_layers: int = 8, width: int = 1024, dtype=jnp.float32, seed: int = 0) -> dict:
    """{"w": [L, W, W], "b": [L, W]}, He-scaled so activations keep their size through
    ReLU layers; drawn with numpy (no RNG kernel to compile)."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((n_layers, width, width)) * (2 / width) ** 0.5, dtype),
            "b": jnp.asarray(rng.standard_normal((n_layers, width)) * 0.1, dtype)}


def mlp_layer(p: dict, x):
    """One Linear(W) + ReLU: x [rows, W] -> [rows, W]."""
    return jax.nn.relu(x @ p["w"] + p["b"])


mlp_stage = layers(mlp_layer)


def mlp_batch(rows: int, width: int = 1024, dtype=jnp.float32, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """(inputs, targets), both [rows, W], standard normal."""
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((rows, width)), dtype),
            jnp.asarray(rng.standard_normal((rows, width)), dtype))


def block_stage(cfg: reference.ModelConfig):
    """A stage of reference transformer blocks: params are reference's `blocks` dict
    (leaves stacked on the layer axis), x [batch, seq, D]."""
    return layers(functools.partial(reference.block, cfg=cfg))


def block_params(cfg: reference.ModelConfig, dtype=jnp.float32, seed: int = 0) -> dict:
    return reference.init_params(jax.random.key(seed), cfg, dtype)["blocks"]


def block_batch(rows: int, cfg: reference.ModelConfig, seq: int = 8, dtype=jnp.float32, seed: int = 1):
    """(inputs, targets), both [rows, seq, D]: activations in, a regression target out."""
    rng = np.random.default_rng(seed)
    shape = (rows, seq, cfg.d_model)
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype)


def unsharded(stage_fn, params, batch, loss_fn=mse) -> tuple[jax.Array, Grads]:
    """The reference: all layers as one stage on one device; (loss, Grads)."""
    inputs, targets = batch

    def loss(params, inputs):
        return loss_fn(stage_fn(params, inputs), targets)
    value, (d_params, d_inputs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, inputs)
    return value, Grads(params=d_params, inputs=d_inputs)
