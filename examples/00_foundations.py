"""The foundations every technique stands on: devices, meshes, the reference, collective accounting.

    python examples/00_foundations.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Shows: a named mesh;
bad input refused before any compute, each with a ConfigError naming the value, the
constraint and a fix; the reference model's loss and its attention against JAX's own;
`comms.collective_stats` reading a compiled data-parallel step whose collectives we know
in advance (one all-reduce of the gradients, counted and weighed); and the structured
Result a check returns (`jaxpar verify comms --json` prints the same).
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import comms, reference, verify  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.pipeline import schedule  # noqa: E402
from jaxpar.testing import max_abs_diff  # noqa: E402


def main():
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} devices")
    m = mesh.make_mesh(dp=len(devices))
    print("mesh:", mesh.describe(m), m.axis_types)
    print("\nbad input is refused before any compute, with a ConfigError (a ValueError):")
    for what, call in [("mesh.make_mesh(dp=3, tp=2)", lambda: mesh.make_mesh(dp=3, tp=2)),
                       ("ModelConfig(n_kv_heads=0)", lambda: reference.ModelConfig(n_kv_heads=0)),
                       ("ModelConfig(head_dim='4')", lambda: reference.ModelConfig(head_dim="4")),
                       ("schedule.make('1f1b', 4, 8, costs=[1, 2])",
                        lambda: schedule.make("1f1b", 4, 8, costs=[1, 2])),
                       ("schedule.make('1f1b', 999999999, 1)", lambda: schedule.make("1f1b", 999999999, 1))]:
        try:
            call()
            print(f"  {what}: accepted (FAIL)")
        except ConfigError as e:
            print(f"  {what}:\n    {e}")

    cfg = reference.ModelConfig(n_kv_heads=2)  # grouped-query attention: 8 query heads, 2 KV heads
    params = reference.init_params(jax.random.PRNGKey(0), cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (len(devices) * 2, 17), 0, cfg.vocab)
    loss = jax.jit(reference.loss, static_argnums=2)(params, tokens, cfg)
    print(f"\nreference loss {float(loss):.4f} (uniform prediction would be ln V = {jnp.log(cfg.vocab):.4f})")

    q = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 8, 4))
    kv = jax.random.normal(jax.random.PRNGKey(3), (2, 2, 16, 2, 4))
    err = max_abs_diff(reference.attention(q, kv[0], kv[1]),
                       jax.nn.dot_product_attention(q, kv[0], kv[1], is_causal=True))
    print(f"reference GQA attention vs jax.nn.dot_product_attention: max |diff| {err:.1e}")

    # A data-parallel step: each device computes the gradient of its batch shard, one
    # all-reduce over dp averages them: the whole parameter pytree crosses the wire once.
    # `pcast(..., to="varying")` (formerly pvary) marks the local copy of the replicated params as per-device; without it,
    # shard_map's autodiff (check_vma) already psums the gradient of a replicated input,
    # and an explicit pmean on top would all-reduce the gradients twice.
    def dp_grads(params, tokens):  # tokens: int[B/dp, T] per device
        grads = jax.grad(reference.loss)(jax.lax.pcast(params, mesh.DP, to="varying"), tokens, cfg)
        return jax.lax.pmean(grads, mesh.DP)

    step = jax.jit(jax.shard_map(dp_grads, mesh=m, in_specs=(P(), P(mesh.DP)), out_specs=P()))
    stats = comms.collective_stats(step, params, tokens)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(f"\ndata-parallel gradient step on {mesh.describe(m)}: {comms.format_stats(stats)}")
    print(f"  all-reduced bytes {stats['all-reduce']['bytes']} = parameter bytes {param_bytes}: "
          f"{stats['all-reduce']['bytes'] == param_bytes}")
    print(f"  each device sends 2(n-1)/n of that on a ring: {stats['all-reduce']['wire_bytes']:.0f} bytes")

    result = verify.check_comms()
    print(f"\nthe Result of a check ({result.name}): passed={result.passed}, collectives match the formula: "
          f"{result.collectives_match}")
    print(f"  measured {result.measured['program'].format()}")


if __name__ == "__main__":
    main()
