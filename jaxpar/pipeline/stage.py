"""What a pipeline stage is: a stage function over stacked layers, the loss, the layout of
the layers over the stages, and the stage functions of the lecture with the unsharded
model they are checked against (the checks a request passes: `request.py`).

`params` is a pytree whose leaves stack the model's L layers on a leading axis; stage k
of the S = p*chunks model stages holds layers [k*L/S, (k+1)*L/S) (uneven stages,
`layers_per_stage=(1, 2, 2, 1)`: the next layers_per_stage[k] layers, every stage laid
out as the largest count, the padding after its layers: `to_stages`), and
`stage_fn(stage_params, x) -> y` runs them (`layers(layer_fn)` builds one from a per-layer function; y has x's
shape). `loss_fn(y, targets) -> scalar` is a mean over the microbatch, so that the mean
over microbatches (and dp shards) is the whole batch's loss.

The lecture's model (script 02_pipeline_parallel.py): 8 layers of Linear(1024) + ReLU, 2
per stage on 4 stages, trained with a mean squared error (`mlp_*`); and the reference
transformer blocks (`reference.block`) stacked on a leading layer axis (`block_*`).
`unsharded(stage_fn, params, batch, loss_fn)` is the reference: the whole stack as one
stage on one device, differentiated by jax.value_and_grad.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.schedules.schedule import Schedule
from jaxpar.pipeline.stage_layers import is_even


class Grads(NamedTuple):
    params: Any   # d loss / d params: the structure and shapes of params
    inputs: Any   # d loss / d inputs: the shape of the batch's inputs (None: not asked for)
    first: Any = None   # d loss / d first_params (the first-stage function's)
    last: Any = None    # d loss / d last_params (the last-stage loss's)


def mse(y, targets):
    """Mean squared error over the microbatch (the lecture MLP's loss)."""
    return jnp.mean(jnp.square(y - targets))


class layers:
    """A stage function from a per-layer one: `layers(layer_fn)(stage_params, x)` applies
    layer_fn for each entry of stage_params' leading (layer) axis, in order.

    The runtime takes each layer's parameters out of the stack before the stage's vjp, so
    the residuals it keeps between F and B hold activations only; a stage function of
    another kind keeps whatever its vjp saves, slices of its weights included."""

    def __init__(self, layer_fn: Callable):
        self.layer_fn = layer_fn
        functools.update_wrapper(self, layer_fn)

    def __call__(self, stage_params, x):
        return self.apply(unstack(stage_params), x)

    def apply(self, per_layer, x):
        for p in per_layer:
            x = self.layer_fn(p, x)
        return x


def unstack(stacked) -> list:
    """[n, ...] leaves -> a list of n pytrees."""
    n = jax.tree.leaves(stacked)[0].shape[0]
    return [jax.tree.map(lambda a: a[j], stacked) for j in range(n)]


# ---- the batch as microbatches ---------------------------------------------------------------

def to_microbatches(a, microbatches: int):
    """[rows, ...] -> [microbatches, rows / microbatches, ...]: microbatch i is rows
    [i*mb, (i+1)*mb) (a reshape, no data moves). The caller has checked that
    `microbatches` divides rows (`request.py`)."""
    return a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:])


def from_microbatches(a):
    """Inverse of to_microbatches: [m, mb, ...] -> [m * mb, ...]."""
    return a.reshape(-1, *a.shape[2:])


# ---- the layout of the layers over the stages ---------------------------------------------

