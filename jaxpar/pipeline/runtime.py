"""Pipeline runtime: any Schedule executed as one SPMD program (lecture 2.4, script 02).

    s = schedule.make("1f1b", stages=4, microbatches=8)
    loss, grads = runtime.run(s, stage_fn, params, (inputs, targets), mesh=m)   # m: dp x pp
    grads.params   # d loss / d params, the structure of params (leading axis: layers)
    grads.inputs   # d loss / d inputs

`params` is a pytree whose leaves stack the model's L layers on a leading axis; stage k
of the S = p*v model stages holds layers [k*L/S, (k+1)*L/S), and `stage_fn(stage_params,
x) -> y` runs them (`layers(layer_fn)` builds one whose layers run under lax.scan;
`stage.py` says what a stage is). The program (`program.py`) is one `lax.scan` over the
plan's steps (`plan.py`), inside ONE shard_map over every axis of the mesh:

  * over pp, the schedule: each device runs its row of the plan;
  * over the axes `batch_spec` splits the batch on (dp by default; (dp, ep), or cp on the
    sequence, for a composed model), data parallelism: the gradients of a weight are
    summed once, at the end, over those of these axes its PartitionSpec does not split;
  * over any other axis (tp, ...), nothing: the stage function is per-shard code, and
    `param_specs` (PartitionSpecs of one layer's parameters, over the non-pp axes) say
    how its parameters are split. A TP stage is `tensor.layers.block_shard` over tp.

`first_fn(first_params, inputs) -> activation` runs on stage 0 (e.g. the vocab-parallel
embedding of token ids) and, with `last_params`, `loss_fn(last_params, y, targets)` on
the last (e.g. the LM head and the vocab-parallel cross-entropy): both inside the
pipeline, their gradients returned in Grads.first / Grads.last.

`run` builds the step once per (schedule, functions, shapes, dtypes, mesh, options) and
caches it, as `jax.jit` does; `pipeline(...)` / `run_pipeline(pipe, ...)` hold it yourself.
`baseline.gpipe_baseline` is the simple alternative (the JAX shard_map docs, MaxText): a
forward-only scanned pipeline differentiated by autodiff, whose memory grows with m.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.mesh import PP, axis_size
from jaxpar.pipeline import passes as passes_lib
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline.program import Program
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline.stage import (Grads, check_shapes, from_stages, layers, mse, spec_axes, to_stages, validate,
                                   validate_options)

__all__ = ["Grads", "Local", "Pipeline", "from_stages", "layers", "local", "mse", "pipeline", "run", "run_pipeline",
           "to_stages"]


class Pipeline(NamedTuple):
    """A compiled-ready pipeline step for one schedule, mesh and set of shapes: `step` maps
    (stage params [p, v, Lc, ...] sharded over pp, inputs, targets, first params, last
    params) to (loss per pp device, grads in the stage layout, input gradients per pp
    device, first- and last-stage grads per pp device); `plan` its tables."""
    step: Callable
    plan: plan_lib.Plan
    schedule: Schedule
    mesh: Any


def compiler_options(mesh) -> dict:
    """XLA options for the step. On CPU, copy insertion by region analysis: without it,
    XLA:CPU copies every residual buffer twice per step of the loop (it cannot order the
    slot read before the slot write), doubling the residuals' memory; measured in
    jaxpar.memory.verify. Other backends: XLA's defaults."""
    platform = mesh.devices.flat[0].platform
    return {"xla_cpu_copy_insertion_use_region_analysis": True} if platform == "cpu" else {}


def staged(spec: P) -> P:
    """The spec of a stage-layout leaf [p, v, Lc, ...] whose one layer is laid out as `spec`."""
    return P(PP, None, None, *spec)


class Local(NamedTuple):
    """The per-device pipeline of one request, to call inside a shard_map over every axis
    (`pipeline` wraps it; a training step wraps it with its own reductions and update):
    program(params [v, Lc, ...], inputs [m, mb, ...], targets, first, last) -> (loss,
    grads, d inputs, first grads, last grads), the gradients not yet summed over the
    batch axes (`request.batch_axes`)."""
    program: Program
    request: Any
    plan: plan_lib.Plan


