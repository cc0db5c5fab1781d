"""What a pipeline stage is: a stage function over stacked layers, the loss, the layout of
the layers over the stages, the checks a request must pass, and the stage functions of
the lecture with the unsharded model they are checked against.

`params` is a pytree whose leaves stack the model's L layers on a leading axis; stage k
of the S = p*v model stages holds layers [k*L/S, (k+1)*L/S), and `stage_fn(stage_params,
x) -> y` runs them (`layers(layer_fn)` builds one from a per-layer function; y has x's
shape). `loss_fn(y, targets) -> scalar` is a mean over the microbatch, so that the mean
over microbatches (and dp shards) is the whole batch's loss.

The lecture's model (script 02_pipeline_parallel.py): 8 layers of Linear(1024) + ReLU, 2
per stage on 4 stages, trained with a mean squared error (`mlp_*`); and the reference
transformer blocks (`reference.block`) stacked on a leading layer axis (`block_*`).
`unsharded(stage_fn, params, batch, loss_fn)` is the reference: the whole stack as one
stage on one device, differentiated by jax.value_and_grad.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, PP, axis_size, require_mesh
from jaxpar.pipeline.schedule import Schedule


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


# ---- the checks a request passes, and the layout of the layers over the stages ----------

def validate_options(*, recompute=False, bubble_fill=0.0) -> None:
    """Refuse runtime options of the wrong type (recompute a bool; bubble_fill a real
    number, NaN allowed: it marks the slots nothing reads)."""
    errors.flag("recompute", recompute)
    if isinstance(bubble_fill, bool) or not isinstance(bubble_fill, (int, float, np.floating, np.integer)):
        raise ConfigError(f"bubble_fill={bubble_fill!r}: give a number (0.0, or float('nan') to show that "
                          "nothing reads an unused slot)")


@dataclasses.dataclass(frozen=True)
class Request:
    """What `validate` found: the layer count, the axes
    the batch is split over (of more than one device), the specs of everything (trees of
    PartitionSpecs, one per leaf), whether input gradients are returned, and the local
    (per-device) shapes the stage sees."""

    n_layers: int
    batch_axes: tuple[str, ...]
    in_spec: P
    target_spec: P
    param_specs: Any
    first_specs: Any
    last_specs: Any
    input_grads: bool
    local: dict


def spec_axes(spec) -> set[str]:
    """The mesh axes a PartitionSpec names."""
    out = set()
    for entry in spec or ():
        out.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return out


def _local_shape(shape, spec: P, mesh, what: str, skip: int = 0) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` laid out as `spec` on its dims after the
    first `skip` (refusing axes the mesh lacks, pp, and sizes the axes do not divide)."""
    if not isinstance(spec, P):
        raise ConfigError(f"{what}: the spec {spec!r} is a {type(spec).__name__}, not a "
                          "jax.sharding.PartitionSpec: e.g. P(None, 'tp')")
    dims = shape[skip:]
    if len(spec) > len(dims):
        raise ConfigError(f"{what}: the spec {spec} names {len(spec)} dimensions, the array has {len(dims)} "
                          f"{'after its layer axis ' if skip else ''}({tuple(shape)})")
    out = list(shape)
    for j, entry in enumerate(spec):
        axes = entry if isinstance(entry, tuple) else () if entry is None else (entry,)
        n = 1
        for a in axes:
            if a == PP or a not in mesh.shape:
                raise ConfigError(f"{what}: the spec {spec} names axis {a!r}; the mesh has {dict(mesh.shape)} "
                                  f"and {PP} is the pipeline's own: name the other axes only")
            n *= mesh.shape[a]
        if dims[j] % n:
            raise ConfigError(f"{what}: dimension {skip + j} of {tuple(shape)} is {dims[j]}, not divisible by "
                              f"{' x '.join(axes)} = {n} in the spec {spec}: use a size divisible by {n}")
        out[skip + j] = dims[j] // n
    return tuple(out)


def _drop_unit(spec: P, mesh) -> P:
    """spec without the axes of one device (a value split over one device is whole, and
    shard_map would type it varying over an axis nothing sums over)."""
    def entry(e):
        axes = tuple(a for a in (e if isinstance(e, tuple) else () if e is None else (e,))
                     if mesh.shape.get(a, 2) > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*(entry(e) for e in spec))


