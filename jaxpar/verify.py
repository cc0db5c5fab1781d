"""Checks of the foundations, for `jaxpar verify reference|comms` and the tour.

The reference is checked against independent implementations (JAX's own attention, a
per-token loop for the MoE), and the collective accounting against a hand-built program
whose collectives are known in advance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import comms, reference
from jaxpar import mesh as mesh_lib
from jaxpar.collectives import ring_pairs
from jaxpar.testing import Result, close, max_abs_diff, skipped, tolerance


def check_reference() -> list[Result]:
    """reference.attention against jax.nn.dot_product_attention (MHA and GQA, causal and
    not), and the dense MoE against a per-token loop over the chosen experts."""
    results = []
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    for N, K in ((8, 8), (8, 2)):
        q = jax.random.normal(kq, (2, 16, N, 4))
        k = jax.random.normal(kk, (2, 16, K, 4))
        v = jax.random.normal(kv, (2, 16, K, 4))
        ours = {f"causal={c}": reference.attention(q, k, v, causal=c) for c in (True, False)}
        theirs = {f"causal={c}": jax.nn.dot_product_attention(q, k, v, is_causal=c) for c in (True, False)}
        errors = {name: max_abs_diff(ours[name], theirs[name]) for name in ours}
        kind = "MHA" if N == K else "GQA"
        results.append(Result(name=f"reference attention ({kind}) vs jax.nn", errors=errors,
                              tolerance=tolerance(jnp.float32), passed=close(ours, theirs)))
    cfg = reference.ModelConfig(n_experts=4, top_k=2, n_layers=1)
    p = reference.layer_params(reference.init_params(key, cfg), 0)
    x = jax.random.normal(key, (5, cfg.d_model))
    gates = np.asarray(reference.router_weights(p["router"], x, top_k=cfg.top_k))
    loop = np.stack([
        sum(gates[t, e] * np.asarray(reference.mlp({n: p[n][e] for n in ("w_up", "w_down")}, x[t]))
            for e in range(cfg.n_experts) if gates[t, e] > 0)
        for t in range(x.shape[0])])
    dense = reference.moe(p, x, top_k=cfg.top_k)
    results.append(Result(name="reference MoE (dense) vs per-token loop", errors={"y": max_abs_diff(dense, loop)},
                          tolerance=tolerance(jnp.float32), passed=close(dense, jnp.asarray(loop))))
    return results


def check_comms() -> Result:
    """collective_stats on a hand-built program whose collectives are known in advance:
    a ring of psum + ppermute in a scan of 5 steps, then all_gather, psum_scatter, all_to_all."""
    n = len(jax.devices())
    name = "comms: hand-built program (scan x5)"
    if n == 1:  # over one device, which collectives XLA keeps is the backend's choice (CPU keeps all but all-to-all)
        return skipped(name, needs=2, have=n, mesh="dp=2")
    m = mesh_lib.make_mesh(dp=n)
    steps, rows_per_dev, cols = 5, 8, 16

    def body(x):  # x: f32[8, 16] per device
        def step(c, _):
            c = jax.lax.ppermute(c, mesh_lib.DP, ring_pairs(n))
            return c + jax.lax.psum(c, mesh_lib.DP), None
        c, _ = jax.lax.scan(step, x, None, length=steps)
        g = jax.lax.all_gather(c, mesh_lib.DP, tiled=True)            # f32[8n, 16]
        r = jax.lax.psum_scatter(g, mesh_lib.DP, tiled=True)          # f32[8, 16]
        return jax.lax.all_to_all(r, mesh_lib.DP, 0, 0, tiled=True) if rows_per_dev % n == 0 else r

    f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P(mesh_lib.DP), out_specs=P(mesh_lib.DP)))
    x = jnp.ones((rows_per_dev * n, cols), jnp.float32)
    got = comms.nonzero(comms.collective_stats(f, x))
    block = rows_per_dev * cols * 4
    want = {"collective-permute": (steps, steps * block), "all-reduce": (steps, steps * block),
            "all-gather": (1, block * n), "reduce-scatter": (1, block * n)}
    if rows_per_dev % n == 0:
        want["all-to-all"] = (1, block)
    want = comms.Collectives(want)
    return Result(name=name, mesh=mesh_lib.describe(m), measured={"program": got}, expected={"program": want},
                  passed=got == want,
                  note="counts and bytes of every kind, loop bodies x trip count")
