"""Pipeline parallelism, run for real (lecture section 2.4).

    python examples/02_pipeline_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count (4 at least). Mirrors
the lecture's 02_pipeline_parallel.py, lecture figures beside jaxpar's. Opens with the
technique: the lecture's model (8 x Linear(1024), 2 layers per stage on 4 stages) as a
per-layer function, `runtime.run` executing 1F1B for m = 1, 4, 8 on pp=4 in float64,
against one device's whole-batch gradients (lecture: below 1e-9). Then:
  demo 2  every schedule of 01_pipeline_schedules.py as the runtime's plan (the
          collective-permutes, the sends they carry, residual slots vs the peak in
          flight), and DualPipe-V executed (one SPMD program: lax.scan over steps,
          lax.switch over F / B / W / idle, ppermute between stages) against one device;
  demo 3  the SPMD steps the runtime runs for 1F1B (backward lane, then forward lane);
  demo 4  compiled temp memory as m grows at a fixed microbatch: 1F1B flat, the GPipe
          baseline (forward scan + autodiff) growing with m;
  demo 5  bad input: a ConfigError before anything compiles;
  demo 6  the program at scale: one scan whatever m (compile seconds and temp memory of
          1F1B at m = 8 and 64), the built step cached by runtime.run;
  demo 7  a user's own flax NNX block as the stage. The reference model's Megatron blocks
          as per-shard stages, trained on dp x pp x tp x cp x ep: examples/08_train_4d.py.
More schedules and models against the unsharded one: `jaxpar verify pp`. Step time
against m (the lecture's "m = 4 was fastest") is a benchmark: `python -m benchmarks.pipeline`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline import baseline, modules, plan, runtime, stage  # noqa: E402
from jaxpar.schedules import schedule
from jaxpar.testing import close, compiled_collectives, max_abs_diff  # noqa: E402


def layer(p, x):
    """One layer of the lecture's model on one microbatch: x [rows, 1024] -> Linear + ReLU."""
    return jax.nn.relu(x @ p["w"] + p["b"])           # p["w"] [1024, 1024], p["b"] [1024]


def lesson():
    print("== demo 1: the lecture's 8 x Linear(1024), 4 stages x 2 layers, 1F1B, float64 ==")
    m = mesh.make_mesh(pp=4, devices=jax.devices()[:4])   # 4 pipeline stages, one per device
    stage_fn = runtime.layers(layer)     # a stage runs its layers in order: w [2, 1024, 1024] on each device
    with jax.enable_x64(True):
        params = stage.mlp_params(8, 1024, jnp.float64)  # {"w": [8, 1024, 1024], "b": [8, 1024]}: layers first
        batch = stage.mlp_batch(64, 1024, jnp.float64)   # (inputs, targets), [64, 1024] each
        ref_loss, ref = stage.unsharded(stage_fn, params, batch)    # one device: jax.value_and_grad, whole batch
        for mb in (1, 4, 8):             # microbatches of 64/mb rows
            s = schedule.make("1f1b", stages=4, microbatches=mb)
            loss, grads = runtime.run(s, stage_fn, params, batch, mesh=m)   # grads.params, grads.inputs [64, 1024]
            err = max_abs_diff((loss, grads), (ref_loss, ref))
            print(f"  m={mb}: max |pipeline - single device| over loss, dx, all weights = {err:.1e} "
                  f"(lecture: below 1e-9)  {'ok' if err < 1e-9 else 'FAIL'}")


