"""One pipeline step, asked for and checked once: the `Request` that `runtime.local`,
`runtime.pipeline` and `runtime.run` build from, and that `run`'s cache is keyed by.

    req = runtime.request(schedule, stage_fn, params, batch, mesh=m, recompute="full")
    pipe = runtime.pipeline(req)                    # or runtime.local(req) inside your own shard_map

`make(schedule, stage_fn, params, batch, mesh=m, ends=Ends(...), options=Options(...))`
(`Ends`: the first and last stages' parts; `Options`: the rest; `from_keywords`, which is
`runtime.request`, takes their fields as keywords) refuses, with a ConfigError naming the
value, the constraint and a fix, anything the schedule cannot run on the mesh with these
functions, shapes and pspecs, before anything compiles. It keeps shapes only: params, batch
and the first/last params may be arrays or ShapeDtypeStructs. The request then holds what
the checks found: the layer count, the axes the batch is split over, every PartitionSpec
(one per leaf, the axes of one device dropped), the per-device shapes and the loss dtype.
Two requests are equal, and hash alike, when they build the same program: the same
schedule table, functions (by identity), shapes, dtypes, mesh, pspecs and options.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.mesh import PP, axis_size, require_mesh
from jaxpar.pipeline import local_shapes
from jaxpar.schedules.schedule import Schedule
from jaxpar.pipeline.stage import layers, mse
from jaxpar.pipeline.stage_layers import is_even, layer_split


# What B runs again of F (the glossary's recompute): "none", or "full" (F keeps each stage's
# input, B runs its forward again). The trainer's "dots" lives inside its layers.
RECOMPUTE = ("none", "full")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Request:
    """A checked request for one pipeline step (build it with `make`).

    Asked for: the schedule, stage_fn(stage_params, x) -> y, the mesh, loss_fn (y,
    targets) -> scalar or, with last_params, (last_params, y, targets) -> scalar,
    first_fn(first_params, inputs) -> activation (or None), recompute, bubble_fill (what
    unused slots start with), input_grads (whether d loss / d inputs is returned).
    Shapes (global ShapeDtypeStruct trees): params [L, ...] leaves, inputs and targets
    [B, ...], first_params and last_params (or None).
    Pspecs over the non-pp axes, one PartitionSpec per leaf: param_pspecs (one layer,
    without its layer axis), first_pspecs, last_pspecs, in_pspec and target_pspec.
    layers_per_stage: the layers of each model stage (p*chunks counts in model order: uneven
    stages when they differ; `stage_layers.layer_split`), the even split when not given.
    Found: n_layers, batch_axes (the axes of more than one device the batch is split
    over), loss_dtype, and `local`, the per-device shapes: params, first, last, one
    microbatch's inputs and targets, one stage's params."""

    schedule: Schedule
    stage_fn: Callable
    mesh: Mesh
    loss_fn: Callable
    first_fn: Callable | None
    recompute: str                # "none" or "full" (RECOMPUTE)
    bubble_fill: float
    input_grads: bool
    params: Any
    inputs: jax.ShapeDtypeStruct
    targets: jax.ShapeDtypeStruct
    first_params: Any
    last_params: Any
    param_pspecs: Any
    first_pspecs: Any
    last_pspecs: Any
    in_pspec: P
    target_pspec: P
    n_layers: int
    layers_per_stage: tuple[int, ...]
    batch_axes: tuple[str, ...]
    loss_dtype: Any
    local: dict

    @property
    def has_last(self) -> bool:
        """Whether the loss takes its own parameters (loss_fn(last_params, y, targets))."""
        return self.last_params is not None

    @property
    def depth(self) -> int:
        """Layers per chunk as the stage layout holds them: L / (p chunks), or with uneven stages
        the largest count (the others padded to it)."""
        return max(self.layers_per_stage)

    @property
    def uneven(self) -> bool:
        """Whether the stages hold different numbers of layers (padded, the padding skipped)."""
        return not is_even(self.layers_per_stage)

    @property
    def activation_axes(self) -> tuple[str, ...]:
        """The axes activations (and, in the program, the parameters) vary over: pp and
        the batch axes."""
        return (PP, *self.batch_axes)

    @property
    def scale(self) -> int:
        """Microbatches x batch shards: the loss is the mean of that many microbatch losses."""
        return self.schedule.microbatches * math.prod(axis_size(self.mesh, a) for a in self.batch_axes)

    @functools.cached_property
    def key(self) -> tuple:
        """What the program depends on: `==` and `hash` compare it."""
        s = self.schedule
        table = (s.name, s.stages, s.microbatches, s.chunks, s.placement, s.split_backward,
                 tuple(sorted(s.costs.items())), tuple(tuple(row) for row in s.actions))
        shapes = tuple(_frozen(t) for t in (self.params, self.inputs, self.targets, self.first_params,
                                            self.last_params))
        pspecs = tuple(_frozen(t, pspec=True) for t in (self.param_pspecs, self.first_pspecs, self.last_pspecs,
                                                      self.in_pspec, self.target_pspec))
        return (table, self.stage_fn, self.loss_fn, self.first_fn, self.mesh, self.recompute,
                repr(self.bubble_fill), self.input_grads, shapes, pspecs, self.layers_per_stage)

    def __eq__(self, other) -> bool:
        return isinstance(other, Request) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _frozen(tree, pspec: bool = False) -> tuple:
    is_p = (lambda x: isinstance(x, P)) if pspec else None
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_p)
    return treedef, tuple(a if pspec else (tuple(a.shape), str(a.dtype)) for a in leaves)


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(jnp.shape(a)), jnp.result_type(a)), tree)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Ends:
    """The first and last stages' own parts, around the layers the stages share: a first
    function with its parameters on stage 0, and the loss (with its own parameters or not)
    on the last stage. Compared by identity, as it may hold arrays: the Request built from
    it keeps their shapes, and Requests are what compare."""

    loss_fn: Callable = mse
    """loss_fn(y, targets) -> scalar, the mean over the microbatch; with last_params,
    loss_fn(last_params, y, targets). Default: the mean squared error."""

    first_fn: Callable | None = None
    """first_fn(first_params, inputs) -> activation, run on stage 0 (e.g. an embedding of
    token ids). None: the inputs are the first stage's activation."""

    first_params: Any = None
    """first_fn's parameters (arrays or ShapeDtypeStructs; only their shapes are kept);
    None without first_fn."""

    first_pspecs: Any = None
    """PartitionSpecs of first_params over the non-pp axes, one per leaf. None: replicated."""

    last_params: Any = None
    """The loss's own parameters (e.g. the LM head), passed first to loss_fn. None: the loss
    takes (y, targets) only."""

    last_pspecs: Any = None
    """PartitionSpecs of last_params over the non-pp axes, one per leaf. None: replicated."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """How the step runs and how its parameters and batch are laid out. The defaults run
    the plain pipeline: nothing recomputed, data parallel over dp, even stages."""

    recompute: str = "none"
    """Keep only each stage's input between F and B and run the forward again in B: less
    activation memory for one more forward. Default off: the residuals are kept."""

    bubble_fill: float = 0.0
    """The value unused buffer slots start with: a real number, NaN allowed. NaN shows that
    nothing reads them (a slot read would carry NaN into the loss). Default 0.0."""

    input_grads: bool | None = None
    """Also return d loss / d inputs. None: when the inputs are floating point (there is no
    gradient with respect to token ids)."""

    param_pspecs: Any = None
    """PartitionSpecs of one layer's parameters over the non-pp axes, without the layer
    axis, one per leaf (e.g. tensor-parallel weights over tp). None: replicated."""

    batch_pspec: P | tuple | None = None
    """The batch's PartitionSpec, or a pair (inputs' pspec, targets' pspec); the rows split
    over its first entry, then into microbatches. None: P("dp") when the mesh has dp."""

    layers_per_stage: tuple[int, ...] | None = None
    """The layers of each of the p*chunks model stages, in model order, e.g. (1, 2, 2, 1):
    uneven stages, for which stage_fn must be `layers(layer_fn)`. None: L / (p chunks) each."""


_ENDS = tuple(f.name for f in dataclasses.fields(Ends))
_OPTIONS = tuple(f.name for f in dataclasses.fields(Options))


def from_keywords(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, **keywords) -> Request:
    """`make` with the fields of Ends and Options given as keywords, as `runtime.request`,
    `runtime.run` and `runtime.pipeline` take them: (..., mesh=m, recompute="full")."""
    for name in keywords:
        if name not in _ENDS and name not in _OPTIONS:
            raise TypeError(f"request() got an unexpected keyword argument {name!r}")
    ends = Ends(**{k: v for k, v in keywords.items() if k in _ENDS})
    options = Options(**{k: v for k, v in keywords.items() if k in _OPTIONS})
    return make(schedule, stage_fn, params, batch, mesh=mesh, ends=ends, options=options)


def make(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, ends: Ends = Ends(),
         options: Options = Options()) -> Request:
    """Check everything (ConfigError before compiling) and return the Request.

    stage_fn(stage_params, x) -> y; params: [L, ...] leaves; batch = (inputs [B, ...],
    targets [B, ...]); mesh: with a pp axis of schedule.stages devices. `ends`: the first
    and last stages' parts; `options`: recompute, bubble fill, input gradients, layouts
    and uneven stages (their fields say what each is)."""
    _check_functions(schedule, stage_fn, ends.loss_fn, ends.first_fn)
    _check_mesh(schedule, mesh)
    n_layers = _layer_count(params)
    layers_per_stage = _layers_per_stage(options.layers_per_stage, n_layers, schedule, stage_fn)
    batch_found = local_shapes.batch_shapes(batch, options.batch_pspec, mesh, schedule.microbatches, ends.first_fn,
                                            options.input_grads)
    param_pspecs, local_params = local_shapes.pspecs(params, options.param_pspecs, mesh, "param_pspecs", skip=1)
    if ends.first_params is not None and ends.first_fn is None:
        raise ConfigError("first_params given without first_fn: give first_fn(first_params, inputs) -> activation")
    first_pspecs, local_first = local_shapes.edge_pspecs(ends.first_params, ends.first_pspecs, mesh, "first_pspecs")
    last_pspecs, local_last = local_shapes.edge_pspecs(ends.last_params, ends.last_pspecs, mesh, "last_pspecs")
    _check_options(recompute=options.recompute, bubble_fill=options.bubble_fill)
    local = dict(batch_found.local, params=local_params, first=local_first, last=local_last,
                 stage=jax.tree.map(lambda a: jax.ShapeDtypeStruct((max(layers_per_stage), *a.shape[1:]), a.dtype),
                                    local_params))
    loss_dtype = _loss_dtype(local, stage_fn, ends.loss_fn, ends.first_fn, has_last=ends.last_params is not None)
    return Request(schedule=schedule, stage_fn=stage_fn, mesh=mesh, loss_fn=ends.loss_fn, first_fn=ends.first_fn,
                   recompute=options.recompute, bubble_fill=options.bubble_fill, input_grads=batch_found.input_grads,
                   params=_shapes(params), inputs=_shapes(batch[0]), targets=_shapes(batch[1]),
                   first_params=_shapes(ends.first_params), last_params=_shapes(ends.last_params),
                   param_pspecs=param_pspecs, first_pspecs=first_pspecs, last_pspecs=last_pspecs,
                   in_pspec=batch_found.in_pspec, target_pspec=batch_found.target_pspec, n_layers=n_layers,
                   layers_per_stage=layers_per_stage, batch_axes=batch_found.axes, loss_dtype=loss_dtype, local=local)


# ---- the checks, in the order `make` runs them --------------------------------------------

def _check_functions(schedule, stage_fn, loss_fn, first_fn) -> None:
    if not isinstance(schedule, Schedule):
        raise ConfigError(f"schedule is a {type(schedule).__name__}, not a Schedule: build one with "
                          "jaxpar.schedules.schedule.make('1f1b', stages=..., microbatches=...)")
    named = (("stage_fn", stage_fn), ("loss_fn", loss_fn)) + ((("first_fn", first_fn),) if first_fn is not None
                                                             else ())
    for name, fn in named:
        if not callable(fn):
            raise ConfigError(f"{name}={fn!r} is not callable: give a function ({name}(params, x) for a stage, "
                              "loss_fn(y, targets) -> scalar for the loss)")


def _check_mesh(schedule: Schedule, mesh) -> None:
    """Refuse a mesh without a pp axis of the schedule's p devices."""
    require_mesh(mesh, axes=(PP,), needed_by="the pipeline runtime")
    if schedule.stages != axis_size(mesh, PP):
        raise ConfigError(f"schedule {schedule.name!r} is built for p={schedule.stages} devices but the mesh has "
                          f"{PP}={axis_size(mesh, PP)}: make it with schedule.make({schedule.name!r}, "
                          f"stages={axis_size(mesh, PP)}, ...)")


