"""Context parallelism: ring attention, zigzag load balancing, Ulysses (lecture section 5).

    python examples/05_context_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
05_ring_attention.py, here on real devices instead of simulated in one process:
  demo 1  exercise 6: two blocks of scores merged by log-sum-exp (25.75);
  demo 2  causal ring attention over cp=4 (dp fills the rest), contiguous and zigzag:
          output and dQ, dK, dV vs the unsharded attention, in float32 and float64
          (lecture: 1.1e-15), and the cp-1 K/V permutes of the compiled program;
  demo 3  the load balance of lecture 5.3: per-rank causal work, contiguous vs zigzag;
  demo 4  DeepSpeed-Ulysses (4 all-to-alls) and 2-D context parallelism (Ulysses x ring);
  demo 5  exercise 6b, compute vs communication per ring step as the sequence grows,
          and the compiled memory: no T x T score matrix on any device;
then a mesh that does not divide the sequence, refused before any compute.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar import comms, context, reference  # noqa: E402
from jaxpar.context import verify, zigzag  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.testing import max_abs_diff  # noqa: E402


def demo_merge():
    ex = verify.exercise_6()
    print("Demo 1: online softmax, exercise 6 (scores [1, 2] | [3], values [10, 20] | [30])")
    print(f"  block 1: lse {ex['lse1']:.4f}, o {ex['o1']:.3f}   (lecture 2.3133, 17.311)")
    print(f"  block 2: lse {ex['lse2']:.4f}, o {ex['o2']:.3f}   (lecture 3, 30)")
    print(f"  merged:  lse {ex['lse']:.4f}, o {ex['o']:.2f}    (lecture 3.4076, 25.75); "
          f"softmax([1,2,3]).[10,20,30] = {ex['direct']:.2f}")


def demo_ring(m):
    cp, dp = mesh.axis_size(m, mesh.CP), mesh.axis_size(m, mesh.DP)
    print(f"\nDemo 2: causal ring attention on {mesh.describe(m)}, B={2 * dp} T=64 N=8 K=2 (GQA) H=8")
    for layout in zigzag.LAYOUTS:
        run = verify.run_attention("ring", m, layout=layout, batch_size=2 * dp, seq_len=64, head_dim=8)
        with jax.enable_x64(True):
            run64 = verify.run_attention("ring", m, layout=layout, batch_size=2 * dp, seq_len=64, head_dim=8,
                                         dtype=jnp.float64)
            err64 = max_abs_diff(run64.out, run64.ref)
        print(f"  {layout:10s}  max |ring - full| f32 {run.max_error:.1e}, f64 {err64:.1e} (lecture 1.1e-15); "
              f"fwd {run.forward.format()} | bwd {run.backward.format()}"
              f"{' = formula' if run.collectives_match else ' != formula'}")
    print(f"  forward: {cp - 1} K/V permutes (cp-1), the zigzag run adds 6 to reorder natural order in and out; "
          f"backward: cp-1 K/V + cp dK/dV")


def demo_balance(cp=4, T=8192):
    print(f"\nDemo 3: causal work per rank, T={T}, cp={cp} (lecture 5.3)")
    reports = {layout: zigzag.load_report(T, cp, layout) for layout in zigzag.LAYOUTS}
    print("  rank  " + "  ".join(f"{layout:>22s}" for layout in reports))
    for i in range(cp):
        cells = [f"{r.useful[i] / sum(r.useful):6.1%} of pairs, {r.steps_busy[i]} steps" for r in reports.values()]
        print(f"  {i:4d}  " + "  ".join(f"{c:>22s}" for c in cells))
    print(f"  busiest / mean: contiguous {reports['contiguous'].imbalance:.2f}, zigzag "
          f"{reports['zigzag'].imbalance:.2f} (rank i holds chunks i and {2 * cp - 1}-i of {2 * cp})")


def demo_ulysses(dp):
    print("\nDemo 4: Ulysses (sequence-split -> head-split, full attention, back) and 2-D context parallelism")
    m = mesh.make_mesh(dp=n // 4, cp=4) if n >= 4 else mesh.make_mesh(cp=n)
    run = verify.run_attention("ulysses", m, batch_size=2 * mesh.axis_size(m, mesh.DP), seq_len=64)
    print(f"  Ulysses on {mesh.describe(m)}: max diff {run.max_error:.1e}; fwd {run.forward.format()} | "
          f"bwd {run.backward.format()}{' = formula' if run.collectives_match else ' != formula'}")
    if n >= 8:
        m2 = mesh.make_mesh(dp=n // 4, cp=2, ucp=2)
        run = verify.run_attention("hybrid", m2, layout="zigzag", batch_size=2 * (n // 4), seq_len=64)
        print(f"  Ulysses over ucp x zigzag ring over cp on {mesh.describe(m2)}: max diff {run.max_error:.1e}; "
              f"fwd {run.forward.format()}{' = formula' if run.collectives_match else ' != formula'}")


def demo_costs(m):
    print("\nDemo 5: one ring step, compute vs communication (exercise 6b), Llama-3-8B-like heads, cp=8, bf16")
    cfg = reference.ModelConfig(n_heads=32, n_kv_heads=8, head_dim=128, d_model=4096)
    for T in (8192, 32768, 131072):
        s = context.ring_step(cfg=cfg, batch_size=1, seq_len=T, dtype=jnp.bfloat16, cp=8)
        print(f"  T={T:6d}: c={s['tokens_per_device']:5d} tokens/device, {s['flops'] / 1e9:8.1f} GFLOP vs "
              f"{comms.human_bytes(s['bytes'])} sent: {s['flops_per_byte']:6.0f} FLOP/byte")
    print("  FLOPs grow as c^2, bytes as c: the longer the sequence, the easier the transfer hides")
    B, T, N, H = 2 * mesh.axis_size(m, mesh.DP), 2048, 2, 8
    q, k, v, do = verify.attention_inputs(B, T, N, N, H)
    step = lambda f: jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    temp = lambda f: step(f).lower(q, k, v, do).compile().memory_analysis().temp_size_in_bytes
    ring_t = temp(lambda q, k, v: context.ring_attention(q, k, v, mesh=m, layout="zigzag"))
    dense_t = temp(lambda q, k, v: reference.attention(q, k, v))
    one = B * N * T * T * 4
    print(f"  fwd+bwd temp memory at T={T}: ring {comms.human_bytes(ring_t)} per device; one device's dense "
          f"attention {comms.human_bytes(dense_t)}; one T x T score matrix {comms.human_bytes(one)}")


def main():
    m, note = verify.default_mesh()
    print(f"{n} devices, mesh {mesh.describe(m)}{f' ({note})' if note else ''}\n")
    demo_merge()
    demo_ring(m)
    demo_balance()
    demo_ulysses(mesh.axis_size(m, mesh.DP))
    demo_costs(m)
    print("\nBad input: T=30 over cp=4 in the zigzag layout")
    q = jnp.zeros((2, 30, 8, 4))
    try:
        context.ring_attention(q, q, q, mesh=m, layout="zigzag")
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    main()
