"""Pipeline runtime: compiled memory vs microbatches, and step time vs m at a fixed batch
(schedule-driven 1F1B vs the autodiff GPipe baseline).

    python -m benchmarks.pipeline [--width W] [--mb ROWS] [--repeats N]
    python -m benchmarks.run pipeline

The lecture's MLP (stage.mlp_params: 8 x Linear(width) + ReLU, 2 layers per stage) on
pp=4 (the first 4 devices; 8 fake CPU devices by default). Two figures:

  temp memory  memory_analysis().temp_size_in_bytes of the compiled step, lowered with
               ShapeDtypeStructs (nothing allocated), at a FIXED microbatch of MB_ROWS rows
               (default 32 rows, width 256) as m grows 4 -> 8 -> 16 -> 32, for 1F1B, GPipe,
               interleaved (v=2) and ZB-H2 driven by their schedules (input_grads=False: the
               m microbatches' input gradients are an output, not counted) and for
               baseline.gpipe_baseline (jax.grad of a scanned forward). Columns: bytes; the
               same in units of one microbatch activation (mb_rows * width * 4 bytes);
               growth relative to m=4; units added per microbatch beyond 4 (constant when
               memory grows in proportion to m); the runtime's residual slots plan.n_res next
               to max(schedule.peak_in_flight) (interleaved: microbatch-chunks, each half a
               stage; the baseline has no slots, autodiff keeps every step's residuals).
               Expected: 1F1B flat, GPipe and the baseline growing with m, interleaved and
               ZB-H2 (2p-1 = 7 in flight) flat once m exceeds their peak.
  step time    the lecture's 1024 rows through 8 x Linear(1024), m in 1..32 (so the
               microbatch shrinks from 1024 to 32 rows): the 1F1B schedule-driven step
               (input_grads=False) and the baseline step, compiled and warmed up first, then
               REPEATS rounds each timing every (m, kind) once, alternating which kind goes
               first; min and median ms; ratio = 1F1B / baseline (of the mins, and of the
               medians). busy = (one stage's forward+backward over the whole 1024-row batch
               on one device, jitted, fastest run) / (fastest step), beside the bubble formula
               m / (m + p - 1). The 4 pipeline devices are fake CPU devices sharing this
               machine's cores, while the one-stage reference has them all to itself: busy
               is biased low (at most about cores/4 with fewer than 4 cores); the trend with
               m is what counts. Too many microbatches lose: the step slows again once the
               microbatches get small (per-step overheads, smaller matmuls).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import mesh
from jaxpar.pipeline import baseline, runtime, stage
from jaxpar.schedules import schedule

P_STAGES = 4
N_LAYERS = 8
MEMORY_M = (4, 8, 16, 32)
MEMORY_KINDS = ("1f1b", "gpipe", "interleaved", "zb-h2", "baseline")
TIME_M = (1, 2, 4, 8, 16, 32)
TIME_ROWS, TIME_WIDTH = 1024, 1024
REPEATS = 5


def _mesh():
    return mesh.make_mesh(pp=P_STAGES, devices=jax.devices()[:P_STAGES])


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _build(kind: str, m: int, params, batch, msh, input_grads: bool = False) -> runtime.Pipeline:
    if kind == "baseline":
        return baseline.gpipe_baseline(stage.mlp_stage, params, batch, mesh=msh, microbatches=m)
    s = schedule.make(kind, stages=P_STAGES, microbatches=m)
    return runtime.pipeline(s, stage.mlp_stage, params, batch, mesh=msh, input_grads=input_grads)


# ---- memory ---------------------------------------------------------------------------

def memory_rows(width: int = 256, mb: int = 32) -> list[dict]:
    msh = _mesh()
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stage.mlp_params(N_LAYERS, width))
    unit = mb * width * 4  # one microbatch activation, float32
    rows = []
    for kind in MEMORY_KINDS:
        first = None
        for m in MEMORY_M:
            x = jax.ShapeDtypeStruct((m * mb, width), jnp.float32)
            pipe = _build(kind, m, params, (x, x), msh)
            stage_params = jax.eval_shape(lambda p: runtime.to_stages(p, pipe.schedule), params)
            temp = pipe.step.lower(stage_params, x, x, None, None).compile().memory_analysis().temp_size_in_bytes
            first = temp if first is None else first
            rows.append({
                "figure": "temp memory", "kind": kind if kind == "baseline" else f"{kind} (schedule)",
                "m": m, "mb_rows": mb, "width": width, "temp_bytes": temp, "temp_units": temp / unit,
                "growth_vs_m4": temp / first,
                "units_per_extra_mb": (temp - first) / unit / (m - MEMORY_M[0]) if m > MEMORY_M[0] else "-",
                "n_res": pipe.plan.n_res if pipe.plan is not None else "-",
                "peak_in_flight": max(pipe.schedule.peak_in_flight)})
    return rows


# ---- step time ------------------------------------------------------------------------

def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def time_rows(repeats: int = REPEATS, ms=TIME_M) -> list[dict]:
    msh = _mesh()
    params = stage.mlp_params(N_LAYERS, TIME_WIDTH)
    batch = stage.mlp_batch(TIME_ROWS, TIME_WIDTH)
    # placed once, as the step's in_specs want them: the timings exclude transfers
    inputs, targets = (jax.device_put(a, NamedSharding(msh, P())) for a in batch)
    steps = {}
    for m in ms:
        for kind in ("1f1b", "baseline"):
            pipe = _build(kind, m, params, batch, msh)
            stage_params = jax.device_put(runtime.to_stages(params, pipe.schedule), NamedSharding(msh, P(mesh.PP)))
            jax.block_until_ready(pipe.step(stage_params, inputs, targets, None, None))  # compile + warm-up
            steps[m, kind] = (pipe.step, stage_params)

    # the ideal per-device work: one stage (N_LAYERS / p layers) forward + backward (weight
    # and input gradients) over the whole batch, on one device
    per_stage = N_LAYERS // P_STAGES
    dev = jax.devices()[0]
    one = jax.device_put(jax.tree.map(lambda a: a[:per_stage], params), dev)
    x, dy = (jax.device_put(a, dev) for a in batch)
    one_stage = jax.jit(lambda p, x, dy: jax.vjp(stage.mlp_stage, p, x)[1](dy))
    jax.block_until_ready(one_stage(one, x, dy))

    times = {key: [] for key in steps}
    stage_times = []
    for r in range(repeats):
        stage_times.append(_timed(one_stage, one, x, dy))
        for m in ms:
            for kind in (("1f1b", "baseline") if r % 2 == 0 else ("baseline", "1f1b")):
                step, stage_params = steps[m, kind]
                times[m, kind].append(_timed(step, stage_params, inputs, targets, None, None))
    ideal = min(stage_times)

    rows = []
    for m in ms:
        ours, base = times[m, "1f1b"], times[m, "baseline"]
        rows.append({
            "figure": "step time", "kind": "1f1b (schedule) vs baseline", "m": m, "mb_rows": TIME_ROWS // m,
            "width": TIME_WIDTH,
            "1f1b_ms": 1e3 * min(ours), "1f1b_med_ms": 1e3 * statistics.median(ours),
            "base_ms": 1e3 * min(base), "base_med_ms": 1e3 * statistics.median(base),
            "ratio": min(ours) / min(base), "ratio_med": statistics.median(ours) / statistics.median(base),
            "busy_1f1b": ideal / min(ours), "busy_base": ideal / min(base),
            "m/(m+p-1)": m / (m + P_STAGES - 1)})
    rows.append({"figure": "note", "kind": "busy reference", "stage_ms": 1e3 * ideal,
                 "note": f"busy = one stage's fwd+bwd on 1024 rows ({1e3 * ideal:.0f} ms, one device) / step; "
                         f"{P_STAGES} fake {jax.devices()[0].platform} devices share {_cores()} core(s), "
                         f"so absolute busy fractions are distorted (biased low): read the trend; "
                         f"{repeats} rounds, min and median"})
    return rows


def run(width: int = 256, mb: int = 32, repeats: int = REPEATS) -> list[dict]:
    if len(jax.devices()) < P_STAGES:
        return [{"figure": "skipped", "note": f"needs {P_STAGES} devices for pp={P_STAGES}, "
                                              f"found {len(jax.devices())}"}]
    return memory_rows(width, mb) + time_rows(repeats)


def main(argv: list[str] | None = None):
    from benchmarks.run import format_rows
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256, help="MLP width of the memory figure (default 256)")
    parser.add_argument("--mb", type=int, default=32, help="microbatch rows of the memory figure (default 32)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help=f"timed rounds (default {REPEATS})")
    args = parser.parse_args(argv)
    rows = run(args.width, args.mb, args.repeats)
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} device(s), pp={P_STAGES} on the first {P_STAGES}; "
          f"{_cores()} core(s)")
    for figure in dict.fromkeys(r["figure"] for r in rows):
        print()
        print(format_rows([{k: v for k, v in r.items() if v is not None}
                           for r in rows if r["figure"] == figure]))


if __name__ == "__main__":
    mesh.use_cpu_devices(8)
    main()
