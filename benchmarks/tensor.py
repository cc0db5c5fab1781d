"""Tensor / sequence parallel block: memory per device, collective bytes, and speed vs XLA's
automatic partitioner.

    python -m benchmarks.tensor          (or python -m benchmarks.run tensor)

Rows, all from compiled programs on the devices there are (8 fake CPU devices by default):
  params     parameter bytes per device of the block vs t (memory_analysis argument size
             minus the input x), next to block_param_bytes: 1/t of the block but the norms;
  residuals  bytes the forward keeps for the backward, per device (memory_analysis output
             size of jit(jax.vjp(...)) minus y), TP vs SP: SP stores the token-wise
             activations (x, norms, residual stream) for T/t tokens, but autodiff also
             keeps each column layer's gathered input [B, T, D] (Megatron re-gathers it in
             the backward instead), and attention's own residuals are 1/t in both, so the
             ratio is above 1/t;
  peer       the same block written as plain jnp under jit, weights placed with the same
             NamedShardings and activations annotated (with_sharding_constraint), the way
             MaxText does TP: collective bytes and fwd+bwd time vs jaxpar's explicit
             shard_map version, on tensor.verify.default_mesh() (dp=2 x tp=4 on 8 devices;
             skipped, with a row saying so, when that gives tp=1): ratio of medians of
             REPEATS alternated runs after warm-up, and of the fastest runs (best_ratio).

The peer moves more bytes, not the same: its compiled backward all-reduces the input
gradient of each of the Q, K and V projections on its own (3 x b*s*h over tp; HLO op_name
transpose(jvp(btd,dnh->btnh)) and two transpose(jvp(btd,dkh->btkh))), where Megatron's one
f sums the three locally first and all-reduces once; the MLP has one up projection (GeLU)
so both all-reduce it once. That is 2*b*s*h*4 bytes more per step (3.6 vs 2.6 MiB at
dp=2 x tp=4, b=4, s=128, h=256, both with the same dp gradient all-reduce).
Runs on any device count: the batch is a multiple of every dp used (lcm(8, n)).
"""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks._timing import alternated
from jaxpar import comms, mesh, reference, tensor
from jaxpar.tensor.verify import default_mesh

REPEATS = 15
CFG = reference.ModelConfig(n_layers=1, d_model=256, n_heads=8, n_kv_heads=8, head_dim=32, d_ff=768)
# d_ff/t never equals d_model, so the [b, T, D] residuals can be told apart by shape.
T = 128


def _batch() -> int:
    """8, or a multiple of it that every dp = n/t divides (n devices)."""
    return math.lcm(8, len(jax.devices()))


def _inputs(cfg=CFG):
    p = reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0)
    x = jax.random.normal(jax.random.key(1), (_batch(), T, cfg.d_model))
    return p, x


