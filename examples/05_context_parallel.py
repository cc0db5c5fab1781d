"""Context parallelism: ring attention, zigzag, Ulysses (lecture section 5, script 05_ring_attention.py).

    python examples/05_context_parallel.py     # 8 fake CPU devices (dp=2 x cp=4) unless XLA_FLAGS says

context.ring_attention on real devices (the lecture simulates them in one process) against
reference.attention in float32 and float64, its compiled collectives against the formula;
then exercise 6, the load balance of 5.3, Ulysses, exercise 6b and a refused input. Both
layouts, natural order, Ulysses x ring (2-D) as one table: `jaxpar verify cp|ulysses`; the
memory as T grows (no T x T scores on any device): `python -m benchmarks.context`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import comms, context, reference  # noqa: E402
from jaxpar.context import verify, zigzag  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.testing import fwd_bwd, max_abs_diff, value_and_grads  # noqa: E402

N, K, H = 8, 2, 8        # query heads, KV heads (grouped-query), head dim


def draw(dtype=np.float32):
    """q, k, v, do ~ N(0, 1), [B, T, heads, H], as numpy arrays: no RNG kernel, reordering compiles nothing."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal((B, T, heads, H)).astype(dtype) for heads in (N, K, K, N)]


cp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
dp = n // cp
m = mesh.make_mesh(dp=dp, cp=cp)                    # 8 devices: dp=2 x cp=4
B, T = 2 * dp, 64
cfg = reference.ModelConfig(n_heads=N, n_kv_heads=K, head_dim=H)
kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp)
# tokens in zigzag order, as a data loader delivers them: rank i holds chunks i and 2cp-1-i of 2cp
into, back = (partial(f, cp=cp, layout="zigzag") for f in (zigzag.to_layout, zigzag.from_layout))
natural = lambda tree: jax.tree.map(lambda a: back(np.asarray(a)), tree)   # back to natural order, on the host
ring = partial(context.ring_attention, mesh=m, causal=True, layout="zigzag", relayout=False)
print(f"context.ring_attention on {mesh.describe(m)}, causal, B={B} T={T} N={N} K={K} (GQA) H={H}, tokens in "
      f"zigzag order (rank i holds chunks i and {2 * cp - 1}-i of {2 * cp})")
q, k, v, do = draw()
(o, grads), (fwd, bwd) = fwd_bwd(ring, *map(into, (q, k, v)), ct=into(do))
o, grads = natural((o, grads))
o_ref, grads_ref = value_and_grads(reference.attention, q, k, v, ct=do)      # one device: out, (dQ, dK, dV)
errors = [max_abs_diff(o, o_ref)] + [max_abs_diff(g, r) for g, r in zip(grads, grads_ref)]
print("  f32 max diff vs reference.attention: " + ", ".join(f"{name} {e:.1e}" for name, e in
                                                            zip(("out", "dQ", "dK", "dV"), errors)))
with jax.enable_x64(True):
    q64, k64, v64, do64 = draw(np.float64)
    ours = natural(value_and_grads(ring, *map(into, (q64, k64, v64)), ct=into(do64)))
    err64 = max_abs_diff(ours, value_and_grads(reference.attention, q64, k64, v64, ct=do64))
print(f"  f64 max |ring - full| over out, dQ, dK, dV {err64:.1e} (lecture 1.1e-15)")
for part, got in (("forward", fwd), ("backward", bwd)):
    want = context.ring_collectives(**kw, cp=cp, layout="zigzag", backward=part == "backward")
    print(f"  {part:8s}: {comms.format_stats(got)}  {'= formula' if got == want else '!= formula'}")
print(f"  forward: cp-1 = {cp - 1} K/V permutes; backward: cp-1 K/V + cp dK/dV (relayout=True takes natural "
      "order and adds 6 to reorder in and out)")

ex = verify.exercise_6()
print("\nExercise 6: online softmax, scores [1, 2] | [3], values [10, 20] | [30], merged by log-sum-exp")
print(f"  block 1: lse {ex['lse1']:.4f}, o {ex['o1']:.3f} (lecture 2.3133, 17.311); block 2: lse {ex['lse2']:.4f}, "
      f"o {ex['o2']:.3f} (lecture 3, 30)")
print(f"  merged:  lse {ex['lse']:.4f}, o {ex['o']:.2f}    (lecture 3.4076, 25.75); "
      f"softmax([1,2,3]).[10,20,30] = {ex['direct']:.2f}")

print("\nLecture 5.3: causal work per rank, T=8192, cp=4 (share of the visible query-key pairs)")
reports = {layout: zigzag.load_report(8192, 4, layout) for layout in zigzag.LAYOUTS}
for layout, r in reports.items():
    print(f"  {layout:<10} " + "  ".join(f"{u / sum(r.useful):5.1%}" for u in r.useful))
print(f"  busiest / mean: contiguous {reports['contiguous'].imbalance:.2f}, zigzag {reports['zigzag'].imbalance:.2f}")

print("\nDeepSpeed-Ulysses: all-to-all from sequence-split to head-split, full attention, and back")
(o, grads), (fwd, bwd) = fwd_bwd(partial(context.ulysses_attention, mesh=m), q, k, v, ct=do)
ok = (fwd, bwd) == tuple(context.ulysses_collectives(**kw, cp=cp, backward=b) for b in (False, True))
err = max_abs_diff((o, grads), (o_ref, grads_ref))
print(f"  context.ulysses_attention on {mesh.describe(m)}: max diff {err:.1e}; fwd {comms.format_stats(fwd)} | "
      f"bwd {comms.format_stats(bwd)}{' = formula' if ok else ' != formula'}")

print("\nExercise 6b: one ring step, compute vs communication, Llama-3-8B-like heads, cp=8, bf16: FLOPs grow "
      "as (T/cp)^2, bytes as T/cp")
big = reference.ModelConfig(n_heads=32, n_kv_heads=8, head_dim=128, d_model=4096)
for t in (8192, 32768, 131072):
    s = context.ring_step(cfg=big, batch_size=1, seq_len=t, dtype=jnp.bfloat16, cp=8)
    print(f"  T={t:6d}: {s['flops'] / 1e9:7.1f} GFLOP vs {comms.human_bytes(s['bytes'])} sent: "
          f"{s['flops_per_byte']:6.0f} FLOP/byte")

print(f"\nBad input: T=30 over cp={cp} in the zigzag layout")
try:
    context.ring_attention(*(jnp.zeros((2, 30, 8, 4)),) * 3, mesh=m, layout="zigzag")
except ConfigError as e:
    print(f"  ConfigError: {e}")
