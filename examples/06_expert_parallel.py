"""Expert parallelism: top-k routing, all-to-all dispatch and combine, capacity and load (lecture section 6).

    python examples/06_expert_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
06_expert_parallel.py, here on real devices:
  demo 1  the MoE layer over dp x ep (tokens over both, experts over ep), dropless:
          output, input, router and every expert's gradient vs the unsharded MoE
          (lecture: about 1e-7), and the 2 + 2 all-to-alls of the compiled programs;
  demo 2  the lecture's experiment: 4 ranks, 8 experts (2 each), top-2, a skewed router:
          token-slots per rank and how long the busiest rank works against the mean;
  demo 3  exercise 9(c): capacity factors and the share of tokens dropped;
  demo 4  exercise 7: DeepSeek-V3's dispatch bytes, and bytes that ignore the FFN width;
  demo 5  DeepSeek-V3's auxiliary-loss-free balancing (sigmoid router, selection bias);
then experts that ep does not divide, refused before any compute.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import expert, reference  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.expert import verify  # noqa: E402


def demo_parity(m):
    cfg = verify.CFG
    B = 2 * mesh.axis_size(m, mesh.DP) * mesh.axis_size(m, mesh.EP)
    run = verify.run_moe(cfg, m, batch_size=B, skew=1.0)
    errors = run.compared[0]
    print(f"Demo 1: MoE layer, E={cfg.n_experts} top-{cfg.top_k}, {B * 8} tokens on {mesh.describe(m)}, dropless")
    for name, err in errors.items():
        print(f"  {name:10s} max diff {err:.1e}")
    print(f"  (lecture: about 1e-7); dropped {run.stats.drop_rate:.0%}")
    print(f"  fwd {run.forward.format()} | bwd {run.backward.format()}"
          f"{' = formula' if run.collectives_match else ' != formula'}")


def demo_imbalance():
    rows = verify.imbalance_experiment()
    first = rows[0]
    print("\nDemo 2: 4 ranks, 8 experts (2 per rank), top-2, skewed router, 1024 tokens, dropless")
    print(f"  token-slots per rank {first['tokens_per_rank']}: the busiest rank works "
          f"{first['imbalance']:.2f}x the mean, and every layer waits for it")
    print("\nDemo 3: capacity factor vs tokens dropped (exercise 9c)")
    print("  capacity factor  slots/expert  dropped  per rank after drops   busiest/mean")
    for r in rows:
        cf = "dropless" if r["capacity_factor"] is None else f"{r['capacity_factor']:.2f}"
        print(f"  {cf:>15s}  {r['capacity']:12d}  {r['drop_rate']:6.1%}  {str(r['tokens_per_rank']):22s} "
              f"{r['imbalance']:.2f}")


def demo_bytes():
    ex = expert.exercise_7()
    print("\nDemo 4: exercise 7, DeepSeek-V3 MoE layer (D=7168, k=8, 4096 tokens per GPU, EP=64, bf16)")
    print(f"  dispatch {ex['dispatch'] / 1e6:.0f} MB (lecture about 462 MB); forward {ex['forward'] / 1e9:.2f} GB "
          f"(0.92 GB); forward + backward {ex['forward_backward'] / 1e9:.2f} GB (1.85 GB)")
    for F in (2048, 4096):
        cfg = reference.ModelConfig(n_layers=1, d_model=512, d_ff=F, n_experts=8, top_k=2)
        c = expert.ep_moe_collectives(cfg=cfg, batch_size=8, seq_len=512, dtype=jnp.float32, dp=2, ep=4,
                                      capacity_factor=1.25)
        print(f"  d_ff={F}: forward {c.format()} (8 x 512 tokens, D=512, capacity 1.25)")
    print("  the all-to-all carries tokens x k x D: doubling the experts' width changes nothing")


def demo_bias():
    print("\nDemo 5: DeepSeek-V3 balancing: sigmoid router, per-expert bias nudged by load (no aux loss)")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1024, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 8)) / 4, jnp.float32).at[:, :2].add(0.5)
    step = jax.jit(lambda b: expert.expert_load(expert.route(w, x, top_k=2, kind="sigmoid", bias=b).experts, 8))
    bias, first = jnp.zeros(8), None
    for i in range(300):
        load = np.asarray(step(bias))
        first = load if first is None else first
        bias = expert.update_bias(bias, load, rate=0.01)
    print(f"  load per expert, step 0:   {first.tolist()} (busiest/mean {first.max() / first.mean():.2f})")
    print(f"  load per expert, step 300: {load.tolist()} (busiest/mean {load.max() / load.mean():.2f})")


def main():
    m, note = verify.default_mesh()
    print(f"{n} devices, mesh {mesh.describe(m)}{f' ({note})' if note else ''}\n")
    demo_parity(m)
    if n >= 4:
        demo_imbalance()
    demo_bytes()
    demo_bias()
    print("\nBad input: 6 experts over ep=4")
    cfg = reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=6, top_k=2)
    p, x, _ = verify.moe_inputs(cfg, 8, 4)
    try:
        expert.ep_moe(p, x, mesh=mesh.make_mesh(dp=n // 4, ep=4) if n >= 4 else m, cfg=cfg)
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    main()
