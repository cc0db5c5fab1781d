"""Pipeline runtime at the sizes users run: compile time and memory against m, p and
layers per stage, and 1F1B's step time against the autodiff GPipe baseline.

    python -m benchmarks.pipeline_scale [--quick]
    python -m benchmarks.run pipeline_scale

Four figures, each measured side by side in one run (the machine is shared and noisy):

  compile   every schedule at p in {2, 4, 8}, m = 8 and 128, 16 x Linear(64) with 4-row
            microbatches: seconds to lower and compile the step; ratio m=128 / m=8 (the
            program is one scan over the steps, so m changes only its trip count), and
            the slower of the two against the GPipe baseline's at the same p and m.
  memory    compiled temp bytes of 1F1B, ZB-H1 and DualPipe-V at p in {2, 4}, m = 8, 16,
            32 (8 x Linear(512), 32-row microbatches), growth against m = 8, with the
            residual slots the plan keeps (the schedule's peak in flight), beside the
            baseline, which grows with m.
  layers    compile seconds of 1F1B p=4 m=8 with 2, 4 and 8 reference transformer blocks
            per stage (layers run under lax.scan): ratio 8 / 2 blocks.
  step      1F1B p=4 m=8 on 8 x Linear(1024) against the baseline, 8-row and 128-row
            microbatches (the runtime with input_grads=False; the baseline returns them, a
            [rows, W] output, negligible here); median of REPEATS alternated runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks._timing import alternated
from jaxpar import mesh, reference
from jaxpar.pipeline import baseline, runtime, stage
from jaxpar.schedules import schedule

SCHEDULES = tuple(schedule.KNOWN)
REPEATS = 7


def _mesh(p: int):
    return mesh.make_mesh(pp=p, devices=jax.devices()[:p])


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _build(kind, p, m, stage_fn, params, batch):
    msh = _mesh(p)
    if kind == "baseline":
        return baseline.gpipe_baseline(stage_fn, params, batch, mesh=msh, microbatches=m)
    return runtime.pipeline(schedule.make(kind, stages=p, microbatches=m), stage_fn, params, batch, mesh=msh,
                            input_grads=False)


def _compile(kind, p, m, stage_fn, params, batch):
    """(seconds to build, lower and compile, the compiled step)."""
    t0 = time.perf_counter()
    pipe = _build(kind, p, m, stage_fn, params, batch)
    staged = jax.eval_shape(lambda q: runtime.to_stages(q, pipe.schedule), params)
    compiled = pipe.step.lower(staged, *batch, None, None).compile()
    return time.perf_counter() - t0, compiled, pipe


def _valid(kind, p, m) -> bool:
    if kind == "baseline":
        return True
    try:
        schedule.make(kind, stages=p, microbatches=m)
        return True
    except ValueError:
        return False


def compile_rows(ps=(2, 4, 8), ms=(8, 128), width=64, n_layers=16, rows=4) -> list[dict]:
    params = _abstract(stage.mlp_params(n_layers, width))
    out = []
    for p in ps:
        seconds = {}
        for kind in ("baseline",) + SCHEDULES:
            for m in ms:
                if _valid(kind, p, m):
                    x = jax.ShapeDtypeStruct((m * rows, width), jnp.float32)
                    seconds[kind, m] = _compile(kind, p, m, stage.mlp_stage, params, (x, x))[0]
        for kind in SCHEDULES:
            if (kind, ms[0]) not in seconds or (kind, ms[-1]) not in seconds:
                continue
            lo, hi = seconds[kind, ms[0]], seconds[kind, ms[-1]]
            out.append({"figure": "compile", "kind": kind, "p": p, f"m={ms[0]} s": lo, f"m={ms[-1]} s": hi,
                        "ratio m": hi / lo,
                        "vs baseline": max(lo / seconds["baseline", ms[0]], hi / seconds["baseline", ms[-1]])})
        out.append({"figure": "compile", "kind": "baseline", "p": p, f"m={ms[0]} s": seconds["baseline", ms[0]],
                    f"m={ms[-1]} s": seconds["baseline", ms[-1]],
                    "ratio m": seconds["baseline", ms[-1]] / seconds["baseline", ms[0]], "vs baseline": 1.0})
    return out


def memory_rows(ps=(2, 4), ms=(8, 16, 32), width=512, n_layers=8, rows=32) -> list[dict]:
    params = _abstract(stage.mlp_params(n_layers, width))
    out = []
    for p in ps:
        for kind in ("1f1b", "zb-h1", "dualpipe-v", "baseline"):
            first = None
            for m in ms:
                if not _valid(kind, p, m):
                    continue
                x = jax.ShapeDtypeStruct((m * rows, width), jnp.float32)
                _, compiled, pipe = _compile(kind, p, m, stage.mlp_stage, params, (x, x))
                temp = compiled.memory_analysis().temp_size_in_bytes
                first = first or temp
                out.append({"figure": "memory", "kind": kind, "p": p, "m": m, "temp MB": temp / 1e6,
                            "vs first m": temp / first,
                            "res slots": pipe.plan.n_res if pipe.plan is not None else "-",
                            "peak in flight": max(pipe.schedule.peak_in_flight)})
    return out


def layer_rows(depths=(2, 4, 8), p=4, m=8) -> list[dict]:
    out, base = [], None
    for depth in depths:
        cfg = reference.ModelConfig(n_layers=p * depth, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64,
                                    mlp="swiglu")
        params = _abstract(stage.block_params(cfg))
        x = jax.ShapeDtypeStruct((m * 2, 16, cfg.d_model), jnp.float32)
        seconds = _compile("1f1b", p, m, stage.block_stage(cfg), params, (x, x))[0]
        base = base or seconds
        out.append({"figure": "layers", "kind": "1f1b reference blocks", "p": p, "m": m, "blocks/stage": depth,
                    "compile s": seconds, "vs 2 blocks": seconds / base})
    return out


def step_rows(p=4, m=8, width=1024, n_layers=8, mb_rows=(8, 128), repeats=REPEATS) -> list[dict]:
    params = stage.mlp_params(n_layers, width)
    out = []
    for rows in mb_rows:
        batch = stage.mlp_batch(m * rows, width)
        fns = {}
        for kind in ("1f1b", "baseline"):
            pipe = _build(kind, p, m, stage.mlp_stage, params, batch)
            staged = runtime.to_stages(params, pipe.schedule)
            fns[kind] = lambda staged, step=pipe.step, own=staged: step(own, *batch, None, None)
        times = alternated(fns, (None,), repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        out.append({"figure": "step", "kind": "1f1b vs baseline", "p": p, "m": m, "mb rows": rows, "width": width,
                    "1f1b ms": 1e3 * med["1f1b"], "baseline ms": 1e3 * med["baseline"],
                    "ratio": med["1f1b"] / med["baseline"]})
    return out


def run(quick: bool = False) -> list[dict]:
    if len(jax.devices()) < 8:
        return [{"figure": "skipped", "note": f"needs 8 devices, found {len(jax.devices())}"}]
    if quick:
        return compile_rows(ps=(2, 4)) + memory_rows(ps=(2,)) + layer_rows(depths=(2, 8)) + step_rows(repeats=3)
    return compile_rows() + memory_rows() + layer_rows() + step_rows()


def main(argv: list[str] | None = None):
    from benchmarks.run import format_rows
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_scale", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    for figure in dict.fromkeys(r["figure"] for r in rows):
        print()
        print(format_rows([r for r in rows if r["figure"] == figure]))


if __name__ == "__main__":
    mesh.use_cpu_devices(8)
    main()