def local(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, loss_fn: Callable = mse,
          recompute: bool = False, bubble_fill: float = 0.0, input_grads: bool | None = None,
          param_specs=None, batch_spec: P | None = None, first_fn: Callable | None = None,
          first_params=None, first_specs=None, last_params=None, last_specs=None) -> Local:
    """Check everything (ConfigError before compiling) and build the per-device program."""
    v = validate(schedule, stage_fn, params, batch, mesh, loss_fn, batch_spec=batch_spec, first_fn=first_fn,
                 param_specs=param_specs, first_params=first_params, first_specs=first_specs,
                 last_params=last_params, last_specs=last_specs, input_grads=input_grads)
    validate_options(recompute=recompute, bubble_fill=bubble_fill)
    plan = plan_lib.plan(schedule)
    p, chunks, m = schedule.stages, schedule.chunks, schedule.microbatches
    has_last = last_params is not None
    loss_dtype = check_shapes(v, stage_fn, loss_fn, first_fn, has_last)
    depth = v.n_layers // (p * chunks)
    passes = (passes_lib.Stack(stage_fn.layer_fn, depth, recompute) if isinstance(stage_fn, layers)
              else passes_lib.Whole(stage_fn, recompute))
    shards = math.prod(axis_size(mesh, a) for a in v.batch_axes)
    program = Program(plan=plan, passes=passes, loss_fn=loss_fn, first_fn=first_fn, last_params=has_last,
                      axes=(PP, *v.batch_axes), scale=m * shards, fill=bubble_fill, loss_dtype=loss_dtype,
                      input_grads=v.input_grads)
    return Local(program=program, request=v, plan=plan)


def pipeline(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, loss_fn: Callable = mse,
             recompute: bool = False, bubble_fill: float = 0.0, input_grads: bool | None = None,
             param_specs=None, batch_spec: P | None = None, first_fn: Callable | None = None,
             first_params=None, first_specs=None, last_params=None, last_specs=None) -> Pipeline:
    """Check everything (ConfigError before compiling) and build the jitted step; `params`,
    `batch` and the first/last params may be arrays or ShapeDtypeStructs (only their
    shapes are used)."""
    built = local(schedule, stage_fn, params, batch, mesh=mesh, loss_fn=loss_fn, recompute=recompute,
                  bubble_fill=bubble_fill, input_grads=input_grads, param_specs=param_specs,
                  batch_spec=batch_spec, first_fn=first_fn, first_params=first_params, first_specs=first_specs,
                  last_params=last_params, last_specs=last_specs)
    v, plan, program, m = built.request, built.plan, built.program, schedule.microbatches

    def reduce(tree, specs):
        """Sum each leaf over the batch axes its spec does not split (once, at the end)."""
        def one(a, spec):
            over = tuple(x for x in v.batch_axes if x not in spec_axes(spec))
            return jax.lax.psum(a, over) if over else a
        return jax.tree.map(one, tree, specs)

    def per_device(params, inputs, targets, first_params, last_params):
        params = jax.tree.map(lambda a: a[0], params)                 # [v, Lc, ...]
        split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])  # [m, mb, ...]
        loss, grads, dx, g_first, g_last = program(params, split(inputs), split(targets), first_params,
                                                   last_params)
        loss = jax.lax.psum(loss, v.batch_axes) if v.batch_axes else loss
        grads, g_first, g_last = (reduce(grads, v.param_specs), reduce(g_first, v.first_specs),
                                  reduce(g_last, v.last_specs))
        dx = dx.reshape(-1, *dx.shape[2:])[None] if v.input_grads else None
        lead = lambda t: jax.tree.map(lambda a: a[None], t)
        return loss[None], lead(grads), dx, lead(g_first), lead(g_last)

    stage_specs = jax.tree.map(staged, v.param_specs)
    edge = lambda specs: None if specs is None else jax.tree.map(lambda s: P(PP, *s), specs)
    in_specs = (stage_specs, v.in_spec, v.target_spec, v.first_specs, v.last_specs)
    out_specs = (P(PP), stage_specs, P(PP, *v.in_spec) if v.input_grads else None, edge(v.first_specs),
                 edge(v.last_specs))
    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
                   compiler_options=compiler_options(mesh))
    return Pipeline(step=step, plan=plan, schedule=schedule, mesh=mesh)