def _specs(tree, specs, mesh, what: str, skip: int = 0):
    """(the spec tree, one P per leaf of tree, default P(); the local ShapeDtypeStructs)."""
    if specs is None:
        specs = jax.tree.map(lambda _: P(), tree)
    is_p = lambda x: isinstance(x, P)
    if jax.tree.structure(specs, is_leaf=is_p) != jax.tree.structure(tree):
        raise ConfigError(f"{what} has the structure {jax.tree.structure(specs, is_leaf=is_p)}, the parameters "
                          f"{jax.tree.structure(tree)}: give one PartitionSpec per array")
    for spec in jax.tree.leaves(specs, is_leaf=is_p):
        if not is_p(spec):
            raise ConfigError(f"{what}: the spec {spec!r} is a {type(spec).__name__}, not a "
                              "jax.sharding.PartitionSpec: e.g. P(None, 'tp')")
    specs = jax.tree.map(lambda s: _drop_unit(s, mesh), specs, is_leaf=is_p)
    local = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(_local_shape(jnp.shape(a), s, mesh, what, skip),
                                                            jnp.result_type(a)), tree, specs, is_leaf=None)
    return specs, local


def validate(schedule: Schedule, stage_fn: Callable, params, batch, mesh, loss_fn: Callable, *,
             batch_spec=None, first_fn=None, param_specs=None, first_params=None, first_specs=None,
             last_params=None, last_specs=None, input_grads=None) -> Request:
    """Refuse (ConfigError: value, constraint, fix) anything `schedule` cannot run on `mesh`
    with these params, batch and specs. Shapes only: nothing is computed."""
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule is a {type(schedule).__name__}, not a Schedule: build one with "
                          "jaxpar.pipeline.schedule.make('1f1b', stages=..., microbatches=...)")
    for name, fn in (("stage_fn", stage_fn), ("loss_fn", loss_fn)) + ((("first_fn", first_fn),) if first_fn
                                                                      is not None else ()):
        if not callable(fn):
            raise ConfigError(f"{name}={fn!r} is not callable: give a function ({name}(params, x) for a stage, "
                              "loss_fn(y, targets) -> scalar for the loss)")
    require_mesh(mesh, axes=(PP,), needed_by="the pipeline runtime")
    p, v, mb = axis_size(mesh, PP), schedule.chunks, schedule.microbatches
    if schedule.stages != p:
        raise ConfigError(f"schedule {schedule.name!r} is built for p={schedule.stages} stages but the "
                          f"mesh has {PP}={p}: make it with schedule.make({schedule.name!r}, stages={p}, ...)")
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ConfigError("params has no arrays: give a pytree whose leaves stack the layers on axis 0")
    for leaf in leaves:
        errors.array("a params leaf", leaf, nonempty=False, shape_doc="an array [layers, ...]")
    n_layers = leaves[0].shape[0] if leaves[0].ndim else 0
    if any(a.ndim == 0 or a.shape[0] != n_layers for a in leaves):
        raise ConfigError(f"params leaves have leading axes {[tuple(a.shape[:1]) for a in leaves]}: every leaf "
                          "stacks the same number of layers on axis 0")
    stages = p * v
    if n_layers == 0 or n_layers % stages:
        raise ConfigError(f"{n_layers} layers do not split into p*v = {p}*{v} = {stages} stages: use a "
                          f"layer count divisible by {stages} (at least {stages}) or another p or v")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(f"batch is a {type(batch).__name__}"
                          + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                          + ": give the pair (inputs [B, ...], targets [B, ...])")
    inputs, targets = batch
    kinds = "fiu" if first_fn is not None else "f"
    in_shape = errors.array("inputs", inputs, kinds=kinds, shape_doc="inputs[B, ...], the first stage's activations")
    t_shape = errors.array("targets", targets, shape_doc="targets[B, ...]")
    if not in_shape or not t_shape:
        raise ConfigError(f"inputs {in_shape} and targets {t_shape}: both need a leading batch axis [B, ...]")
    if batch_spec is None:
        batch_spec = P(DP) if DP in mesh.shape else P()
    in_spec, target_spec = batch_spec if isinstance(batch_spec, tuple) and not isinstance(batch_spec, P) \
        else (batch_spec, batch_spec)
    local_in = _local_shape(in_shape, in_spec, mesh, "batch_spec for the inputs")
    local_t = _local_shape(t_shape, target_spec, mesh, "batch_spec for the targets")
    in_spec, target_spec = _drop_unit(in_spec, mesh), _drop_unit(target_spec, mesh)
    rows = in_shape[0]
    if t_shape[0] != rows:
        raise ConfigError(f"inputs have {rows} rows but targets {t_shape[0]}: give one target per row")
    row_axes = [a for a in (in_spec[0] if len(in_spec) and isinstance(in_spec[0], tuple)
                            else (in_spec[0],) if len(in_spec) and in_spec[0] else ())]
    split = math.prod(axis_size(mesh, a) for a in row_axes)
    if rows % (split * mb):
        over = " x ".join(f"{a}={axis_size(mesh, a)}" for a in row_axes) or f"{DP}=1"
        raise ConfigError(f"batch of {rows} rows does not split into {over} x microbatches={mb}: "
                          f"use a batch divisible by {split * mb}, or another microbatch count")
    floating = jnp.issubdtype(jnp.result_type(inputs), jnp.floating)
    if input_grads is None:
        input_grads = bool(floating)
    errors.flag("input_grads", input_grads)
    if input_grads and not floating:
        raise ConfigError(f"input_grads=True but the inputs are {jnp.result_type(inputs)}: there is no gradient "
                          "with respect to integers (token ids); leave input_grads unset or False")
    param_specs, local_params = _specs(params, param_specs, mesh, "param_specs", skip=1)
    has_first, has_last = first_params is not None, last_params is not None
    if has_first and first_fn is None:
        raise ConfigError("first_params given without first_fn: give first_fn(first_params, inputs) -> activation")
    first_specs, local_first = _specs(first_params, first_specs, mesh, "first_specs") if has_first else (None, None)
    last_specs, local_last = _specs(last_params, last_specs, mesh, "last_specs") if has_last else (None, None)
    batch_axes = tuple(a for a in mesh.axis_names if a != PP and axis_size(mesh, a) > 1
                       and a in spec_axes(in_spec) | spec_axes(target_spec))
    mb_shape = lambda shape, dtype: jax.ShapeDtypeStruct((shape[0] // mb, *shape[1:]), dtype)
    local = dict(params=local_params, first=local_first, last=local_last,
                 inputs=mb_shape(local_in, jnp.result_type(inputs)), targets=mb_shape(local_t, jnp.result_type(targets)),
                 stage=jax.tree.map(lambda a: jax.ShapeDtypeStruct((n_layers // stages, *a.shape[1:]), a.dtype),
                                    local_params))
    return Request(n_layers=n_layers, batch_axes=batch_axes, in_spec=in_spec,
                   target_spec=target_spec, param_specs=param_specs, first_specs=first_specs,
                   last_specs=last_specs, input_grads=input_grads, local=local)


def _probe(fn, *args):
    """jax.eval_shape(fn, *args), or None for per-shard code whose collectives need the
    shard_map (the program checks it again there, still before compiling)."""
    try:
        return jax.eval_shape(fn, *args)
    except NameError:
        return None


def check_shapes(request: Request, stage_fn, loss_fn, first_fn, has_last: bool):
    """Refuse a stage that changes the activation and a loss that is not a floating
    scalar; return the loss dtype."""
    loc = request.local
    x = loc["inputs"] if first_fn is None else _probe(first_fn, loc["first"], loc["inputs"])
    y = _probe(stage_fn, loc["stage"], x) if x is not None else None
    if y is not None and (not isinstance(y, jax.ShapeDtypeStruct) or (y.shape, y.dtype) != (x.shape, x.dtype)):
        got = f"{y.shape} {y.dtype}" if isinstance(y, jax.ShapeDtypeStruct) else type(y).__name__
        raise ConfigError(f"stage_fn maps a microbatch {x.shape} {x.dtype} to {got}: a "
                          f"pipeline stage must keep the activation's shape and dtype")
    if y is None:
        return jnp.result_type(float)
    loss = _probe(loss_fn, *((loc["last"],) if has_last else ()), y, loc["targets"])
    if loss is None:
        return jnp.result_type(y.dtype) if jnp.issubdtype(y.dtype, jnp.floating) else jnp.result_type(float)
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        got = f"{loss.shape} {loss.dtype}" if isinstance(loss, jax.ShapeDtypeStruct) else type(loss).__name__
        raise ConfigError(f"loss_fn(y, targets) gives {got}: it must be a floating scalar, the mean over the "
                          "microbatch (e.g. jnp.mean(...))")
    return loss.dtype


def to_stages(params, schedule: Schedule):
    """[L, ...] leaves -> [p, v, L/(p v), ...]: entry [d, c] holds stage stage_of(d, c)."""
    p, v = schedule.stages, schedule.chunks
    for a in jax.tree.leaves(params):
        if not getattr(a, "ndim", 0) or a.shape[0] % (p * v):
            raise ConfigError(f"a params leaf of shape {tuple(getattr(a, 'shape', ()))} does not split into "
                              f"p*v = {p}*{v} = {p * v} stages on its leading (layer) axis")
    order = np.array([[schedule.stage_of(d, c) for c in range(v)] for d in range(p)])

    def one(a):
        a = a.reshape(p * v, a.shape[0] // (p * v), *a.shape[1:])
        return a[order.reshape(-1)].reshape(p, v, *a.shape[1:])
    return jax.tree.map(one, params)


def from_stages(params, schedule: Schedule):
    """Inverse of to_stages: [p, v, L/(p v), ...] -> [L, ...]."""
    p, v = schedule.stages, schedule.chunks
    inverse = np.argsort([schedule.stage_of(d, c) for d in range(p) for c in range(v)])

    def one(a):
        a = a.reshape(p * v, *a.shape[2:])[inverse]
        return a.reshape(-1, *a.shape[2:])
    return jax.tree.map(one, params)



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
