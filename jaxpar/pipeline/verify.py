"""The pipeline proven: schedules against the lecture's figures, the runtime against the
unsharded model, and each compiled step's collectives against `formulas`.

`compare` runs one schedule on a dp x pp mesh, with the model a `ModelChoice` names, and
returns every difference and the compiled collectives next to the formula;
`check_schedules` and `check_runtime` are `jaxpar verify schedule|pp` and the tour's rows,
holding the tables against the lecture's timelines (`formulas.LECTURE_TIMELINES`, pure
Python: examples/01 prints them too).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import reference
from jaxpar import mesh as mesh_lib
from jaxpar.mesh import DP
from jaxpar.pipeline import baseline, formulas, modules, runtime, stage
from jaxpar.schedules import schedule, viz
from jaxpar.pipeline.formulas import LECTURE_TIMELINES
from jaxpar.testing import Result, compare as compare_trees, compiled_collectives, max_abs_diff

@dataclasses.dataclass
class Comparison:
    """One pipeline run against stage.unsharded: max abs error per output ("loss",
    "inputs", "params"), the relative error over all of them, whether every output is
    within the dtype's tolerance, and the collectives measured and by formula."""

    name: str
    mesh: str
    errors: dict
    relative: float
    within: bool
    tolerance: tuple[float, float]
    measured: dict
    expected: dict
    seconds: float
    hlo: str = ""        # the compiled step's HLO text: its instructions, for a reader to inspect

    @property
    def max_error(self) -> float:
        return max(self.errors.values())

    @property
    def collectives_match(self) -> bool:
        return self.measured == self.expected

    def result(self, note: str = "") -> Result:
        return Result(name=f"pipeline {self.name}", mesh=self.mesh, errors=self.errors, tolerance=self.tolerance,
                      measured={"step": self.measured}, expected={"step": self.expected},
                      passed=self.within and self.collectives_match,
                      seconds=self.seconds, note=note or "loss, dx, every param grad vs unsharded; NaN in bubbles")


def model(layers: str, n_layers: int, rows: int, dtype=jnp.float32, width: int = 32):
    """(stage_fn, params, batch) of n_layers `layers`: "mlp", the lecture's MLP layers
    (width), or "blocks", reference transformer blocks."""
    if layers == "mlp":
        return stage.mlp_stage, stage.mlp_params(n_layers, width, dtype), stage.mlp_batch(rows, width, dtype)
    cfg = reference.ModelConfig(n_layers=n_layers, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32,
                                mlp="swiglu")
    return stage.block_stage(cfg), stage.block_params(cfg, dtype), stage.block_batch(rows, cfg, seq_len=4, dtype=dtype)


def expected_collectives(pipe: runtime.Pipeline, params, batch):
    """formulas.pipeline_collectives for a built pipeline and its inputs."""
    inputs = batch[0]
    return formulas.pipeline_collectives(
        schedule=pipe.schedule, batch_size=inputs.shape[0], features=inputs.size // inputs.shape[0],
        dtype=inputs.dtype, dp=mesh_lib.axis_size(pipe.mesh, DP),
        param_bytes=sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """The model and batch a comparison runs (`model` builds them): small, so that each
    case compiles in seconds on fake CPU devices."""

    layers: str = "mlp"
    """"mlp", the lecture's MLP layers, or "blocks", reference transformer blocks."""

    n_layers: int | None = None
    """The layer count. None: two per model stage (2 p chunks)."""

    rows: int | None = None
    """The batch's rows. None: two per microbatch and dp shard (2 m dp)."""

    dtype: Any = jnp.float32
    """The parameters' and batch's dtype (float64 under jax_enable_x64 for tight checks)."""

    def build(self, s: schedule.Schedule, dp: int):
        """(stage_fn, params, batch) for schedule `s` on dp shards."""
        n_layers = self.n_layers or 2 * s.virtual_stages
        rows = self.rows or 2 * s.microbatches * dp
        return model(self.layers, n_layers, rows, self.dtype)


def compare(name: str, stages: int, microbatches: int, *, dp: int = 1, chunks: int | None = None,
            model: ModelChoice = ModelChoice(), recompute: str = "none",
            bubble_fill: float = float("nan")) -> Comparison:
    """Run `name` on a dp x pp mesh (bubble slots filled with NaN by default) and compare
    with the unsharded model: loss, input gradient and every parameter gradient."""
    start = time.perf_counter()
    s = schedule.make(name, stages=stages, microbatches=microbatches, chunks=chunks)
    stage_fn, params, batch = model.build(s, dp)
    m = mesh_lib.make_mesh(dp=dp, pp=stages, devices=jax.devices()[:dp * stages])
    pipe = runtime.pipeline(s, stage_fn, params, batch, mesh=m, recompute=recompute, bubble_fill=bubble_fill)
    compiled = pipe.step.lower(runtime.to_stages(params, s), *batch, None, None).compile()
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), params, batch)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    errors, rule, within = compare_trees({"loss": loss, "inputs": grads.inputs, "params": grads.params},
                                         {"loss": ref_loss, "inputs": ref.inputs, "params": ref.params})
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves((ref_loss, ref)))
    return Comparison(name=f"{name} p={stages} m={microbatches}" + (f" v={s.chunks}" if s.chunks > 1 else ""),
                      mesh=mesh_lib.describe(m), errors=errors, relative=max(errors.values()) / scale,
                      within=within, tolerance=rule, measured=compiled_collectives(compiled, pipe.plan.runs()),
                      expected=expected_collectives(pipe, params, batch), seconds=time.perf_counter() - start,
                      hlo=compiled.as_text())