def demo_every_schedule():
    p = 4
    dp = 2 if n >= 2 * p else 1
    print(f"\n== demo 2: every schedule as the runtime's plan (p={p}), DualPipe-V executed on dp={dp} x pp={p} ==")
    print(f"  {'schedule':<12} {'m':>2}  collective-permutes carrying sends  residual slots / peak in flight")
    cases = [("naive", p), ("gpipe", 8), ("1f1b", 8), ("interleaved", 8), ("zb-h1", 8), ("zb-h2", 8),
             ("dualpipe-v", 8)]
    for name, m in cases:                              # pure Python: the plan the scan reads, nothing compiled
        pl = plan.plan(schedule.make(name, p, m))
        print(f"  {name:<12} {m:>2}  {pl.permutes:>3} carrying all {pl.transfers:<3} sends {'':11}"
              f"{pl.n_res} / {max(pl.schedule.peak_in_flight)}")
    m8 = mesh.make_mesh(dp=dp, pp=p, devices=jax.devices()[:dp * p])
    params, batch = stage.mlp_params(8, 32), stage.mlp_batch(32, 32)    # the lecture MLP at width 32
    pipe = runtime.pipeline(schedule.make("dualpipe-v", p, 8), stage.mlp_stage, params, batch, mesh=m8)
    loss, grads = runtime.run_pipeline(pipe, params, batch)
    ref = stage.unsharded(stage.mlp_stage, params, batch)                # one device: the whole batch
    err = max_abs_diff((loss, grads), ref)
    compiled = pipe.step.lower(runtime.to_stages(params, pipe.schedule), *batch, None, None).compile()
    sent = compiled_collectives(compiled, pipe.plan.runs())["collective-permute"][0]   # each as often as it runs
    ok = close((loss, grads), ref) and sent == pipe.plan.permutes
    print(f"  DualPipe-V executed, NaN in every unused slot: max |pipeline - single device| {err:.1e}, "
          f"compiled collective-permutes {sent} {'=' if sent == pipe.plan.permutes else '!='} plan "
          f"{pipe.plan.permutes}  {'ok' if ok else 'FAIL'}")
    print("  (gradients all-reduced over dp once per step: 1 all-reduce of the stage's weights + loss)\n"
          "  every schedule executed and compared the same way: jaxpar verify pp")


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
    print("\n== demo 6: one scan whatever m (16 x Linear(64), 4-row microbatches, 1F1B on pp=4) ==")
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stage.mlp_params(16, 64))
    m4 = mesh.make_mesh(pp=4, devices=jax.devices()[:4])
    for m in (8, 64):
        x = jax.ShapeDtypeStruct((4 * m, 64), jnp.float32)
        start = time.perf_counter()
        pipe = runtime.pipeline(schedule.make("1f1b", 4, m), stage.mlp_stage, params, (x, x), mesh=m4,
                                input_grads=False)
        staged = jax.eval_shape(lambda q, s=pipe.schedule: runtime.to_stages(q, s), params)
        temp = pipe.step.lower(staged, x, x, None, None).compile().memory_analysis().temp_size_in_bytes
        print(f"  m={m}: {pipe.plan.scans} scan of {pipe.plan.steps:>3} steps, compiled in "
              f"{time.perf_counter() - start:.1f} s, temp {temp / 1e6:.2f} MB")
    params, batch = stage.mlp_params(8, 64), stage.mlp_batch(32, 64)
    s = schedule.make("1f1b", 4, 8)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(runtime.run(s, stage.mlp_stage, params, batch, mesh=m4))
        times.append(time.perf_counter() - start)
    print("  runtime.run three times in a loop: " + ", ".join(f"{t:.2f} s" for t in times)
          + " (built and compiled once, then cached)")


class Block(nnx.Module):
    """A user's own block (RMSNorm, MLP, residual), as a flax NNX module: x [rows, d] -> [rows, d]."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


def demo_nnx():
    print("\n== demo 7: a flax NNX block as the stage, 1F1B over pp=2, 4 microbatches ==")
    blocks = [Block(16, nnx.Rngs(i)) for i in range(4)]       # one module per layer, 2 per stage
    stage_fn, params = modules.nnx_layers(blocks)             # params: an nnx.State, leaves [4, ...]
    x, t = stage.mlp_batch(8, 16)                             # [8, 16] each: microbatches of 2 rows
    pipe = runtime.pipeline(schedule.make("1f1b", 2, 4), stage_fn, params, (x, t),   # what runtime.run builds,
                            mesh=mesh.make_mesh(pp=2, devices=jax.devices()[:2]))  # held here for its plan
    loss, grads = runtime.run_pipeline(pipe, params, (x, t))  # grads.params: an nnx.State like params

    @nnx.jit
    def unsharded(blocks, x):   # the same modules, one after the other, differentiated by nnx
        def loss(blocks, x):
            for b in blocks:
                x = b(x)
            return jnp.mean(jnp.square(x - t))
        return nnx.value_and_grad(loss, argnums=(0, 1))(blocks, x)
    ref_loss, (ref_blocks, ref_x) = unsharded(nnx.List(blocks), x)
    ours = (loss, grads.inputs, jax.tree.leaves(modules.unstack(grads.params)))   # block by block
    ref = (ref_loss, ref_x, jax.tree.leaves(ref_blocks))
    ok = close(ours, ref)                                     # float32's tolerance, leaf by leaf
    # the compiled step's sends (each guarded ppermute counted as often as it runs) against the plan's
    compiled = pipe.step.lower(runtime.to_stages(params, pipe.schedule), x, t, None, None).compile()
    sent = compiled_collectives(compiled, pipe.plan.runs())["collective-permute"][0]
    same = sent == pipe.plan.permutes
    print(f"  flax NNX blocks under 1F1B vs nnx.value_and_grad of the modules: max error "
          f"{max_abs_diff(ours, ref):.1e}, {sent} collective-permutes "
          f"{'=' if same else '!='} plan  {'ok' if ok and same else 'FAIL'}")


if __name__ == "__main__":
    lesson()
    demo_every_schedule()
    demo_steps()
    demo_memory()
    demo_bad_input()
    demo_scale()
    demo_nnx()
