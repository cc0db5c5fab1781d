"""The foundations every technique stands on: meshes, shard_map, the reference, collective accounting.

    python examples/00_foundations.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Opens with the pattern
every technique follows, on the simplest one, data parallelism: a named mesh, the
PartitionSpecs, a function written for one device's shard, `jax.shard_map`, the result
against the unsharded reference (`jaxpar/reference/`), and the compiled program's
collectives read back by `comms.collective_stats` (one all-reduce of the gradients,
counted and weighed). Then: bad input refused before any compute, each with a
ConfigError naming the value, the constraint and a fix; the reference's loss and its
attention against JAX's own; the structured Result a check returns. Every check of the
foundations: `jaxpar verify reference` and `jaxpar verify comms` (`--json` prints the Result).
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import comms, reference, verify  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.schedules import schedule  # noqa: E402
from jaxpar.testing import max_abs_diff  # noqa: E402

CFG = reference.ModelConfig(n_kv_heads=2)   # grouped-query attention: 8 query heads share 2 KV heads


def dp_grads(params, tokens):
    """One device's part of a data-parallel step: the whole params, tokens int[B/dp, T+1]."""
    # pcast marks the replicated params as this device's own copy: without it shard_map's
    # autodiff already psums the gradient of a replicated input, and the pmean below
    # would all-reduce the gradients twice
    grads = jax.grad(reference.loss)(jax.lax.pcast(params, mesh.DP, to="varying"), tokens, CFG)
    return jax.lax.pmean(grads, mesh.DP)       # one all-reduce: the mean of the dp shards' gradients


def lesson():
    m = mesh.make_mesh(dp=n)                                    # one axis, "dp", over every device
    params = reference.init_params(jax.random.key(0), CFG)      # replicated, P(): the whole model everywhere
    rng = np.random.default_rng(1)                              # numpy: no RNG kernel to compile
    tokens = jnp.asarray(rng.integers(0, CFG.vocab, (2 * n, 17)), jnp.int32)   # int[16, 17]; P(dp): [2, 17] each
    step = jax.jit(jax.shard_map(dp_grads, mesh=m, in_specs=(P(), P(mesh.DP)), out_specs=P()))
    loss, want = jax.jit(jax.value_and_grad(reference.loss), static_argnums=2)(params, tokens, CFG)  # one device
    print(f"data parallelism on {mesh.describe(m)}, {m.axis_types}: {tokens.shape[0]} sequences, "
          f"{tokens.shape[0] // n} per device")
    print(f"  gradients vs jax.grad(reference.loss) of the whole batch: max |diff| "
          f"{max_abs_diff(step(params, tokens), want):.1e}")

    stats = comms.collective_stats(step, params, tokens)        # read from the compiled HLO
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    print(f"  compiled collectives: {comms.format_stats(stats)}")
    print(f"  all-reduced bytes {stats['all-reduce']['bytes']} = parameter bytes {param_bytes}: "
          f"{stats['all-reduce']['bytes'] == param_bytes}")
    print(f"  each device sends 2(n-1)/n of that on a ring: {stats['all-reduce']['wire_bytes']:.0f} bytes")
    return loss


def bad_input():
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


def the_reference(loss):
    print(f"\nreference loss {float(loss):.4f} (uniform prediction would be ln V = {jnp.log(CFG.vocab):.4f})")
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((2, 16, 8, 4)), jnp.float32)          # [B, T, N, H]
    k, v = jnp.asarray(rng.standard_normal((2, 2, 16, 2, 4)), jnp.float32)    # [B, T, K, H] each, K = 2
    err = max_abs_diff(reference.attention(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True))
    print(f"reference GQA attention vs jax.nn.dot_product_attention: max |diff| {err:.1e}")


def a_check():
    result = verify.check_comms()       # a hand-built program whose collectives are known in advance
    print(f"\nthe Result of a check ({result.name}): passed={result.passed}, collectives match the formula: "
          f"{result.collectives_match}")
    print(f"  measured {result.measured['program'].format()}")


if __name__ == "__main__":
    devices = jax.devices()
    print(f"{len(devices)} {devices[0].platform} devices\n")
    loss = lesson()
    bad_input()
    the_reference(loss)
    a_check()
