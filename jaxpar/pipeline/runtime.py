"""Pipeline runtime: any Schedule executed as one SPMD program (lecture 2.4, script 02).

    s = schedule.make("1f1b", stages=4, microbatches=8)
    loss, grads = runtime.run(s, stage_fn, params, (inputs, targets), mesh=m)   # m: dp x pp
    grads.params   # d loss / d params, the structure of params (leading axis: layers)
    grads.inputs   # d loss / d inputs

`params` is a pytree whose leaves stack the model's L layers on a leading axis; stage k
of the S = p*v model stages holds layers [k*L/S, (k+1)*L/S), and `stage_fn(stage_params,
x) -> y` runs them (`layers(layer_fn)` builds one; `stage.py` says what a stage is).

Inside `shard_map` over `pp` (and `dp`), `lax.scan` walks the steps of the schedule's
plan (`plan.py`: its table as integer tables). At each step a device reads its entry,
indexed by `lax.axis_index("pp")`, and runs two lanes, each a `lax.switch`:
  backward lane  idle; B c: the pullback of the output gradient rebuilt from the slot of
                 chunk c's F: the input gradient goes to the previous stage and, unless
                 the schedule splits the backward, the weight gradient is added to the
                 chunk's; split, the output gradient waits in the slot for W; W c: the
                 weight gradient alone (the zero-bubble schedules);
  forward lane   idle; F c: chunk c's stage under `jax.vjp`, the output to the next stage,
                 the vjp's residuals (a pytree of arrays) into a slot, or with
                 `recompute=True` only the input (B runs the forward again); F last: the
                 same plus the loss and its gradient, which waits here for this stage's B.
Then `ppermute` moves each lane's output to the next (right) or previous (left) device,
wrapping around for interleaved chunks, only in the steps and directions the schedule
sends. Residual slots number the schedule's `peak_in_flight`, so compiled memory follows
the schedule: 1F1B's does not grow with m, GPipe's does. Over dp, the gradients are
all-reduced (psum) once, at the end.

`baseline.gpipe_baseline` is the simple alternative (the JAX shard_map docs, MaxText): a
forward-only scanned pipeline differentiated by autodiff, whose memory grows with m.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.collectives import varying
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, PP, axis_size
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline.plan import F as FIELD
from jaxpar.pipeline.plan import LANES
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline.stage import Grads, from_stages, layers, mse, to_stages, unstack, validate, validate_options

__all__ = ["Grads", "Pipeline", "from_stages", "layers", "mse", "pipeline", "run", "run_pipeline", "to_stages"]


# ---- the residuals one stage keeps between F and B ------------------------------------

class _Residuals:
    """What F keeps for B and W. Without recompute: the leaves of the pytree jax.vjp
    returns, minus the parameters it was taken with respect to (B has those anyway; for a
    `layers` stage, each layer's own, so no weight is stored); with recompute: the input."""

    def __init__(self, stage_fn, recompute: bool):
        self.recompute = recompute
        if isinstance(stage_fn, layers):
            self.split, self.fn = unstack, stage_fn.apply
            self.merge = lambda grads: jax.tree.map(lambda *a: jnp.stack(a), *grads)
        else:
            self.split, self.fn, self.merge = (lambda p: p), stage_fn, (lambda g: g)

    def learn(self, split, x):
        """Trace F once (inside shard_map, with the types the branches will see) to learn
        the pytree jax.vjp returns and the shapes of the stored leaves."""
        self.shapes = jax.eval_shape(lambda: self.forward(split, x, learn=True)[1])

    def forward(self, split, x, learn: bool = False):
        """(y, stored leaves); `split` is self.split(stage params)."""
        if self.recompute:
            return self.fn(split, x), [x]
        y, vjp_fn = jax.vjp(self.fn, split, x)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        param_ids = {id(a): j for j, a in enumerate(jax.tree.leaves(split))}
        layout = [("p", param_ids[id(a)]) if id(a) in param_ids
                  else ("s", None) if isinstance(a, jax.core.Tracer) else ("c", a) for a in leaves]
        if learn:
            self.treedef, self.layout = treedef, layout
        return y, [a for a, (kind, _) in zip(leaves, layout) if kind == "s"]

    def pullback(self, split, stored) -> Callable:
        """g -> (d params, d x): the stage's vjp at F's point, rebuilt from the stored leaves."""
        if self.recompute:
            vjp_fn = jax.vjp(self.fn, split, stored[0])[1]
        else:
            params, stored = jax.tree.leaves(split), iter(stored)
            vjp_fn = jax.tree.unflatten(self.treedef, [params[j] if kind == "p" else next(stored)
                                                       if kind == "s" else j for kind, j in self.layout])

        def apply(g):
            d_split, dx = vjp_fn(g)
            return self.merge(d_split), dx
        return apply


# ---- the schedule-driven program -------------------------------------------------------

def _step_program(plan, loss_fn, residuals: _Residuals, axes, fill, loss_dtype, dp, input_grads):
    """The per-device program: (stage params [v, Lc, ...], inputs [m, mb, ...], targets) ->
    (loss, grads [v, Lc, ...], dx [m, mb, ...]), run inside shard_map."""
    s = plan.schedule
    m, v, split = s.microbatches, s.chunks, s.split_backward
    scale = m * dp  # the batch's loss is the mean of m x dp microbatch losses
    table = jnp.asarray(plan.table)

    def program(params, inputs, targets):
        # Typed varying over dp too, or the vjp of every B would all-reduce the weight
        # gradient over dp (the transpose of the implicit pvary); it is summed once, at the end.
        params = varying(params, axes)
        me = jax.lax.axis_index(PP)
        act = jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype)
        buf = lambda n, a: jnp.full((n + 1, *a.shape), fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0, a.dtype)
        carry = dict(
            x=buf(plan.n_x, act), g=buf(plan.n_g, act),
            gw=buf(plan.n_res, act) if split else None,  # output gradients kept from B for W
            grads=jax.tree.map(jnp.zeros_like, params),
            dx=jnp.full((m, *act.shape), fill, act.dtype) if input_grads else None, loss=jnp.zeros((), loss_dtype))
        # Each chunk's parameters (each layer's, for a `layers` stage) sliced once, here:
        # sliced inside a branch, XLA would copy the weights at every step.
        chunks = [residuals.split(jax.tree.map(lambda a: a[c], params)) for c in range(v)]
        residuals.learn(chunks[0], varying(jnp.zeros(act.shape, act.dtype), axes))
        carry = varying(dict(carry, res=[buf(plan.n_res, a) for a in residuals.shapes]), axes)

        zero_grads = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), params)

        def forward_branch(kind, c):
            def run(x_in, target):
                o = dict(out=x_in, res=[jnp.zeros(a.shape, a.dtype) for a in residuals.shapes],
                         loss=jnp.zeros((), loss_dtype))
                if kind != "idle":
                    o["out"], o["res"] = residuals.forward(chunks[c], x_in)
                if kind == "F_last":
                    loss, dy = jax.value_and_grad(loss_fn)(o["out"], target)
                    o["out"], o["loss"] = (dy / scale).astype(dy.dtype), (loss / scale).astype(loss_dtype)
                return varying(o, axes)
            return run

        def backward_branch(kind, c):
            def run(g_in, res_in, gw_in):
                o = dict(out=g_in, grads=zero_grads())
                if kind != "idle":
                    d_params, dx = residuals.pullback(chunks[c], res_in)(gw_in if kind == "W" else g_in)
                    if kind == "B":
                        o["out"] = dx
                    if kind == "W" or not split:
                        o["grads"] = d_params
                return varying(o, axes)
            return run

        f_branches = [forward_branch(kind, c) for kind, c in plan.f_branches]
        b_branches = [backward_branch(kind, c) for kind, c in plan.b_branches]

        def step(carry, row, sends: frozenset):
            e = row[me]
            get = lambda name: e[FIELD[name]]
            c = dict(carry)
            # backward lane (B or W) first: it may free the residual slot this step's F takes
            g_in = carry["g"][get("g_read")]
            b = jax.lax.switch(get("b_branch"), b_branches, g_in, [r[get("res_read")] for r in carry["res"]],
                               carry["gw"][get("res_read")] if split else g_in)
            c["grads"] = jax.tree.map(lambda g, d: g.at[get("b_chunk")].add(d), carry["grads"], b["grads"])
            if split:
                c["gw"] = carry["gw"].at[get("gw_write")].set(g_in)
            if input_grads:  # dx is returned as it stands (no trash slot): row 0 rewritten when idle
                j = jnp.minimum(get("dx_write"), m - 1)
                c["dx"] = carry["dx"].at[j].set(jnp.where(get("dx_write") < m, b["out"], carry["dx"][j]))
            # forward lane
            x_in = jnp.where(get("from_batch") > 0, inputs[get("f_microbatch")], carry["x"][get("x_read")])
            f = jax.lax.switch(get("f_branch"), f_branches, x_in, targets[get("f_microbatch")])
            c["loss"] = carry["loss"] + f["loss"]
            c["res"] = [r.at[get("res_write")].set(new) for r, new in zip(carry["res"], f["res"])]
            # every lane's output to where it is consumed: here, or one device over
            outs = {"F": f["out"], "B": b["out"]}
            for lane, direction in sorted(sends):
                ch = "from_left" if direction == "right" else "from_right"
                received = jax.lax.ppermute(outs[lane], PP, plan.pairs[lane, direction])
                for buf in ("x", "g"):
                    if f"{lane}_{ch}_{buf}" in plan.channels:
                        c[buf] = c[buf].at[get(f"{lane}_{ch}_{buf}")].set(received)
            for lane in LANES:
                for buf in ("x", "g"):
                    if f"{lane}_local_{buf}" in plan.channels:
                        c[buf] = c[buf].at[get(f"{lane}_local_{buf}")].set(outs[lane])
            return c, None

        for start, stop, sends in plan.segments:
            carry, _ = jax.lax.scan(functools.partial(step, sends=sends), carry, table[start:stop])
        return carry["loss"], carry["grads"], carry["dx"]

    return program


