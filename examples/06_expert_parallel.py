"""Expert parallelism: top-k routing, all-to-all dispatch and combine, capacity and load (lecture section 6).

    python examples/06_expert_parallel.py

On 8 fake CPU devices unless XLA_FLAGS sets another count. `expert.ep_moe` on dp x ep against
reference.moe (output, every gradient, the 2 + 2 all-to-alls against the formula); the lecture's
skewed router on 4 ranks and what capacity drops; exercise 7; DeepSeek-V3's bias; a bad input.
Per-shard code: `expert.ep_moe_shard`. Both drop rules, exercise 9(c)'s sweep: `jaxpar verify ep`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import comms, expert, reference  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.expert import verify  # noqa: E402
from jaxpar.testing import fwd_bwd, max_abs_diff  # noqa: E402

CFG = reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=8, top_k=2)   # GeLU experts


def lesson(m):
    dp, ep = mesh.axis_size(m, mesh.DP), mesh.axis_size(m, mesh.EP)
    B, T = 2 * dp * ep, 8
    p, x, dy = verify.moe_inputs(CFG, B, T, skew=1.0)           # router [D, E], w_up [E, D, F], w_down [E, F, D]
    y, stats = jax.jit(lambda p, x: expert.ep_moe(p, x, mesh=m, cfg=CFG))(p, x)    # dropless: capacity_factor=None
    (_, (grads, dx)), (fwd, bwd) = fwd_bwd(lambda p, x: expert.ep_moe(p, x, mesh=m, cfg=CFG)[0], p, x, ct=dy)
    y_ref, vjp = jax.vjp(lambda p, x: reference.moe(p, x, top_k=CFG.top_k), p, x)
    g_ref, dx_ref = vjp(dy)
    print(f"expert.ep_moe: E={CFG.n_experts} top-{CFG.top_k}, {B * T} tokens on {mesh.describe(m)} "
          "(tokens over dp x ep, experts over ep), against reference.moe")
    for name, ours, ref in [("y", y, y_ref), ("dx", dx, dx_ref), ("d router", grads["router"], g_ref["router"]),
                            ("d experts", (grads["w_up"], grads["w_down"]), (g_ref["w_up"], g_ref["w_down"]))]:
        print(f"  {name:<10} max diff {max_abs_diff(ours, ref):.1e}")
    print(f"  (lecture: about 1e-7); dropped {stats.drop_rate:.0%}")
    kw = dict(cfg=CFG, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp, ep=ep)
    ok = fwd == expert.ep_moe_collectives(**kw) and bwd == expert.ep_moe_collectives(**kw, backward=True)
    print(f"  fwd {comms.format_stats(fwd)} | bwd {comms.format_stats(bwd)}{' = formula' if ok else ' != formula'}"
          " (backward: the router's gradient all-reduced, the experts' over dp)")


def demo_imbalance():
    print("\nThe lecture's experiment: 4 ranks, 8 experts (2 per rank), top-2, a skewed router, 1024 tokens")
    m = mesh.make_mesh(ep=4, devices=jax.devices()[:4])
    cfg = reference.ModelConfig(n_layers=1, d_model=32, d_ff=64, n_experts=8, top_k=2)
    p, x, _ = verify.moe_inputs(cfg, 16, 64, skew=2.0)            # the router favours the first experts
    for cf in (None, 1.25, 1.0):                                  # C = ceil(cf x t k / E) slots per expert
        _, s = jax.jit(lambda p, x: expert.ep_moe(p, x, mesh=m, cfg=cfg, capacity_factor=cf))(p, x)
        name = "dropless" if cf is None else f"capacity {cf}"
        print(f"  {name:<13} token-slots per rank {str(s.tokens_per_rank.tolist()):<22} the busiest rank works "
              f"{s.imbalance:.2f}x the mean, dropped {s.drop_rate:.1%}")


def demo_bytes():
    ex = expert.exercise_7()
    print("\nExercise 7, DeepSeek-V3 MoE layer (D=7168, k=8, 4096 tokens per GPU, EP=64, bf16)")
    print(f"  dispatch {ex['dispatch'] / 1e6:.0f} MB (lecture about 462 MB); forward {ex['forward'] / 1e9:.2f} GB "
          f"(0.92 GB); forward + backward {ex['forward_backward'] / 1e9:.2f} GB (1.85 GB)")
    c = [expert.ep_moe_collectives(cfg=reference.ModelConfig(n_layers=1, d_model=512, d_ff=F, n_experts=8, top_k=2),
                                   batch_size=8, seq_len=512, dtype=jnp.float32, dp=2, ep=4, capacity_factor=1.25)
         for F in (2048, 4096)]
    print(f"  forward at d_ff=2048 {c[0].format()}, at d_ff=4096 {c[1].format()}: the all-to-all carries "
          "tokens x k x D, not the experts' width")


def demo_bias(steps=300):
    print("\nDeepSeek-V3 balancing: sigmoid router, per-expert bias nudged by load (no aux loss)")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1024, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 8)) / 4, jnp.float32).at[:, :2].add(0.5)
    load = jax.jit(lambda b: expert.expert_load(expert.route(w, x, top_k=2, scoring="sigmoid", bias=b).experts, 8))
    bias, first = jnp.zeros(8), np.asarray(load(jnp.zeros(8)))
    for _ in range(steps):
        bias = expert.update_bias(bias, np.asarray(load(bias)), rate=0.01)
    for step, l in ((0, first), (steps, np.asarray(load(bias)))):
        print(f"  load per expert, step {step:>3}: {l.tolist()} (busiest/mean {l.max() / l.mean():.2f})")


if __name__ == "__main__":
    ep = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    # 8 devices: dp=2 x ep=4 (no dp axis of size 1: XLA would keep the gradient all-reduce over it)
    m = mesh.make_mesh(dp=n // ep, ep=ep) if n // ep > 1 else mesh.make_mesh(ep=ep)
    print(f"{n} devices, mesh {mesh.describe(m)}\n")
    lesson(m)
    if n >= 4:
        demo_imbalance()
    demo_bytes()
    demo_bias()
    print("\nBad input: 6 experts over ep=4")
    p = {"router": jnp.zeros((16, 6)), "w_up": jnp.zeros((6, 16, 32)), "w_down": jnp.zeros((6, 32, 16))}
    try:
        expert.ep_moe(p, jnp.zeros((8, 4, 16)), mesh=mesh.make_mesh(dp=n // 4, ep=4) if n >= 4 else m,
                      cfg=reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=6, top_k=2))
    except ConfigError as e:
        print(f"  ConfigError: {e}")
