"""The pipeline runtime checked against the unsharded model: `compare` runs one schedule
and returns every difference and the compiled collectives next to their formula; the
tour rows and `jaxpar verify pp` are built from it, and the tests use it too.

The collective formula of one step over a dp x pp mesh:
  collective-permute  plan.permutes executions, each one microbatch's activation
                      (runtime_plan: one per step, lane and direction with a send);
  all-reduce          dp > 1 only: the stage parameters' gradient and the loss, summed
                      over dp once (XLA combines them: bytes = stage params + the loss);
  nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from jaxpar import comms, reference
from jaxpar import mesh as mesh_lib
from jaxpar.mesh import DP
from jaxpar.pipeline import runtime, schedule, stages
from jaxpar.testing import max_abs_diff


@dataclasses.dataclass
class Comparison:
    """One pipeline run against stages.unsharded: max abs error per output ("loss",
    "inputs", "params"), the relative error over all of them, and the collectives."""

    name: str
    mesh: str
    errors: dict
    relative: float
    measured: dict
    expected: dict
    seconds: float

    @property
    def max_error(self) -> float:
        return max(self.errors.values())

    @property
    def collectives_match(self) -> bool:
        return self.measured == self.expected


def model(kind: str, n_layers: int, rows: int, dtype=jnp.float32, width: int = 32):
    """(stage_fn, params, batch) of the lecture MLP (width) or of reference blocks."""
    if kind == "mlp":
        return stages.mlp_stage, stages.mlp_params(n_layers, width, dtype), stages.mlp_batch(rows, width, dtype)
    cfg = reference.ModelConfig(n_layers=n_layers, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32,
                                mlp="swiglu")
    return stages.block_stage(cfg), stages.block_params(cfg, dtype), stages.block_batch(rows, cfg, seq=4, dtype=dtype)


def expected_collectives(pipe: runtime.Pipeline, params, batch) -> dict:
    """comms.nonzero form of the formula above, for a built pipeline."""
    m, dp = pipe.schedule.microbatches, pipe.mesh.shape.get(DP, 1)
    inputs = batch[0]
    act = inputs.size // (m * dp) * inputs.dtype.itemsize
    out = dict(pipe.plan.expected_collectives(act))
    if dp > 1:
        stage_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)) // pipe.schedule.stages
        out["all-reduce"] = (1, stage_bytes + jnp.dtype(inputs.dtype).itemsize)
    return dict(sorted(out.items()))


def compare(name: str, stages_: int, microbatches: int, *, dp: int = 1, kind: str = "mlp", dtype=jnp.float32,
            chunks: int | None = None, n_layers: int | None = None, recompute: bool = False,
            bubble_fill: float = float("nan"), rows: int | None = None) -> Comparison:
    """Run `name` on a dp x pp mesh (bubble slots filled with NaN by default) and compare
    with the unsharded model: loss, input gradient and every parameter gradient."""
    start = time.perf_counter()
    s = schedule.make(name, stages=stages_, microbatches=microbatches, chunks=chunks)
    n_layers = n_layers or 2 * s.virtual_stages
    rows = rows or 2 * microbatches * dp
    stage_fn, params, batch = model(kind, n_layers, rows, dtype)
    m = mesh_lib.make_mesh(dp=dp, pp=stages_, devices=jax.devices()[:dp * stages_])
    pipe = runtime.pipeline(s, stage_fn, params, batch, mesh=m, recompute=recompute, bubble_fill=bubble_fill)
    placed = runtime.to_stages(params, s)
    compiled = pipe.step.lower(placed, *batch).compile()
    measured = comms.nonzero(comms.summarize(comms.collective_ops_from_hlo(compiled.as_text())))
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), params, batch)
    ref_loss, ref = stages.unsharded(stage_fn, params, batch)
    errors = {"loss": max_abs_diff(loss, ref_loss), "inputs": max_abs_diff(grads.inputs, ref.inputs),
              "params": max_abs_diff(grads.params, ref.params)}
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves((ref_loss, ref)))
    return Comparison(name=f"{name} p={stages_} m={microbatches}" + (f" v={s.chunks}" if s.chunks > 1 else ""),
                      mesh=mesh_lib.describe(m), errors=errors, relative=max(errors.values()) / scale,
                      measured=measured, expected=expected_collectives(pipe, params, batch),
                      seconds=time.perf_counter() - start)


def row(c: Comparison, note: str = ""):
    from jaxpar.tour import Row

    ok = c.relative < 1e-5 and c.collectives_match
    return Row(technique=f"pipeline {c.name}", mesh=c.mesh, max_error=c.max_error,
               collectives=comms.format_stats(c.measured) + (" = formula" if c.collectives_match else
                                                              f" != formula {comms.format_stats(c.expected)}"),
               seconds=c.seconds, ok=ok, note=note or "loss, dx, every param grad vs unsharded; NaN in bubbles")


def tour_check():
    """The lecture's 8-layer MLP under 1F1B, interleaved, ZB-H2 and DualPipe-V (reference
    blocks), on dp x pp when the devices allow."""
    n = len(jax.devices())
    p = 4 if n >= 4 else n
    dp = 2 if n >= 2 * p else 1
    rows = [row(compare("1f1b", p, 8, dp=dp), "lecture MLP (8 layers, 2 per stage); NaN in bubbles"),
            row(compare("interleaved", p, 2 * p, chunks=2)),
            row(compare("zb-h2", p, p, kind="blocks", n_layers=p), "reference blocks (GQA, SwiGLU), B/W split"),
            row(compare("dualpipe-v", p, 2 * p, dp=dp), "V layout: chunk 1 runs back up the devices")]
    return rows


def gpipe_baseline_error(p: int = 4, m: int = 4, dp: int = 1) -> float:
    """Max error of the autodiff GPipe baseline against the unsharded model (NaN bubbles)."""
    stage_fn, params, batch = model("mlp", 2 * p, 2 * m * dp)
    mm = mesh_lib.make_mesh(dp=dp, pp=p, devices=jax.devices()[:dp * p])
    pipe = runtime.gpipe_baseline(stage_fn, params, batch, mesh=mm, microbatches=m, bubble_fill=math.nan)
    loss, grads = runtime.run_pipeline(pipe, params, batch)
    ref_loss, ref = stages.unsharded(stage_fn, params, batch)
    return max_abs_diff((loss, grads), (ref_loss, ref))
