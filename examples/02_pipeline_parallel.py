"""Pipeline parallelism, run for real (lecture section 2.4).

    python examples/02_pipeline_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
02_pipeline_parallel.py, lecture figures beside jaxpar's:
  demo 1  the lecture's model: 8 layers of Linear(1024), 2 per stage on 4 stages, 1F1B,
          m = 1, 4, 8, in float64: gradients vs one device's whole-batch gradients
          (lecture: below 1e-9);
  demo 2  every schedule of 01_pipeline_schedules.py executed by the same runtime
          (one SPMD program: lax.scan over steps, lax.switch over F / B / W / idle,
          ppermute between stages), NaN in every unused slot, on dp=2 x pp=4: errors,
          compiled collective-permutes vs the schedule's, residual slots vs its peak;
  demo 3  the SPMD steps the runtime runs for 1F1B (backward lane, then forward lane);
  demo 4  compiled temp memory as m grows at a fixed microbatch: 1F1B flat, the GPipe
          baseline (forward scan + autodiff) growing with m;
  demo 5  bad input: a ConfigError before anything compiles;
  demo 6  the program at scale: one scan whatever m (compile seconds and temp memory at
          m = 8 and 64 for 1F1B and DualPipe-V), the built step cached by runtime.run;
  demo 7  a user's own flax NNX block as the stage. The reference model's Megatron blocks
          as per-shard stages, trained on dp x pp x tp x cp x ep: examples/08_train_4d.py.
Step time against m (the lecture's "m = 4 was fastest") is a benchmark:
`python -m benchmarks.pipeline`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
import time  # noqa: E402

from jaxpar.pipeline import baseline, plan, runtime, schedule, stage, verify  # noqa: E402
from jaxpar.testing import max_abs_diff  # noqa: E402


def demo_lecture_model():
    print("== demo 1: the lecture's 8 x Linear(1024), 4 stages x 2 layers, 1F1B, float64 ==")
    jax.config.update("jax_enable_x64", True)
    try:
        params = stage.mlp_params(8, 1024, jnp.float64)
        batch = stage.mlp_batch(64, 1024, jnp.float64)
        m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])
        ref_loss, ref = stage.unsharded(stage.mlp_stage, params, batch)
        for m in (1, 4, 8):
            loss, grads = runtime.run(schedule.make("1f1b", 4, m), stage.mlp_stage, params, batch, mesh=m4)
            err = max_abs_diff((loss, grads), (ref_loss, ref))
            print(f"  m={m}: max |pipeline - single device| over loss, dx, all weights = {err:.1e} "
                  f"(lecture: below 1e-9)  {'ok' if err < 1e-9 else 'FAIL'}")
    finally:
        jax.config.update("jax_enable_x64", False)


def demo_every_schedule():
    p = 4 if n >= 4 else n
    dp = 2 if n >= 2 * p else 1
    print(f"\n== demo 2: every schedule, dp={dp} x pp={p}, NaN in every unused slot ==")
    print(f"  {'schedule':<28} {'max error':>9}  {'relative':>8}  collective-permutes (measured = schedule's)"
          f"  residual slots / peak in flight")
    cases = [("naive", p), ("gpipe", 8), ("1f1b", 8), ("interleaved", 8), ("zb-h1", 8), ("zb-h2", 8),
             ("dualpipe-v", 8)]
    for name, m in cases:
        c = verify.compare(name, p, m, dp=dp)
        pl = plan.plan(schedule.make(name, p, m))
        cp = c.measured.get("collective-permute", (0, 0))
        same = "=" if c.collectives_match else "!="
        print(f"  {c.name:<28} {c.max_error:9.1e}  {c.relative:8.1e}  {cp[0]:>3} {same} {pl.permutes:<3} "
              f"carrying all {pl.transfers:<3} sends {'':9}  {pl.n_res} / {max(pl.schedule.peak_in_flight)}")
    print("  (gradients all-reduced over dp once per step: 1 all-reduce of the stage's weights + loss)")


def demo_steps():
    print("\n== demo 3: the SPMD steps of 1F1B (p=4, m=6): each device's own order, B lane then F lane ==")
    print(plan.ascii_steps(plan.plan(schedule.make("1f1b", 4, 6))))


def demo_memory():
    print("\n== demo 4: compiled temp memory at a fixed microbatch (32 rows x 256), pp=4 ==")
    params = stage.mlp_params(8, 256)
    m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])
    act = 32 * 256 * 4
    print(f"  {'m':>3}  {'1F1B':>14}  {'GPipe baseline':>16}   (in microbatch activations)")
    first = {}
    for m in (4, 8, 16):
        batch = (jax.ShapeDtypeStruct((32 * m, 256), jnp.float32),) * 2
        one = runtime.pipeline(schedule.make("1f1b", 4, m), stage.mlp_stage, params, batch, mesh=m4,
                               input_grads=False)
        base = baseline.gpipe_baseline(stage.mlp_stage, params, batch, mesh=m4, microbatches=m)
        temps = [pipe.step.lower(runtime.to_stages(params, pipe.schedule), *batch, None, None).compile()
                 .memory_analysis().temp_size_in_bytes / act for pipe in (one, base)]
        first = first or dict(zip(("1f1b", "base"), temps))
        print(f"  {m:>3}  {temps[0]:8.1f} ({temps[0] / first['1f1b']:4.2f}x)  {temps[1]:10.1f} "
              f"({temps[1] / first['base']:4.2f}x)")
    print("  1F1B keeps at most p microbatches' residuals whatever m is; the baseline keeps every step's\n"
          "  (its fixed part is smaller: no slot buffers, so it wins at m = 4 and loses from m = 8 on)")


def demo_bad_input():
    print("\n== demo 5: bad input ==")
    params = stage.mlp_params(6, 16)
    batch = stage.mlp_batch(8, 16)
    m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])
    for what, call in [
        ("6 layers on 4 stages", lambda: runtime.run(schedule.make("1f1b", 4, 4), stage.mlp_stage, params, batch, mesh=m4)),
        ("8 rows in 3 microbatches", lambda: runtime.run(schedule.make("1f1b", 4, 3), stage.mlp_stage,
                                                         stage.mlp_params(8, 16), batch, mesh=m4)),
        ("a schedule for p=2 on pp=4", lambda: runtime.run(schedule.make("1f1b", 2, 4), stage.mlp_stage,
                                                           stage.mlp_params(8, 16), batch, mesh=m4)),
    ]:
        try:
            call()
            print(f"  {what}: no error (FAIL)")
        except ConfigError as e:
            print(f"  {what}: ConfigError: {e}")


def demo_scale():
    print("\n== demo 6: one scan whatever m (16 x Linear(64), 4-row microbatches, pp=4) ==")
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stage.mlp_params(16, 64))
    m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])
    for name in ("1f1b", "dualpipe-v"):
        row = []
        for m in (8, 64):
            x = jax.ShapeDtypeStruct((4 * m, 64), jnp.float32)
            start = time.perf_counter()
            pipe = runtime.pipeline(schedule.make(name, 4, m), stage.mlp_stage, params, (x, x), mesh=m4,
                                    input_grads=False)
            staged = jax.eval_shape(lambda q, s=pipe.schedule: runtime.to_stages(q, s), params)
            temp = pipe.step.lower(staged, x, x, None, None).compile().memory_analysis().temp_size_in_bytes
            row.append(f"m={m}: {pipe.plan.scans} scan of {pipe.plan.steps:>3} steps, compiled in "
                       f"{time.perf_counter() - start:.1f} s, temp {temp / 1e6:.2f} MB")
        print(f"  {name:<10} " + " | ".join(row))
    params, batch = stage.mlp_params(8, 64), stage.mlp_batch(32, 64)
    s = schedule.make("1f1b", 4, 8)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(runtime.run(s, stage.mlp_stage, params, batch, mesh=m4))
        times.append(time.perf_counter() - start)
    print("  runtime.run three times in a loop: " + ", ".join(f"{t:.2f} s" for t in times)
          + " (built and compiled once, then cached)")



def demo_nnx():
    print("\n== demo 7: a flax NNX block as the stage, 1F1B ==")
    r = verify.check_nnx(p=2)
    print(f"  flax NNX blocks under 1F1B: max error {r.max_error:.1e}, "
          f"{r.measured['step']['collective-permute'][0]} collective-permutes = plan  {'ok' if r.passed else 'FAIL'}")


if __name__ == "__main__":
    demo_lecture_model()
    demo_every_schedule()
    demo_steps()
    demo_memory()
    demo_bad_input()
    demo_scale()
    demo_nnx()
