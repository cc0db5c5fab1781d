"""The GPipe baseline: a forward-only scanned pipeline, differentiated by autodiff.

The pipeline of the JAX shard_map docs and MaxText, kept as the baseline the
schedule-driven runtime (`runtime.py`) is measured against: its memory grows with m,
since jax.grad of the scan keeps every step's residuals.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.collectives import varying
from jaxpar.mesh import DP, PP, axis_size, require_mesh
from jaxpar.schedules import schedule as schedule_lib
from jaxpar.pipeline.runtime import Pipeline, request
from jaxpar.pipeline.stage import mse, to_microbatches


def gpipe_baseline(stage_fn: Callable, params, batch, *, mesh, microbatches: int,
                   loss_fn: Callable = mse, bubble_fill: float = 0.0) -> Pipeline:
    """The pipeline of the JAX shard_map docs and MaxText: at step t device d runs its stage
    on microbatch t - d and ppermutes the result to d + 1; m + p - 1 steps; the backward is
    jax.grad of the whole scan, so every step's residuals are kept: memory grows with m.
    Returns a Pipeline whose `step` has the runtime's signature (stage layout with chunks = 1)."""
    require_mesh(mesh, axes=(PP,), only=(DP, PP), needed_by="the GPipe baseline")
    p, dp = axis_size(mesh, PP), axis_size(mesh, DP)
    schedule = schedule_lib.make("gpipe", stages=p, microbatches=microbatches)
    request(schedule, stage_fn, params, batch, mesh=mesh, loss_fn=loss_fn, bubble_fill=bubble_fill)   # the checks
    m, has_dp = microbatches, dp > 1
    axes = (DP, PP) if has_dp else (PP,)
    chain = [(d, d + 1) for d in range(p - 1)]

    def local(params, inputs, targets, first_params, last_params):  # the runtime's signature; no first/last
        stage_params = jax.tree.map(lambda a: a[0, 0], params)       # [Lc, ...]
        me = jax.lax.axis_index(PP)

        def loss_of(stage_params, inputs):
            xs, ts = to_microbatches(inputs, m), to_microbatches(targets, m)     # [m, mb, ...]
            state = varying(jnp.full(xs.shape[1:], bubble_fill, xs.dtype), axes)
            outs = varying(jnp.full(xs.shape, bubble_fill, xs.dtype), axes)

            def step(carry, t):
                state, outs = carry
                i = t - me                                  # the microbatch this device runs
                valid = (i >= 0) & (i < m)
                x = jnp.where(me == 0, xs[jnp.clip(t, 0, m - 1)], state)
                y = stage_fn(stage_params, jnp.where(valid, x, 0))  # a bubble runs on zeros
                outs = outs.at[jnp.where(valid & (me == p - 1), i, m)].set(y, mode="drop")
                return (jax.lax.ppermute(y, PP, chain) if chain else y, outs), None

            (_, outs), _ = jax.lax.scan(step, (state, outs), jnp.arange(m + p - 1))
            outs = jnp.where(me == p - 1, outs, 0)          # only the last stage's are outputs
            loss = jnp.mean(jax.vmap(loss_fn)(outs, ts)) / dp
            return jnp.where(me == p - 1, loss, 0)

        # Differentiated with respect to copies typed varying over every axis, so each
        # device's gradient stays its own (device 0's input gradient; each dp shard's weight
        # gradient, all-reduced once below) rather than all-reduced where JAX meets them.
        loss, (grads, dx) = jax.value_and_grad(loss_of, argnums=(0, 1))(
            varying(stage_params, axes), varying(inputs, axes))
        if has_dp:
            loss, grads = jax.lax.psum((loss, grads), DP)
        return loss[None], jax.tree.map(lambda a: a[None, None], grads), dx[None], None, None

    batch_pspec = P(DP) if has_dp else P()
    step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(PP), batch_pspec, batch_pspec, None, None),
                                 out_specs=(P(PP), P(PP), P(PP, DP) if has_dp else P(PP), None, None)))
    return Pipeline(step=step, plan=None, schedule=schedule, mesh=mesh)