def _layer_count(params) -> int:
    """L, the leading axis every params leaf shares."""
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ConfigError("params has no arrays: give a pytree whose leaves stack the layers on axis 0")
    for leaf in leaves:
        errors.array("a params leaf", leaf, nonempty=False, shape_doc="an array [layers, ...]")
    n_layers = leaves[0].shape[0] if leaves[0].ndim else 0
    if any(a.ndim == 0 or a.shape[0] != n_layers for a in leaves):
        raise ConfigError(f"params leaves have leading axes {[tuple(a.shape[:1]) for a in leaves]}: every leaf "
                          "stacks the same number of layers on axis 0")
    return n_layers


def _layers_per_stage(layers_per_stage, n_layers: int, schedule: Schedule, stage_fn) -> tuple[int, ...]:
    """The layers of each of the p*chunks model stages: the even split, refused unless p*chunks
    divides L, or `layers_per_stage` checked (`stage_layers.layer_split`); uneven stages only with
    a `layers(layer_fn)` stage, whose layers the runtime can skip one by one."""
    n_stages = schedule.virtual_stages     # the model's stages: p devices x chunks each
    if layers_per_stage is None and (n_layers == 0 or n_layers % n_stages):
        raise ConfigError(f"{n_layers} layers do not split into p*v = {schedule.stages}*{schedule.chunks} = "
                          f"{n_stages} stages: use a layer count divisible by {n_stages} (at least {n_stages}), "
                          "another p or chunks, or give layers_per_stage (one count per model stage, summing to "
                          f"{n_layers})")
    counts = layer_split(layers_per_stage, n_layers, n_stages)
    if not is_even(counts) and not isinstance(stage_fn, layers):
        raise ConfigError(f"layers_per_stage={counts} (uneven stages) with stage_fn={stage_fn!r}: the runtime pads "
                          "each stage to the largest count and skips the padding layer by layer, which needs a "
                          "stage built by jaxpar.pipeline.stage.layers(layer_fn); give one, or even stages")
    return counts