def to_stages(params, schedule: Schedule, layers_per_stage: tuple[int, ...] | None = None):
    """[L, ...] leaves -> [p, chunks, Lc, ...]: entry [d, c] holds stage stage_of(d, c).

    Even stages (layers_per_stage None, or all alike): Lc = L/(p chunks). Uneven stages
    (layers_per_stage: one count per model stage, checked by `stage_layers.layer_split`): Lc is the
    largest count, and a stage of fewer layers holds them first and zeros after (padding
    the runtime skips: `padded_layers`)."""
    p, chunks = schedule.stages, schedule.chunks
    if layers_per_stage is not None and not is_even(layers_per_stage):
        index = _padded_index(schedule, layers_per_stage)       # [p, chunks, Lc] into the layers, L: a zero layer
        return jax.tree.map(lambda a: _padded(a, index, n_layers=sum(layers_per_stage)), params)
    for a in jax.tree.leaves(params):
        if not getattr(a, "ndim", 0) or a.shape[0] % (p * chunks):
            raise ConfigError(f"a params leaf of shape {tuple(getattr(a, 'shape', ()))} does not split into "
                              f"p*v = {p}*{chunks} = {p * chunks} stages on its leading (layer) axis")
    order = np.array([[schedule.stage_of(d, c) for c in range(chunks)] for d in range(p)])

    def one(a):
        a = a.reshape(p * chunks, a.shape[0] // (p * chunks), *a.shape[1:])
        return a[order.reshape(-1)].reshape(p, chunks, *a.shape[1:])
    return jax.tree.map(one, params)


def from_stages(params, schedule: Schedule, layers_per_stage: tuple[int, ...] | None = None):
    """Inverse of to_stages: [p, chunks, Lc, ...] -> [L, ...] (the padding dropped)."""
    p, chunks = schedule.stages, schedule.chunks
    if layers_per_stage is not None and not is_even(layers_per_stage):
        flat = _padded_index(schedule, layers_per_stage).reshape(-1)
        held = flat < sum(layers_per_stage)
        real = np.empty(sum(layers_per_stage), int)
        real[flat[held]] = np.flatnonzero(held)                  # layer j's place in the flat [p chunks Lc] layout
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:])[real], params)
    inverse = np.argsort([schedule.stage_of(d, c) for d in range(p) for c in range(chunks)])

    def one(a):
        a = a.reshape(p * chunks, *a.shape[2:])[inverse]
        return a.reshape(-1, *a.shape[2:])
    return jax.tree.map(one, params)


def padded_layers(schedule: Schedule, layers_per_stage: tuple[int, ...]) -> np.ndarray:
    """int[p, chunks]: the layers chunk c of device d really holds (layers_per_stage of its
    model stage); its entries past that count, up to the largest, are padding."""
    return np.array([[layers_per_stage[schedule.stage_of(d, c)] for c in range(schedule.chunks)]
                     for d in range(schedule.stages)])


def _padded_index(schedule: Schedule, layers_per_stage: tuple[int, ...]) -> np.ndarray:
    """int[p, chunks, Lc]: the model layer at each place of the padded stage layout, L (one
    past the last layer: the zero layer `_padded` appends) where it is padding."""
    n_layers, depth = sum(layers_per_stage), max(layers_per_stage)
    first = np.concatenate([[0], np.cumsum(layers_per_stage)[:-1]])   # each stage's first layer
    index = np.full((schedule.stages, schedule.chunks, depth), n_layers)
    for d in range(schedule.stages):
        for c in range(schedule.chunks):
            k = schedule.stage_of(d, c)
            index[d, c, :layers_per_stage[k]] = first[k] + np.arange(layers_per_stage[k])
    return index


def _padded(a, index: np.ndarray, n_layers: int):
    """a [L, ...] laid out at `index` [p, chunks, Lc], index L reading a layer of zeros."""
    if not getattr(a, "ndim", 0) or a.shape[0] != n_layers:
        raise ConfigError(f"a params leaf of shape {tuple(getattr(a, 'shape', ()))} does not stack the "
                          f"{n_layers} layers layers_per_stage adds up to on its leading (layer) axis")
    a = jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])
    return a[index]


# ---- the lecture's stage functions and the unsharded reference ---------------------------

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


def block_batch(rows: int, cfg: reference.ModelConfig, seq_len: int = 8, dtype=jnp.float32, seed: int = 1):
    """(inputs, targets), both [rows, seq, D]: activations in, a regression target out."""
    rng = np.random.default_rng(seed)
    shape = (rows, seq_len, cfg.d_model)
    return jnp.asarray(rng.standard_normal(shape), dtype), jnp.asarray(rng.standard_normal(shape), dtype)


def unsharded(stage_fn, params, batch, loss_fn=mse) -> tuple[jax.Array, Grads]:
    """The reference: all layers as one stage on one device; (loss, Grads)."""
    inputs, targets = batch

    def loss(params, inputs):
        return loss_fn(stage_fn(params, inputs), targets)
    value, (d_params, d_inputs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, inputs)
    return value, Grads(params=d_params, inputs=d_inputs)