def _mesh(tp):
    n = len(jax.devices())
    return mesh.make_mesh(dp=n // tp, tp=tp)


def _step(fwd):
    """One fwd+bwd of the block: y and all gradients for a cotangent dy."""
    def step(p, x, dy):
        y, vjp = jax.vjp(fwd, p, x)
        return y, vjp(dy)
    return jax.jit(step)


def _time_pair(f, g, *args) -> tuple[float, float, float]:
    """Median seconds of f(*args) and g(*args), alternated so that load hits both alike,
    and the ratio of their fastest runs (the least noisy estimate on a shared machine)."""
    t = alternated({"f": f, "g": g}, args, REPEATS)
    return statistics.median(t["f"]), statistics.median(t["g"]), min(t["f"]) / min(t["g"])


def _residuals(m, p, x, sp, dp, t) -> dict:
    """Bytes per device the forward keeps for the backward (memory_analysis of the compiled
    jit(jax.vjp): its outputs are the residuals), and the token-wise ones among them:
    per-device shape [b, T_local, D] or [b, T_local, 1] (norm inputs/outputs, residual
    stream, rms statistics). 'split' = T/t tokens, 'whole' = all T tokens."""
    f = lambda p, x: tensor.tp_block(p, x, mesh=m, cfg=CFG, sequence_parallel=sp)
    vjp_fn = jax.jit(lambda p, x: jax.vjp(f, p, x)[1])
    compiled = vjp_fn.lower(p, x).compile()
    leaves = jax.tree.leaves(jax.eval_shape(lambda p, x: jax.vjp(f, p, x)[1], p, x))
    out = {"residual_bytes": compiled.memory_analysis().output_size_in_bytes,
           "tokenwise_split": 0, "tokenwise_whole": 0}
    b = x.shape[0] // dp
    for leaf, sharding in zip(leaves, jax.tree.leaves(compiled.output_shardings)):
        shape = sharding.shard_shape(leaf.shape)
        if len(shape) == 3 and shape[0] == b and shape[2] in (CFG.d_model, 1):
            key = "tokenwise_whole" if shape[1] == T else "tokenwise_split"
            out[key] += leaf.dtype.itemsize * shape[0] * shape[1] * shape[2]
    return out


def peer_block(p, x, *, m, cfg=CFG):
    """reference.block with NamedSharding annotations: XLA's SPMD partitioner inserts the
    collectives. Params arrive placed by TPSpecs.megatron; activations are constrained."""
    dp = mesh.DP if m.shape.get(mesh.DP, 1) > 1 else None
    c = lambda a, *spec: jax.lax.with_sharding_constraint(a, NamedSharding(m, P(*spec)))
    x = c(x, dp, None, None)
    z = reference.rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q = c(jnp.einsum("btd,dnh->btnh", z, p["wq"]), dp, None, mesh.TP, None)
    k = c(jnp.einsum("btd,dkh->btkh", z, p["wk"]), dp, None, mesh.TP, None)
    v = c(jnp.einsum("btd,dkh->btkh", z, p["wv"]), dp, None, mesh.TP, None)
    o = c(reference.attention(q, k, v, causal=cfg.causal), dp, None, mesh.TP, None)
    h = c(x + jnp.einsum("btnh,nhd->btd", o, p["wo"]), dp, None, None)
    z = reference.rms_norm(h, p["mlp_norm"], cfg.norm_eps)
    hidden = c(jax.nn.gelu(z @ p["w_up"], approximate=False), dp, None, mesh.TP)
    return c(h + hidden @ p["w_down"], dp, None, None)


def run() -> list[dict]:
    n = len(jax.devices())
    rows = []
    p, x = _inputs()
    x_bytes = x.nbytes
    for t in (t for t in (1, 2, 4, 8) if n % t == 0):
        m = _mesh(t)
        dp = n // t
        fwd = jax.jit(lambda p, x: tensor.tp_block(p, x, mesh=m, cfg=CFG))
        mem = fwd.lower(p, x).compile().memory_analysis()
        measured = mem.argument_size_in_bytes - x_bytes // dp
        rows.append({"figure": "params/device", "t": t, "sp": False, "bytes": measured,
                     "formula": tensor.block_param_bytes(cfg=CFG, dtype=jnp.float32, tp=t),
                     "ratio_to_t1": measured / tensor.block_param_bytes(cfg=CFG, dtype=jnp.float32, tp=1)})
    for t in (t for t in (2, 4, 8) if n % t == 0):
        m = _mesh(t)
        dp = n // t
        res = {}
        for sp in (False, True):
            res[sp] = _residuals(m, p, x, sp, dp, t)
        for sp in (False, True):
            rows.append({"figure": "residuals/device", "t": t, "sp": sp, **res[sp],
                         # the token-wise arrays SP splits, vs the same arrays under TP (TP's
                         # whole ones minus the gathered column inputs SP keeps whole too)
                         "split_ratio_to_tp": res[sp]["tokenwise_split"]
                         / (res[False]["tokenwise_whole"] - res[True]["tokenwise_whole"]) if sp else None})
    rows += _peer_rows(p, x)
    return rows


def _peer_rows(p, x) -> list[dict]:
    m, _ = default_mesh()
    t, dp = m.shape[mesh.TP], m.shape.get(mesh.DP, 1)
    if t == 1:
        return [{"figure": "fwd+bwd jaxpar vs peer", "t": 1, "sp": False,
                 "collectives": f"skipped: {len(jax.devices())} device(s) give tp=1, nothing to split"}]
    pspecs = tensor.TPSpecs.megatron(n_kv_heads=CFG.n_kv_heads, tp=t, data_axis=mesh.DP if dp > 1 else None)
    placed = {k: jax.device_put(a, NamedSharding(m, pspecs.params(p)[k])) for k, a in p.items()}
    xs = jax.device_put(x, NamedSharding(m, pspecs.act_btd))
    dy = jax.device_put(jnp.ones_like(x) / (x.shape[0] * T), NamedSharding(m, pspecs.act_btd))
    ours = _step(lambda p, x: tensor.tp_block(p, x, mesh=m, cfg=CFG))
    peer = _step(lambda p, x: peer_block(p, x, m=m))
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
              zip(jax.tree.leaves(ours(placed, xs, dy)), jax.tree.leaves(peer(placed, xs, dy))))
    s_ours = comms.collective_stats(ours, placed, xs, dy)
    s_peer = comms.collective_stats(peer, placed, xs, dy)
    t_ours, t_peer, best = _time_pair(ours, peer, placed, xs, dy)
    f_ours, f_peer, f_best = _time_pair(jax.jit(lambda p, x: tensor.tp_block(p, x, mesh=m, cfg=CFG)),
                                        jax.jit(lambda p, x: peer_block(p, x, m=m)), placed, xs)
    rows = [{"figure": "fwd only, jaxpar/peer", "t": t, "sp": False, "ms": 1e3 * f_ours,
             "ratio_to_peer": f_ours / f_peer, "best_ratio": f_best}]
    for name, s, secs in (("jaxpar shard_map", s_ours, t_ours), ("jit+NamedSharding peer", s_peer, t_peer)):
        rows.append({"figure": f"fwd+bwd {name}", "t": t, "sp": False, "collectives": comms.format_stats(s),
                     "bytes": sum(v["bytes"] for v in s.values()), "ms": 1e3 * secs,
                     "ratio_to_peer": secs / t_peer, "best_ratio": best if secs is t_ours else 1.0,
                     "max_diff_vs_peer": err})
    return rows


def main():
    from benchmarks.run import format_rows
    print(format_rows(run()))


if __name__ == "__main__":
    mesh.use_cpu_devices(8)
    main()