class Pipeline(NamedTuple):
    """A compiled-ready pipeline step for one schedule, mesh and set of shapes: `step` maps
    (stage params [p, v, Lc, ...] sharded over pp, inputs, targets) to (loss per pp
    device, grads in the stage layout, input gradients per pp device); `plan` its tables."""
    step: Callable
    plan: plan_lib.Plan
    schedule: Schedule
    mesh: Any


def pipeline(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, loss_fn: Callable = mse,
             recompute: bool = False, bubble_fill: float = 0.0, input_grads: bool = True) -> Pipeline:
    """Check everything (ConfigError before compiling) and build the jitted step; `params`
    and `batch` may be arrays or ShapeDtypeStructs (only their shapes are used)."""
    n_layers, rows = validate(schedule, stage_fn, params, batch, mesh, loss_fn)
    validate_options(recompute=recompute, input_grads=input_grads, bubble_fill=bubble_fill)
    plan = plan_lib.plan(schedule)
    p, v, m, dp = schedule.stages, schedule.chunks, schedule.microbatches, axis_size(mesh, DP)
    inputs, targets = batch
    stage_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n_layers // (p * v), *a.shape[1:]), a.dtype), params)
    x = jax.ShapeDtypeStruct((rows, *jnp.shape(inputs)[1:]), jnp.result_type(inputs))
    y = jax.eval_shape(stage_fn, stage_params, x)
    if not isinstance(y, jax.ShapeDtypeStruct) or (y.shape, y.dtype) != (x.shape, x.dtype):
        got = f"{y.shape} {y.dtype}" if isinstance(y, jax.ShapeDtypeStruct) else type(y).__name__
        raise ConfigError(f"stage_fn maps a microbatch {x.shape} {x.dtype} to {got}: a "
                          f"pipeline stage must keep the activation's shape and dtype")
    residuals = _Residuals(stage_fn, recompute)
    loss = jax.eval_shape(loss_fn, y, jax.ShapeDtypeStruct((rows, *jnp.shape(targets)[1:]), jnp.result_type(targets)))
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        got = f"{loss.shape} {loss.dtype}" if isinstance(loss, jax.ShapeDtypeStruct) else type(loss).__name__
        raise ConfigError(f"loss_fn(y, targets) gives {got}: it must be a floating scalar, the mean over the "
                          "microbatch (e.g. jnp.mean(...))")
    loss_dtype = loss.dtype
    has_dp = dp > 1  # a dp axis of size 1 is left alone: XLA keeps collectives over one device
    axes = (DP, PP) if has_dp else (PP,)
    program = _step_program(plan, loss_fn, residuals, axes, bubble_fill, loss_dtype, dp if dp > 1 else 1,
                            input_grads)
    batch_spec = P(DP) if has_dp else P()

    def local(params, inputs, targets):
        params = jax.tree.map(lambda a: a[0], params)                 # [v, Lc, ...]
        split = lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:])  # [m, mb, ...]
        loss, grads, dx = program(params, split(inputs), split(targets))
        if has_dp:
            loss, grads = jax.lax.psum((loss, grads), DP)
        dx = dx.reshape(-1, *dx.shape[2:])[None] if input_grads else None
        return loss[None], jax.tree.map(lambda a: a[None], grads), dx

    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(PP), batch_spec, batch_spec),
                                 out_specs=(P(PP), P(PP), (P(PP, DP) if has_dp else P(PP)) if input_grads else None)))
    return Pipeline(step=step, plan=plan, schedule=schedule, mesh=mesh)


