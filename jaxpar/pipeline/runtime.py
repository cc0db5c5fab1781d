"""Pipeline runtime: any Schedule executed as one SPMD program (lecture 2.4, script 02).

    s = schedule.make("1f1b", stages=4, microbatches=8)
    loss, grads = runtime.run(s, stage_fn, params, (inputs, targets), mesh=m)   # m: dp x pp
    grads.params   # d loss / d params, the structure of params (leading axis: layers)
    grads.inputs   # d loss / d inputs

`params` is a pytree whose leaves stack the model's L layers on a leading axis; stage k
of the S = p*chunks model stages holds layers [k*L/S, (k+1)*L/S) (or, with
`layers_per_stage=(1, 2, 2, 1)`, uneven stages: stage k the next layers_per_stage[k]
layers; every device holds the largest count, the padding skipped), and `stage_fn(stage_params,
x) -> y` runs them (`layers(layer_fn)` builds one whose layers run under lax.scan;
`stage.py` says what a stage is). The program (`program.py`) is one `lax.scan` over the
plan's steps (`plan.py`), inside ONE shard_map over every axis of the mesh:

  * over pp, the schedule: each device runs its row of the plan;
  * over the axes `batch_pspec` splits the batch on (dp by default; (dp, ep), or cp on the
    sequence, for a composed model), data parallelism: the gradients of a weight are
    summed once, at the end, over those of these axes its PartitionSpec does not split
    (`jaxpar.data.reduce_gradients`, the trainer's reduction too);
  * over any other axis (tp, ...), nothing: the stage function is per-shard code, and
    `param_pspecs` (PartitionSpecs of one layer's parameters, over the non-pp axes) say
    how its parameters are split. A TP stage is `tensor.layers.block_shard` over tp.

`first_fn(first_params, inputs) -> activation` runs on stage 0 (e.g. the vocab-parallel
embedding of token ids) and, with `last_params`, `loss_fn(last_params, y, targets)` on
the last (e.g. the LM head and the vocab-parallel cross-entropy): both inside the
pipeline, their gradients returned in Grads.first / Grads.last.

Everything a step is built from is one frozen `Request`, checked once:
`request(schedule, stage_fn, params, batch, mesh=m, ...)` (`request.py`). `local(req)` is
the per-device program, `pipeline(req)` its jitted shard_map (both also take the
request's arguments and build it), and `run` builds the step once per Request and keeps
it in an LRU cache, as `jax.jit` does; `pipeline` / `run_pipeline(pipe, ...)` hold it
yourself.
`baseline.gpipe_baseline` is the simple alternative (the JAX shard_map docs, MaxText): a
forward-only scanned pipeline differentiated by autodiff, whose memory grows with m.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.data.reduce import reduce_gradients
from jaxpar.errors import ConfigError
from jaxpar.mesh import PP
from jaxpar.pipeline import passes as passes_lib
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline import request as request_lib
from jaxpar.pipeline.program import Program
from jaxpar.pipeline.request import Request
from jaxpar.schedules.schedule import Schedule
from jaxpar.pipeline.stage import (Grads, from_microbatches, from_stages, layers, mse, padded_layers, to_microbatches,
                                   to_stages)

__all__ = ["Grads", "Local", "Pipeline", "Request", "from_stages", "layers", "local", "mse", "pipeline", "request",
           "run", "run_pipeline", "to_stages"]

request = request_lib.from_keywords   # runtime.request(schedule, stage_fn, params, batch, mesh=m, ...) -> Request


class Pipeline(NamedTuple):
    """A compiled-ready pipeline step for one schedule, mesh and set of shapes: `step` maps
    (stage params [p, chunks, Lc, ...] sharded over pp, inputs, targets, first params, last
    params) to (loss per pp device, grads in the stage layout, input gradients per pp
    device, first- and last-stage grads per pp device); `plan` its tables;
    `layers_per_stage` the stages' layer counts when uneven (None: even), which the stage
    layout is padded by (`to_stages`)."""
    step: Callable
    plan: plan_lib.Plan
    schedule: Schedule
    mesh: Any
    layers_per_stage: tuple[int, ...] | None = None


# JAX's GPU performance guide's options for these programs (each kept only where this
# XLA knows it, and not where XLA_FLAGS names it: the user's flag wins)
GPU_OPTIONS = {
    "xla_gpu_enable_latency_hiding_scheduler": True,      # collectives overlap the compute they do not feed
    "xla_gpu_enable_pipelined_all_gather": True,          # ZeRO-3: the next layer's gather during this one
    "xla_gpu_enable_pipelined_reduce_scatter": True,      # ... and the last layer's reduce-scatter after it
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_experimental_pipeline_parallelism_opt_level": "PIPELINE_PARALLELISM_OPT_LEVEL_ENABLE",  # pp sends
}


@functools.cache
def _known_gpu_options(named: str) -> tuple[tuple[str, object], ...]:
    """The GPU_OPTIONS this XLA accepts (one tiny compile each) and XLA_FLAGS (`named`)
    does not set."""
    kept = []
    for name, value in GPU_OPTIONS.items():
        if f"--{name}=" in named:
            continue
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(jnp.zeros(())).compile()
        except Exception:  # noqa: BLE001 - an option this XLA does not know (renamed, removed) is left out
            continue
        kept.append((name, value))
    return tuple(kept)


def compiler_options(mesh) -> dict:
    """XLA options for the step. On CPU, copy insertion by region analysis: without it,
    XLA:CPU copies every residual buffer twice per step of the loop (it cannot order the
    slot read before the slot write), doubling the residuals' memory; measured in
    jaxpar.memory.verify. On GPU, GPU_OPTIONS (JAX's GPU performance guide: the
    latency-hiding scheduler, collectives pipelined across layers, the pipeline-parallel
    sends), each where this XLA knows it and XLA_FLAGS does not set it. Others: XLA's
    defaults."""
    platform = mesh.devices.flat[0].platform
    if platform == "cpu":
        return {"xla_cpu_copy_insertion_use_region_analysis": True}
    if platform in ("gpu", "cuda", "rocm"):
        return dict(_known_gpu_options(os.environ.get("XLA_FLAGS", "")))
    return {}


def staged(pspec: P) -> P:
    """The pspec of a stage-layout leaf [p, chunks, Lc, ...] whose one layer is laid out as `pspec`."""
    return P(PP, None, None, *pspec)


def _as_request(first, args: tuple, options: dict) -> Request:
    """`first` itself if it is a Request (nothing else given), else request(first, *args, **options)."""
    if not isinstance(first, Request):
        return request(first, *args, **options)
    if args or options:
        raise ConfigError("a Request carries its arguments and options: pass it alone, or the arguments "
                          "(schedule, stage_fn, params, batch, mesh=..., ...) without it")
    return first


class Local(NamedTuple):
    """The per-device pipeline of one request, to call inside a shard_map over every axis
    (`pipeline` wraps it; a training step wraps it with its own reductions and update):
    program(params [chunks, Lc, ...], inputs [m, mb, ...], targets, first, last) -> (loss,
    grads, d inputs, first grads, last grads), the gradients not yet summed over the
    batch axes (`request.batch_axes`)."""
    program: Program
    request: Request
    plan: plan_lib.Plan


def local(request: Request | Schedule, *args, **options) -> Local:
    """The per-device program of `request`: local(request), or local(schedule, stage_fn,
    params, batch, mesh=..., ...) with `request`'s arguments, checked first (ConfigError
    before compiling)."""
    req = _as_request(request, args, options)
    plan = plan_lib.plan(req.schedule)
    if isinstance(req.stage_fn, layers):
        counts = tuple(map(tuple, padded_layers(req.schedule, req.layers_per_stage).tolist())) if req.uneven else None
        passes = passes_lib.Stack(req.stage_fn.layer_fn, req.depth, req.recompute, counts)
    else:
        passes = passes_lib.Whole(req.stage_fn, req.recompute)
    return Local(program=Program(request=req, plan=plan, passes=passes), request=req, plan=plan)


def pipeline(request: Request | Schedule, *args, **options) -> Pipeline:
    """The jitted step of `request`: pipeline(request), or pipeline(schedule, stage_fn,
    params, batch, mesh=..., ...) with `request`'s arguments, checked first (ConfigError
    before compiling; params, batch and the first/last params may be arrays or
    ShapeDtypeStructs: only their shapes are used)."""
    built = local(request, *args, **options)
    req, plan, program, m = built.request, built.plan, built.program, built.request.schedule.microbatches

    reduce = functools.partial(reduce_gradients, batch_axes=req.batch_axes)   # (grads, pspecs) -> summed grads

    def per_device(params, inputs, targets, first_params, last_params):
        params = jax.tree.map(lambda a: a[0], params)                 # [chunks, Lc, ...]
        loss, grads, dx, g_first, g_last = program(params, to_microbatches(inputs, m), to_microbatches(targets, m),
                                                   first_params, last_params)
        loss = jax.lax.psum(loss, req.batch_axes) if req.batch_axes else loss
        grads, g_first, g_last = (reduce(grads, req.param_pspecs), reduce(g_first, req.first_pspecs),
                                  reduce(g_last, req.last_pspecs))
        dx = from_microbatches(dx)[None] if req.input_grads else None
        lead = lambda t: jax.tree.map(lambda a: a[None], t)
        return loss[None], lead(grads), dx, lead(g_first), lead(g_last)

    stage_pspecs = jax.tree.map(staged, req.param_pspecs)
    edge = lambda pspecs: None if pspecs is None else jax.tree.map(lambda s: P(PP, *s), pspecs)
    in_specs = (stage_pspecs, req.in_pspec, req.target_pspec, req.first_pspecs, req.last_pspecs)
    out_specs = (P(PP), stage_pspecs, P(PP, *req.in_pspec) if req.input_grads else None, edge(req.first_pspecs),
                 edge(req.last_pspecs))
    step = jax.jit(jax.shard_map(per_device, mesh=req.mesh, in_specs=in_specs, out_specs=out_specs),
                   compiler_options=compiler_options(req.mesh))
    return Pipeline(step=step, plan=plan, schedule=req.schedule, mesh=req.mesh,
                    layers_per_stage=req.layers_per_stage if req.uneven else None)


# ---- run: the built step of the 32 most recently used requests, as jax.jit keeps one per signature

CACHE_SIZE = 32


@functools.lru_cache(maxsize=CACHE_SIZE)
def _pipeline_lru(request: Request) -> Pipeline:
    return pipeline(request)


def run(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, **options) -> tuple[jax.Array, Grads]:
    """Run one training step's forward and backward with `schedule` on `mesh` (axis pp,
    and any others): (loss, Grads(params, inputs, first, last)), equal to the unsharded
    model's. `options` are `request`'s: the fields of request.Ends (loss_fn, first_fn,
    first_params, first_pspecs, last_params, last_pspecs) and request.Options (recompute,
    bubble_fill, input_grads, param_pspecs, batch_pspec, layers_per_stage: uneven stages,
    e.g. (1, 2, 2, 1)). The step is built once per Request (schedule, functions, shapes,
    dtypes, mesh, pspecs, options) and kept in an LRU cache of CACHE_SIZE, so a loop
    compiles once."""
    req = request(schedule, stage_fn, params, batch, mesh=mesh, **options)
    try:
        hash(req)
    except TypeError:   # an unhashable function or option: built each call
        pipe = pipeline(req)
    else:
        pipe = _pipeline_lru(req)
    return run_pipeline(pipe, params, batch, first_params=options.get("first_params"),
                        last_params=options.get("last_params"))


def run_pipeline(pipe: Pipeline, params, batch, *, first_params=None, last_params=None) -> tuple[jax.Array, Grads]:
    """Run a built Pipeline on global params ([L, ...] leaves) and batch: (loss, Grads)."""
    s, counts = pipe.schedule, pipe.layers_per_stage
    loss, grads, dx, g_first, g_last = pipe.step(to_stages(params, s, counts), *batch, first_params, last_params)
    # the loss is on the last stage's device, zero elsewhere; the input gradient on device 0;
    # the first- and last-stage gradients on the devices holding stages 0 and S-1
    owner = lambda tree, stage: jax.tree.map(lambda a: a[s.device_of(stage)[0]], tree)
    return loss.sum(), Grads(params=from_stages(grads, s, counts), inputs=None if dx is None else dx[0],
                             first=owner(g_first, 0), last=owner(g_last, s.virtual_stages - 1))


def cache_clear() -> None:
    """Forget every built step."""
    _pipeline_lru.cache_clear()
