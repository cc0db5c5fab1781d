"""A schedule from outside the registry (searched, or imported from torch) run by the
pipeline runtime against the unsharded model: one MLP layer per model stage, NaN in every
bubble, and the compiled step's collectives next to the formula's and the oracle's
(tests/oracles.py, which reads a placement from a schedule's name)."""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxpar import mesh as mesh_lib
from jaxpar.pipeline import runtime, stage, verify
from jaxpar.schedules import schedule
from jaxpar.testing import compare as compare_trees, compiled_collectives
from tests import oracles

ROWS_PER_MB = 2
WIDTH = 32   # verify.model's MLP width


def oracle_permutes(s: schedule.Schedule, itemsize: int) -> dict:
    """The collective-permutes of one step by the oracle, under the name of a registered
    schedule with s's placement. Each permute carries one microbatch's activation."""
    named = dataclasses.replace(s, name="dualpipe-v" if s.placement == "v" else "interleaved")
    n = oracles.lockstep_permutes(named)
    return {"collective-permute": (n, n * ROWS_PER_MB * WIDTH * itemsize)} if n else {}


def run(s: schedule.Schedule, dtype=jnp.float32, layers_per_stage: tuple[int, ...] | None = None) -> dict:
    """Errors against the unsharded model (loss, input gradient, every weight), the
    tolerance rule, and the measured, formula and oracle collectives of s's compiled step.
    One MLP layer per model stage, or `layers_per_stage` of them."""
    n_layers = sum(layers_per_stage) if layers_per_stage else s.virtual_stages
    stage_fn, params, batch = verify.model("mlp", n_layers, ROWS_PER_MB * s.microbatches, dtype)
    mesh = mesh_lib.make_mesh(pp=s.stages, devices=jax.devices()[:s.stages])
    pipe = runtime.pipeline(s, stage_fn, params, batch, mesh=mesh, bubble_fill=math.nan,
                            layers_per_stage=layers_per_stage)
    compiled = pipe.step.lower(runtime.to_stages(params, s, layers_per_stage), *batch, None, None).compile()
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), params, batch)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    errors, rule, within = compare_trees({"loss": loss, "inputs": grads.inputs, "params": grads.params},
                                         {"loss": ref_loss, "inputs": ref.inputs, "params": ref.params})
    return dict(errors=errors, tolerance=rule, within=within, measured=compiled_collectives(compiled, pipe.plan.runs()),
                formula=verify.expected_collectives(pipe, params, batch),
                oracle=oracle_permutes(s, jnp.dtype(dtype).itemsize))


def assert_exact(c: dict) -> None:
    assert all(math.isfinite(e) for e in c["errors"].values()), c
    assert c["within"], c
    assert c["measured"] == c["formula"] == c["oracle"], c