def run(schedule: Schedule, stage_fn: Callable, params, batch, *, mesh, loss_fn: Callable = mse,
        recompute: bool = False, bubble_fill: float = 0.0, input_grads: bool = True) -> tuple[jax.Array, Grads]:
    """Run one training step's forward and backward with `schedule` on `mesh` (axes pp, and
    optionally dp): (loss, Grads(params, inputs)), equal to the unsharded model's. Each call
    builds and compiles the step; in a loop, build it once with `pipeline(...)` and call
    `run_pipeline(pipe, params, batch)`.

    batch = (inputs [B, ...], targets [B, ...]); B splits over dp, then into microbatches.
    recompute: keep only each stage's input between F and B and run the forward again in B.
    bubble_fill: the value unused buffer slots start with (NaN checks nothing reads them).
    input_grads: also return d loss / d inputs (False: Grads.inputs is None, and the m
    microbatches' input gradients take no memory)."""
    pipe = pipeline(schedule, stage_fn, params, batch, mesh=mesh, loss_fn=loss_fn,
                    recompute=recompute, bubble_fill=bubble_fill, input_grads=input_grads)
    return run_pipeline(pipe, params, batch)


def run_pipeline(pipe: Pipeline, params, batch) -> tuple[jax.Array, Grads]:
    """Run a built Pipeline on global params ([L, ...] leaves) and batch: (loss, Grads)."""
    loss, grads, dx = pipe.step(to_stages(params, pipe.schedule), *batch)
    # the loss is on the last stage's device, zero elsewhere; the input gradient on device 0
    return loss.sum(), Grads(params=from_stages(grads, pipe.schedule), inputs=None if dx is None else dx[0])