# ---- the cache: one built step per request, as jax.jit keeps one per signature ----------

_CACHE: collections.OrderedDict = collections.OrderedDict()
CACHE_SIZE = 32


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(jnp.shape(a)), str(jnp.result_type(a))) for a in leaves)


def _key(schedule, stage_fn, params, batch, mesh, options: dict) -> tuple:
    s = schedule
    table = (s.name, s.stages, s.microbatches, s.chunks, s.layout, s.split_backward,
             tuple(sorted(s.costs.items())), tuple(tuple(row) for row in s.actions))
    specs = {k: jax.tree.flatten(options[k], is_leaf=lambda x: isinstance(x, P)) for k in
             ("param_specs", "first_specs", "last_specs", "batch_spec") if options.get(k) is not None}
    arrays = (_signature(params), _signature(batch), _signature(options.get("first_params")),
              _signature(options.get("last_params")))
    plain = tuple((k, repr(val) if k == "bubble_fill" else val) for k, val in sorted(options.items())
                  if k not in specs and k not in ("first_params", "last_params"))
    return (table, stage_fn, arrays, mesh, plain, tuple((k, tuple(v[0]), v[1]) for k, v in sorted(specs.items())))


def run(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, loss_fn: Callable = mse,
        recompute: bool = False, bubble_fill: float = 0.0, input_grads: bool | None = None, param_specs=None,
        batch_spec: P | None = None, first_fn: Callable | None = None, first_params=None, first_specs=None,
        last_params=None, last_specs=None) -> tuple[jax.Array, Grads]:
    """Run one training step's forward and backward with `schedule` on `mesh` (axis pp,
    and any others): (loss, Grads(params, inputs, first, last)), equal to the unsharded
    model's. The built step is cached (by schedule, functions, shapes, dtypes, mesh and
    options), so a loop compiles once.

    batch = (inputs [B, ...], targets [B, ...]); B splits over batch_spec's first entry
    (dp), then into microbatches.
    recompute: keep only each stage's input between F and B and run the forward again.
    bubble_fill: the value unused buffer slots start with (NaN checks nothing reads them).
    input_grads: also return d loss / d inputs (default: when they are floating point).
    param_specs, first_specs, last_specs: PartitionSpecs over the non-pp axes (param_specs
    for one layer, without the layer axis); default replicated.
    first_fn, first_params, last_params: see the module docstring."""
    options = dict(loss_fn=loss_fn, recompute=recompute, bubble_fill=bubble_fill, input_grads=input_grads,
                   param_specs=param_specs, batch_spec=batch_spec, first_fn=first_fn, first_params=first_params,
                   first_specs=first_specs, last_params=last_params, last_specs=last_specs)
    try:
        key = _key(schedule, stage_fn, params, batch, mesh, options)
        hash(key)
    except (TypeError, ValueError, AttributeError):
        key = None  # something unhashable or malformed: pipeline() says what is wrong
    pipe = _CACHE.get(key) if key is not None else None
    if pipe is None:
        pipe = pipeline(schedule, stage_fn, params, batch, mesh=mesh, **options)
        if key is not None:
            _CACHE[key] = pipe
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return run_pipeline(pipe, params, batch, first_params=first_params, last_params=last_params)


def run_pipeline(pipe: Pipeline, params, batch, *, first_params=None, last_params=None) -> tuple[jax.Array, Grads]:
    """Run a built Pipeline on global params ([L, ...] leaves) and batch: (loss, Grads)."""
    s = pipe.schedule
    loss, grads, dx, g_first, g_last = pipe.step(to_stages(params, s), *batch, first_params, last_params)
    # the loss is on the last stage's device, zero elsewhere; the input gradient on device 0;
    # the first- and last-stage gradients on the devices holding stages 0 and S-1
    owner = lambda tree, stage: jax.tree.map(lambda a: a[s.device_of(stage)[0]], tree)
    return loss.sum(), Grads(params=from_stages(grads, s), inputs=None if dx is None else dx[0],
                             first=owner(g_first, 0), last=owner(g_last, s.virtual_stages - 1))


def cache_clear() -> None:
    """Forget every built step."""
    _CACHE.clear()

