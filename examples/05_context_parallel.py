"""Context parallelism: ring attention, zigzag load balancing, Ulysses (lecture section 5).

    python examples/05_context_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
05_ring_attention.py, here on real devices instead of simulated in one process. Opens
with the technique:
  demo 1  causal ring attention over cp=4 (dp fills the rest): the per-shard function
          (context.ring_attention_shard) in a shard_map, the tokens in zigzag order as a
          data loader delivers them; output and dQ, dK, dV vs reference.attention, in
          float32 and float64 (lecture: 1.1e-15), and the cp-1 K/V permutes forward,
          cp-1 + cp backward, of the compiled programs against the formula;
  demo 2  exercise 6: two blocks of scores merged by log-sum-exp (25.75);
  demo 3  the load balance of lecture 5.3: per-rank causal work, contiguous vs zigzag;
  demo 4  DeepSpeed-Ulysses (4 all-to-alls) and 2-D context parallelism (Ulysses x ring);
  demo 5  exercise 6b, compute vs communication per ring step as the sequence grows,
          and the compiled memory: no T x T score matrix on any device;
then a mesh that does not divide the sequence, refused before any compute.
Both layouts, natural order in and out, Ulysses and 2-D as one table: `jaxpar verify cp`
and `jaxpar verify ulysses`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

from functools import cache, partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import comms, context, reference  # noqa: E402
from jaxpar.context import verify, zigzag  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.testing import compiled_collectives, fwd_bwd, max_abs_diff  # noqa: E402

N, K, H = 8, 2, 8        # query heads, KV heads (grouped-query), head dim


def ring_attention(m, layout: str):
    """Causal ring attention over mesh m's cp axis: the per-shard function in a shard_map.
    q [B, T, N, H], k and v [B, T, K, H] arrive with their tokens in `layout` order
    (zigzag.to_layout); each device holds [B/dp, T/cp, ., H] and the output likewise."""
    spec = P(mesh.DP, mesh.CP, None, None)              # batch over dp, tokens over cp
    shard = partial(context.ring_attention_shard, axis=mesh.CP, causal=True, layout=layout)
    return jax.shard_map(shard, mesh=m, in_specs=(spec,) * 3, out_specs=spec)


@cache
def value_and_grads(fn):
    """(q, k, v, do) -> (fn(q, k, v), (dQ, dK, dV)) for the cotangent do, as one jitted
    program (one per fn: the reference's compiles once per shape and dtype)."""
    def step(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, vjp(do)
    return jax.jit(step)


def draw(B, T, dtype=np.float32, seed=0):
    """q, k, v, do ~ N(0, 1) as numpy arrays: no RNG kernel, and reordering them (zigzag)
    compiles nothing."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, heads, H)).astype(dtype) for heads in (N, K, K, N)]


def demo_ring(m):
    cp, dp = mesh.axis_size(m, mesh.CP), mesh.axis_size(m, mesh.DP)
    B, T = 2 * dp, 64
    print(f"Demo 1: causal ring attention on {mesh.describe(m)}, B={B} T={T} N={N} K={K} (GQA) H={H}, tokens in "
          f"zigzag order (rank i holds chunks i and {2 * cp - 1}-i of {2 * cp})")
    into = partial(zigzag.to_layout, cp=cp, layout="zigzag")          # [B, T, ., H] reordered along T
    back = partial(zigzag.from_layout, cp=cp, layout="zigzag")
    q, k, v, do = draw(B, T)
    (o, grads), (fwd, bwd) = fwd_bwd(ring_attention(m, "zigzag"), *map(into, (q, k, v)), ct=into(do))
    o, grads = jax.tree.map(lambda a: back(np.asarray(a)), (o, grads))      # natural order, on the host
    o_ref, grads_ref = value_and_grads(reference.attention)(q, k, v, do)
    errors = [max_abs_diff(o, o_ref)] + [max_abs_diff(g, r) for g, r in zip(grads, grads_ref)]
    print("  f32 max diff vs reference.attention: " + ", ".join(
        f"{name} {e:.1e}" for name, e in zip(("out", "dQ", "dK", "dV"), errors)))
    with jax.enable_x64(True):
        q, k, v, do = draw(B, T, np.float64)
        ours = value_and_grads(ring_attention(m, "zigzag"))(*map(into, (q, k, v, do)))
        ours = jax.tree.map(lambda a: back(np.asarray(a)), ours)
        err64 = max_abs_diff(ours, value_and_grads(reference.attention)(q, k, v, do))
    print(f"  f64 max |ring - full| over out, dQ, dK, dV {err64:.1e} (lecture 1.1e-15)")
    cfg = reference.ModelConfig(n_heads=N, n_kv_heads=K, head_dim=H)
    want = partial(context.ring_collectives, cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp, cp=cp,
                   layout="zigzag")
    for part, got, formula in (("forward", fwd, want()), ("backward", bwd, want(backward=True))):
        print(f"  {part:8s}: {comms.format_stats(got)}  {'= formula' if got == formula else '!= formula'}")
    print(f"  forward: cp-1 = {cp - 1} K/V permutes; backward: cp-1 K/V + cp dK/dV (context.ring_attention takes "
          "natural order and adds 6 to reorder in and out)")


def demo_merge():
    ex = verify.exercise_6()
    print("\nDemo 2: online softmax, exercise 6 (scores [1, 2] | [3], values [10, 20] | [30])")
    print(f"  block 1: lse {ex['lse1']:.4f}, o {ex['o1']:.3f}   (lecture 2.3133, 17.311)")
    print(f"  block 2: lse {ex['lse2']:.4f}, o {ex['o2']:.3f}   (lecture 3, 30)")
    print(f"  merged:  lse {ex['lse']:.4f}, o {ex['o']:.2f}    (lecture 3.4076, 25.75); "
          f"softmax([1,2,3]).[10,20,30] = {ex['direct']:.2f}")


def demo_balance(cp=4, T=8192):
    print(f"\nDemo 3: causal work per rank, T={T}, cp={cp} (lecture 5.3)")
    reports = {layout: zigzag.load_report(T, cp, layout) for layout in zigzag.LAYOUTS}
    print("  rank  " + "  ".join(f"{layout:>22s}" for layout in reports))
    for i in range(cp):
        cells = [f"{r.useful[i] / sum(r.useful):6.1%} of pairs, {r.steps_busy[i]} steps" for r in reports.values()]
        print(f"  {i:4d}  " + "  ".join(f"{c:>22s}" for c in cells))
    print(f"  busiest / mean: contiguous {reports['contiguous'].imbalance:.2f}, zigzag "
          f"{reports['zigzag'].imbalance:.2f} (rank i holds chunks i and {2 * cp - 1}-i of {2 * cp})")


def demo_ulysses(m):
    print("\nDemo 4: Ulysses (sequence-split -> head-split, full attention, back) and 2-D context parallelism")
    cp, dp = mesh.axis_size(m, mesh.CP), mesh.axis_size(m, mesh.DP)
    B, T = 2 * dp, 64
    cfg = reference.ModelConfig(n_heads=N, n_kv_heads=K, head_dim=H)
    q, k, v, do = draw(B, T)
    (o, grads), (fwd, bwd) = fwd_bwd(partial(context.ulysses_attention, mesh=m), q, k, v, ct=do)
    err = max_abs_diff((o, grads), value_and_grads(reference.attention)(q, k, v, do))
    kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp)
    ok = fwd == context.ulysses_collectives(**kw, cp=cp) and bwd == context.ulysses_collectives(**kw, cp=cp,
                                                                                              backward=True)
    print(f"  Ulysses on {mesh.describe(m)}: max diff {err:.1e}; fwd {comms.format_stats(fwd)} | "
          f"bwd {comms.format_stats(bwd)}{' = formula' if ok else ' != formula'}")
    if n >= 8:
        m2 = mesh.make_mesh(dp=n // 4, cp=2, ucp=2)
        hybrid = jax.jit(partial(context.hybrid_attention, mesh=m2, layout="zigzag"))
        compiled = hybrid.lower(q, k, v).compile()
        fwd = compiled_collectives(compiled)
        err = max_abs_diff(compiled(q, k, v), value_and_grads(reference.attention)(q, k, v, do)[0])
        want = context.hybrid_collectives(**kw, cp=2, ucp=2, layout="zigzag", permute=True)
        print(f"  Ulysses over ucp x zigzag ring over cp on {mesh.describe(m2)}: max diff {err:.1e}; "
              f"fwd {comms.format_stats(fwd)}{' = formula' if fwd == want else ' != formula'}")


def demo_costs(m):
    print("\nDemo 5: one ring step, compute vs communication (exercise 6b), Llama-3-8B-like heads, cp=8, bf16")
    cfg = reference.ModelConfig(n_heads=32, n_kv_heads=8, head_dim=128, d_model=4096)
    for T in (8192, 32768, 131072):
        s = context.ring_step(cfg=cfg, batch_size=1, seq_len=T, dtype=jnp.bfloat16, cp=8)
        print(f"  T={T:6d}: c={s['tokens_per_device']:5d} tokens/device, {s['flops'] / 1e9:8.1f} GFLOP vs "
              f"{comms.human_bytes(s['bytes'])} sent: {s['flops_per_byte']:6.0f} FLOP/byte")
    print("  FLOPs grow as c^2, bytes as c: the longer the sequence, the easier the transfer hides")
    B, T, heads = 2 * mesh.axis_size(m, mesh.DP), 1024, 2
    args = [jax.ShapeDtypeStruct((B, T, heads, H), jnp.float32)] * 4        # q, k, v, do: shapes only
    temp = lambda fn: value_and_grads(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    ring_t = temp(ring_attention(m, "zigzag"))
    dense_t = temp(reference.attention)
    one = B * heads * T * T * 4
    print(f"  fwd+bwd temp memory at T={T}: ring {comms.human_bytes(ring_t)} per device; one device's dense "
          f"attention {comms.human_bytes(dense_t)}; one T x T score matrix {comms.human_bytes(one)}")


def main():
    cp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    m = mesh.make_mesh(dp=n // cp, cp=cp)              # 8 devices: dp=2 x cp=4
    print(f"{n} devices, mesh {mesh.describe(m)}\n")
    demo_ring(m)
    demo_merge()
    demo_balance()
    demo_ulysses(m)
    demo_costs(m)
    print("\nBad input: T=30 over cp=4 in the zigzag layout")
    q = jnp.zeros((2, 30, 8, 4))
    try:
        context.ring_attention(q, q, q, mesh=m, layout="zigzag")
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    main()