def _check_options(*, recompute, bubble_fill) -> None:
    """Refuse options of the wrong type (recompute one of RECOMPUTE; bubble_fill a real
    number, NaN allowed: it marks the slots nothing reads)."""
    errors.one_of("recompute", recompute, RECOMPUTE)
    if isinstance(bubble_fill, bool) or not isinstance(bubble_fill, (int, float, np.floating, np.integer)):
        raise ConfigError(f"bubble_fill={bubble_fill!r}: give a number (0.0, or float('nan') to show that "
                          "nothing reads an unused slot)")


def _probe(fn, *args):
    """jax.eval_shape(fn, *args), or None for per-shard code whose collectives need the
    shard_map (the program checks it again there, still before compiling)."""
    try:
        return jax.eval_shape(fn, *args)
    except NameError:
        return None


def _keeps_activation(name: str, y, x) -> None:
    if y is not None and (not isinstance(y, jax.ShapeDtypeStruct) or (y.shape, y.dtype) != (x.shape, x.dtype)):
        got = f"{y.shape} {y.dtype}" if isinstance(y, jax.ShapeDtypeStruct) else type(y).__name__
        raise ConfigError(f"{name} maps a microbatch {x.shape} {x.dtype} to {got}: a pipeline stage (and each "
                          "of its layers) must keep the activation's shape and dtype")


