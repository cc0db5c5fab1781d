"""Expert parallelism: top-k routing, all-to-all dispatch and combine, capacity and load (lecture section 6).

    python examples/06_expert_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
06_expert_parallel.py, here on real devices. Opens with the technique:
  demo 1  the MoE layer over dp x ep (tokens over both, experts over ep), dropless,
          written per shard: route, pack each expert's buffer, all-to-all, the local
          experts, all-to-all back, unpack (what expert.ep_moe_shard does), in a
          shard_map; output, input, router and every expert's gradient vs reference.moe
          (lecture: about 1e-7), and the 2 + 2 all-to-alls of the compiled programs;
  demo 2  the lecture's experiment: 4 ranks, 8 experts (2 each), top-2, a skewed router:
          token-slots per rank and how long the busiest rank works against the mean;
  demo 3  exercise 9(c): capacity factors and the share of tokens dropped;
  demo 4  exercise 7: DeepSeek-V3's dispatch bytes, and bytes that ignore the FFN width;
  demo 5  DeepSeek-V3's auxiliary-loss-free balancing (sigmoid router, selection bias);
then experts that ep does not divide, refused before any compute.
Capacity with both drop rules against a dense reference of the same drops: `jaxpar verify ep`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import comms, expert, reference  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.expert import dispatch, verify  # noqa: E402
from jaxpar.testing import fwd_bwd, max_abs_diff  # noqa: E402

CFG = reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=8, top_k=2)   # GeLU experts


def moe_shard(p, x, *, top_k: int):
    """The dropless MoE layer on this device's tokens x [b, T, D]: p["router"] [D, E]
    (replicated), p["w_up"] [E/ep, D, F] and p["w_down"] [E/ep, F, D] (this device's
    experts; expert e lives on ep rank e // (E/ep)). Returns (y [b, T, D], [1] assignments
    dropped here)."""
    b, T, D = x.shape
    tokens = x.reshape(b * T, D)                                    # t = b*T tokens
    E, ep = p["router"].shape[1], jax.lax.axis_size(mesh.EP)
    r = expert.route(p["router"], tokens, top_k=top_k)             # experts, gates [t, k]: top-k of the softmax
    C = b * T                                                       # dropless: an expert gets each token once at most
    buf, slot, keep = dispatch.pack(tokens, r.experts, r.weights, n_experts=E, capacity=C, drop="position")
    h = dispatch.exchange(buf.reshape(ep, E // ep, C, D), mesh.EP)  # all-to-all: [source, local expert, C, D]
    up = jax.nn.gelu(jnp.einsum("secd,edf->secf", h, p["w_up"]), approximate=False)
    out = dispatch.exchange(jnp.einsum("secf,efd->secd", up, p["w_down"]), mesh.EP)   # back to the tokens' owners
    y = dispatch.unpack(out.reshape(E * C, D), slot, keep, r.weights)   # sum of gate x expert row per token
    return y.reshape(b, T, D), jnp.sum(~keep)[None]


def demo_parity(m):
    dp, ep = mesh.axis_size(m, mesh.DP), mesh.axis_size(m, mesh.EP)
    B, T = 2 * dp * ep, 8
    p, x, dy = verify.moe_inputs(CFG, B, T, skew=1.0)              # a router that favours the first experts
    rows = P((mesh.DP, mesh.EP) if dp > 1 else mesh.EP)             # the batch over dp x ep
    experts = {"router": P(), "w_up": P(mesh.EP), "w_down": P(mesh.EP)}
    layer = jax.shard_map(partial(moe_shard, top_k=CFG.top_k), mesh=m, in_specs=(experts, rows),
                          out_specs=(rows, rows))
    no_grad = np.zeros((dp * ep,), jax.dtypes.float0)             # the drop count is an integer: no cotangent
    ((y, dropped), grads), (fwd, bwd) = fwd_bwd(layer, p, x, ct=(dy, no_grad))

    def reference_step(p, x, dy):
        y, vjp = jax.vjp(partial(reference.moe, top_k=CFG.top_k), p, x)
        return y, vjp(dy)
    y_ref, (g_ref, dx_ref) = jax.jit(reference_step)(p, x, dy)
    print(f"Demo 1: MoE layer, E={CFG.n_experts} top-{CFG.top_k}, {B * T} tokens on {mesh.describe(m)}, dropless")
    print(f"  y          max diff {max_abs_diff(y, y_ref):.1e}")
    print(f"  dx         max diff {max_abs_diff(grads[1], dx_ref):.1e}")
    print(f"  d router   max diff {max_abs_diff(grads[0]['router'], g_ref['router']):.1e}")
    w = lambda g: {k: g[k] for k in ("w_up", "w_down")}
    print(f"  d experts  max diff {max_abs_diff(w(grads[0]), w(g_ref)):.1e}")
    print(f"  (lecture: about 1e-7); dropped {int(dropped.sum()) / (B * T * CFG.top_k):.0%}")
    kw = dict(cfg=CFG, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp, ep=ep)
    ok = fwd == expert.ep_moe_collectives(**kw) and bwd == expert.ep_moe_collectives(**kw, backward=True)
    print(f"  fwd {comms.format_stats(fwd)} | bwd {comms.format_stats(bwd)}{' = formula' if ok else ' != formula'}"
          " (backward: the router's gradient all-reduced, the experts' over dp)")


def demo_imbalance(ranks=4):
    cfg = reference.ModelConfig(n_layers=1, d_model=32, d_ff=64, n_experts=8, top_k=2)
    E, k = cfg.n_experts, cfg.top_k
    p, x, _ = verify.moe_inputs(cfg, 16, 64, skew=2.0)   # 1024 tokens, a router skewed to the first experts
    tokens = x.reshape(ranks, -1, cfg.d_model)                       # [ranks, t, D]: each ep rank's t = 256 tokens

    def route_and_place(x):
        """Each assignment's expert and its place in that expert's buffer on this rank
        [t, k]: first choices of every token before second choices; kept while place < C."""
        r = expert.route(p["router"], x, top_k=k)
        return r.experts, expert.positions(r.experts, r.weights, E, "position")
    chosen, place = (np.asarray(a) for a in jax.jit(jax.vmap(route_and_place))(tokens))
    owner = chosen // (E // ranks)                                   # the ep rank that runs each assignment
    t = tokens.shape[1]
    print(f"\nDemo 2: {ranks} ranks, {E} experts ({E // ranks} per rank), top-{k}, skewed router, {ranks * t} tokens, "
          "dropless")
    rows = []
    for cf in (None, 2.0, 1.5, 1.25, 1.0, 0.5):
        C = expert.capacity(t, k, E, cf)                              # slots per expert from each rank; None: t
        kept = place < C
        per_rank = np.bincount(owner[kept], minlength=ranks)
        rows.append((cf, C, 1 - kept.mean(), per_rank.tolist(), per_rank.max() / per_rank.mean()))
    print(f"  token-slots per rank {rows[0][3]}: the busiest rank works {rows[0][4]:.2f}x the mean, and every layer "
          "waits for it")
    print("\nDemo 3: capacity factor vs tokens dropped (exercise 9c): C = ceil(cf x t k / E) slots per expert from "
          "each rank")
    print("  capacity factor  slots/expert  dropped  per rank after drops   busiest/mean")
    for cf, C, drop_rate, per_rank, imbalance in rows:
        name = "dropless" if cf is None else f"{cf:.2f}"
        print(f"  {name:>15s}  {C:12d}  {drop_rate:6.1%}  {str(per_rank):22s} {imbalance:.2f}")


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
    step = jax.jit(lambda b: expert.expert_load(expert.route(w, x, top_k=2, scoring="sigmoid", bias=b).experts, 8))
    bias, first = jnp.zeros(8), None
    for i in range(300):
        load = np.asarray(step(bias))
        first = load if first is None else first
        bias = expert.update_bias(bias, load, rate=0.01)
    print(f"  load per expert, step 0:   {first.tolist()} (busiest/mean {first.max() / first.mean():.2f})")
    print(f"  load per expert, step 300: {load.tolist()} (busiest/mean {load.max() / load.mean():.2f})")


def main():
    ep = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    # 8 devices: dp=2 x ep=4 (no dp axis of size 1: XLA would keep the gradient all-reduce over it)
    m = mesh.make_mesh(dp=n // ep, ep=ep) if n // ep > 1 else mesh.make_mesh(ep=ep)
    print(f"{n} devices, mesh {mesh.describe(m)}\n")
    demo_parity(m)
    if n >= 4:
        demo_imbalance()
    demo_bytes()
    demo_bias()
    print("\nBad input: 6 experts over ep=4")
    cfg = reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=6, top_k=2)
    p = {"router": jnp.zeros((16, 6)), "w_up": jnp.zeros((6, 16, 32)), "w_down": jnp.zeros((6, 32, 16))}
    try:
        expert.ep_moe(p, jnp.zeros((8, 4, 16)), mesh=mesh.make_mesh(dp=n // 4, ep=4) if n >= 4 else m, cfg=cfg)
    except ConfigError as e:
        print(f"  ConfigError: {e}")


if __name__ == "__main__":
    main()
