"""Pipeline parallelism, run for real (lecture section 2.4, script 02_pipeline_parallel.py).

    python examples/02_pipeline_parallel.py     # 8 fake CPU devices unless XLA_FLAGS says (4 at least)

runtime.run executes a schedule of 01_pipeline_schedules.py as one SPMD program and returns the
loss and every gradient, checked here against one device. The rest: every schedule and model
executed, flax NNX blocks as stages: `jaxpar verify pp`; the SPMD steps: `jaxpar schedule 1f1b
--steps`; memory and step time against m: `python -m benchmarks.pipeline`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline import baseline, plan, runtime, stage  # noqa: E402
from jaxpar.schedules import schedule  # noqa: E402
from jaxpar.testing import close, compiled_collectives, max_abs_diff  # noqa: E402


def layer(p, x):
    """One layer of the lecture's model on one microbatch: x [rows, 1024] -> Linear + ReLU."""
    return jax.nn.relu(x @ p["w"] + p["b"])           # p["w"] [1024, 1024], p["b"] [1024]


def compiled(pipe, params, batch):
    """The step runtime.run would run, compiled (shapes are enough)."""
    return pipe.step.lower(runtime.to_stages(params, pipe.schedule), *batch, None, None).compile()


def lesson(m4):
    print("== demo 1: the lecture's 8 x Linear(1024), 4 stages x 2 layers, 1F1B, float64 ==")
    stage_fn = runtime.layers(layer)     # a stage runs its layers in order: w [2, 1024, 1024] on each device
    with jax.enable_x64(True):
        params = stage.mlp_params(8, 1024, jnp.float64)  # {"w": [8, 1024, 1024], "b": [8, 1024]}: layers first
        batch = stage.mlp_batch(64, 1024, jnp.float64)   # (inputs, targets), [64, 1024] each
        ref_loss, ref = stage.unsharded(stage_fn, params, batch)    # one device: jax.value_and_grad, whole batch
        for mb in (1, 4, 8):             # microbatches of 64/mb rows
            s = schedule.make("1f1b", stages=4, microbatches=mb)
            loss, grads = runtime.run(s, stage_fn, params, batch, mesh=m4)   # grads.params, grads.inputs [64, 1024]
            err = max_abs_diff((loss, grads), (ref_loss, ref))
            print(f"  m={mb}: max |pipeline - single device| over loss, dx, all weights = {err:.1e} "
                  f"(lecture: below 1e-9)  {'ok' if err < 1e-9 else 'FAIL'}")


def demo_every_schedule(p=4):
    dp = 2 if n >= 2 * p else 1
    print(f"\n== demo 2: every schedule as the runtime's plan (p={p}), DualPipe-V executed on dp={dp} x pp={p} ==")
    print(f"  {'schedule':<12} {'m':>2}  collective-permutes carrying sends  residual slots / peak in flight")
    for name in ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "dualpipe-v"):
        pl = plan.plan(schedule.make(name, p, p if name == "naive" else 8))    # pure Python: nothing compiled
        print(f"  {name:<12} {pl.schedule.microbatches:>2}  {pl.permutes:>3} carrying all {pl.n_sends:<3} sends "
              f"{'':11}{pl.n_res} / {max(pl.schedule.peak_in_flight)}")
    m8 = mesh.make_mesh(dp=dp, pp=p, devices=jax.devices()[:dp * p])
    params, batch = stage.mlp_params(8, 32), stage.mlp_batch(32, 32)    # the lecture MLP at width 32
    pipe = runtime.pipeline(schedule.make("dualpipe-v", p, 8), stage.mlp_stage, params, batch, mesh=m8)
    loss, grads = runtime.run_pipeline(pipe, params, batch)             # what runtime.run does, pipe kept
    ref = stage.unsharded(stage.mlp_stage, params, batch)
    sent = compiled_collectives(compiled(pipe, params, batch), pipe.plan.runs())["collective-permute"][0]
    ok = close((loss, grads), ref) and sent == pipe.plan.permutes
    print(f"  DualPipe-V executed, NaN in every unused slot: max |pipeline - single device| "
          f"{max_abs_diff((loss, grads), ref):.1e}, compiled collective-permutes {sent} "
          f"{'=' if sent == pipe.plan.permutes else '!='} plan {pipe.plan.permutes}  {'ok' if ok else 'FAIL'}")


def demo_memory(m4):
    print("\n== demo 3: compiled temp memory at a fixed microbatch (32 rows x 256), pp=4 ==")
    params, act, first = stage.mlp_params(8, 256), 32 * 256 * 4, None
    print(f"  {'m':>3}  {'1F1B':>18}  {'GPipe baseline':>18}   (in microbatch activations)")
    for m in (4, 8, 16):
        batch = (jax.ShapeDtypeStruct((32 * m, 256), jnp.float32),) * 2
        pipes = (runtime.pipeline(schedule.make("1f1b", 4, m), stage.mlp_stage, params, batch, mesh=m4,
                                  input_grads=False),
                 baseline.gpipe_baseline(stage.mlp_stage, params, batch, mesh=m4, microbatches=m))
        temps = [compiled(pipe, params, batch).memory_analysis().temp_size_in_bytes / act for pipe in pipes]
        first = first or temps
        print("  " + f"{m:>3}  " + "  ".join(f"{t:10.1f} ({t / f:4.2f}x)" for t, f in zip(temps, first)))
    print("  1F1B keeps at most p microbatches' residuals whatever m is (lecture: p, not m); the baseline\n"
          "  (jax.grad of a scanned forward) keeps every step's")


def demo_bad_input(m4):
    print("\n== demo 4: bad input, refused before anything compiles ==")
    try:
        runtime.run(schedule.make("1f1b", 4, 4), stage.mlp_stage, stage.mlp_params(6, 16), stage.mlp_batch(8, 16),
                    mesh=m4)
        print("  6 layers on 4 stages: no error (FAIL)")
    except ConfigError as e:
        print(f"  6 layers on 4 stages: ConfigError: {e}")


if __name__ == "__main__":
    m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])    # 4 pipeline stages, one per device
    lesson(m4)
    demo_every_schedule()
    demo_memory(m4)
    demo_bad_input(m4)