def _loss_dtype(local: dict, stage_fn, loss_fn, first_fn, *, has_last: bool):
    """Refuse a stage that changes the activation (of a `layers` stage, first one layer: a
    layer that changes it breaks the next layer, in whatever operation meets the new shape)
    and a loss that is not a floating scalar; return the loss dtype."""
    x = local["inputs"] if first_fn is None else _probe(first_fn, local["first"], local["inputs"])
    if isinstance(stage_fn, layers) and x is not None:
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), local["stage"])
        _keeps_activation("stage_fn's layer_fn", _probe(stage_fn.layer_fn, one, x), x)
    y = _probe(stage_fn, local["stage"], x) if x is not None else None
    _keeps_activation("stage_fn", y, x)
    if y is None:
        return jnp.result_type(float)
    loss = _probe(loss_fn, *((local["last"],) if has_last else ()), y, local["targets"])
    if loss is None:
        return jnp.result_type(y.dtype) if jnp.issubdtype(y.dtype, jnp.floating) else jnp.result_type(float)
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        got = f"{loss.shape} {loss.dtype}" if isinstance(loss, jax.ShapeDtypeStruct) else type(loss).__name__
        raise ConfigError(f"loss_fn(y, targets) gives {got}: it must be a floating scalar, the mean over the "
                          "microbatch (e.g. jnp.mean(...))")
    return loss.dtype