def check_runtime() -> list[Result]:
    """`jaxpar verify pp`: the lecture's MLP under 1F1B, interleaved and DualPipe-V, and
    reference transformer blocks under ZB-H2, on dp x pp where the devices allow."""
    n = len(jax.devices())
    p = 4 if n >= 4 else n
    dp = 2 if n >= 2 * p else 1
    return [compare("1f1b", p, 8, dp=dp).result("lecture MLP (8 layers, 2 per stage); NaN in bubbles"),
            compare("interleaved", p, 2 * p, chunks=2).result(),
            compare("zb-h2", p, p, model=ModelChoice(layers="blocks", n_layers=p)).result(
                "reference blocks (GQA, SwiGLU), B/W split"),
            compare("dualpipe-v", p, 2 * p, dp=dp).result("V placement: chunk 1 runs back up the devices"),
            check_nnx(p)]


class NnxBlock(nnx.Module):
    """A user's own block (RMSNorm, MLP, residual), as a flax NNX module."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


def check_nnx(p: int = 4, m: int = 4, d: int = 16) -> Result:
    """An NNX block per layer (modules.nnx_layers) under 1F1B against the same modules run
    unsharded and differentiated by nnx.value_and_grad: loss, dx and every Param."""
    start = time.perf_counter()
    s = schedule.make("1f1b", stages=p, microbatches=m)
    blocks = [NnxBlock(d, nnx.Rngs(i)) for i in range(2 * p)]
    stage_fn, params = modules.nnx_layers(blocks)
    x, t = stage.mlp_batch(2 * m, d)
    msh = mesh_lib.make_mesh(pp=p, devices=jax.devices()[:p])
    pipe = runtime.pipeline(s, stage_fn, params, (x, t), mesh=msh, bubble_fill=float("nan"))
    compiled = pipe.step.lower(runtime.to_stages(params, s), x, t, None, None).compile()
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), params, (x, t))

    def unsharded(blocks, x):
        for b in blocks:
            x = b(x)
        return jnp.mean(jnp.square(x - t))
    ref_loss, (ref_blocks, ref_x) = nnx.value_and_grad(unsharded, argnums=(0, 1))(nnx.List(blocks), x)
    ref_params = [nnx.state(ref_blocks[j], nnx.Param) for j in range(len(blocks))]
    errors, rule, within = compare_trees(
        {"loss": loss, "inputs": grads.inputs, "params": [jax.tree.leaves(g) for g in modules.unstack(grads.params)]},
        {"loss": ref_loss, "inputs": ref_x, "params": [jax.tree.leaves(g) for g in ref_params]})
    measured = compiled_collectives(compiled, pipe.plan.runs())
    expected = formulas.pipeline_collectives(schedule=s, batch_size=2 * m, features=d, dtype=jnp.float32)
    return Result(name="pipeline 1f1b, flax NNX blocks", mesh=mesh_lib.describe(msh), errors=errors, tolerance=rule,
                  measured={"step": measured}, expected={"step": expected}, passed=within and measured == expected,
                  seconds=time.perf_counter() - start, note="nnx.split/merge per layer vs the modules unsharded")


def gpipe_baseline_error(p: int = 4, m: int = 4, dp: int = 1) -> float:
    """Max error of the autodiff GPipe baseline against the unsharded model (NaN bubbles)."""
    stage_fn, params, batch = model("mlp", 2 * p, 2 * m * dp)
    mm = mesh_lib.make_mesh(dp=dp, pp=p, devices=jax.devices()[:dp * p])
    pipe = baseline.gpipe_baseline(stage_fn, params, batch, mesh=mm, microbatches=m, bubble_fill=float("nan"))
    loss, grads = runtime.run_pipeline(pipe, params, batch)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    return max_abs_diff((loss, grads), (ref_loss, ref))


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return dataclasses.replace(result, seconds=time.perf_counter() - start)


def check_schedules() -> list[Result]:
    """The lecture's three timelines, the GPipe/1F1B bubble over p in 1..8, m in 1..32, and
    the interleaved / zero-bubble / DualPipe-V figures, each against its closed form."""
    results = [_timed(lambda name=name, fig=fig: _lecture_timeline(name, fig)) for name, fig in LECTURE_TIMELINES.items()]

    def gpipe_1f1b():
        err = max(abs(schedule.make(n, p, m).bubble_fraction - formulas.bubble(n, p, m))
                  for n in ("gpipe", "1f1b") for p in range(1, 9) for m in range(1, 33))
        return Result(name="GPipe/1F1B bubble, p 1..8 x m 1..32", errors={"bubble vs (p-1)/(m+p-1)": err},
                      passed=err < 1e-12, note="exact: every table against the closed form")

    def interleaved():
        s = schedule.make("interleaved", 4, 8, 2)
        err = abs(s.bubble_fraction - formulas.bubble("interleaved", 4, 8, 2))
        return Result(name="interleaved 1F1B p=4 m=8 v=2", errors={"bubble vs (p-1)/(vm+p-1)": err},
                      passed=err < 1e-12, note=f"bubble {viz.percent(s.bubble_fraction)}; {len(s.sends)} sends "
                                               f"(1F1B {len(schedule.make('1f1b', 4, 8).sends)})")

    def zb_h1():
        zb1, ref = schedule.make("zb-h1", 4, 8), schedule.make("1f1b", 4, 8, costs={"B": 2})
        ratio = sum(zb1.idle_time) / sum(ref.idle_time)
        return Result(name="ZB-H1 p=4 m=8 F=B=W", errors={"idle / 1F1B's idle - 1/3": abs(ratio - 1 / 3)},
                      passed=abs(ratio - 1 / 3) < 1e-12 and max(zb1.peak_activations) == 4,
                      note=f"idle {ratio:.3f} of 1F1B's, peak {zb1.peak_activations}; {len(zb1.sends)} sends")

    def zb_h2():
        zb2 = schedule.make("zb-h2", 4, 8)
        return Result(name="ZB-H2 p=4 m=8 F=B=W", errors={"back-to-back bubble": zb2.steady_bubble_fraction},
                      passed=zb2.steady_bubble_fraction < 1e-12 and zb2.peak_activations[0] == 7,
                      note=f"back-to-back bubble {viz.percent(zb2.steady_bubble_fraction)}, "
                           f"peak {zb2.peak_activations} (2p-1 = 7)")

    def dualpipe_v():
        dpv = schedule.make("dualpipe-v", 4, 8)
        err = abs(dpv.bubble_fraction - formulas.bubble("dualpipe-v", 4, 8, 2))
        return Result(name="DualPipe-V p=4 m=8 F=B=W", errors={"bubble vs (p-1)/(6m+p-1)": err},
                      passed=err < 1e-12 and dpv.steady_bubble_fraction == 0 and dpv.peak_in_flight == [8] * 4,
                      note=f"bubble {viz.percent(dpv.bubble_fraction)}, back to back 0%, peak {dpv.peak_in_flight} "
                           f"chunks = 2p; {len(dpv.sends)} sends (1F1B {len(schedule.make('1f1b', 4, 8).sends)})")

    return results + [_timed(f) for f in (gpipe_1f1b, interleaved, zb_h1, zb_h2, dualpipe_v)]


def _lecture_timeline(name: str, fig: dict) -> Result:
    s = schedule.make(name, 4, fig["microbatches"])
    err = abs(s.bubble_fraction - fig["bubble"])
    same = s.ascii().splitlines()[1:] == [f"  stage {d}: {r}" for d, r in enumerate(fig["rows"])]
    peak_ok = fig["peak"] is None or s.peak_activations == fig["peak"]
    return Result(name=f"{viz.label(name)} schedule p=4 m={s.microbatches}",
                  errors={"bubble vs lecture (printed to 0.1%)": err},
                  passed=same and peak_ok and err < 5e-4,
                  note=f"bubble {viz.percent(s.bubble_fraction)} (lecture {viz.percent(fig['bubble'])}), timeline "
                       + ("= lecture" if same else "DIFFERS from lecture")
                       + (f", peak {s.peak_activations}" if fig["peak"] else "") + f"; {len(s.sends)} sends")
