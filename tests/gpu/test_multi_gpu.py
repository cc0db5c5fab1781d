"""The paths only several GPUs can check: collectives over NVLink moving exactly what they
should, ring and Ulysses attention split over GPUs, the trainer on a GPU mesh against
the unsharded model, and XLA:GPU's ragged_all_to_all (which XLA:CPU lacks).

Run on a machine with 2 or more GPUs: `JAXPAR_TEST_PLATFORM=gpu pytest tests/gpu`. With
fewer (and on CPU, as make test runs it) each test skips and says why."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context.ring import ring_attention
from jaxpar.context.ulysses import ulysses_attention
from jaxpar.testing import assert_close, precision_policy
from jaxpar.train import verify
from jaxpar.train.spec import ParallelSpec

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
needs_gpus = pytest.mark.skipif(
    len(GPUS) < 2, reason=f"needs 2+ GPUs: this run has {len(GPUS)} (backend {jax.default_backend()}); on one GPU "
                          "the collectives have no peer, so docs/benchmarks.md lists these paths as unchecked there")


def _even(n: int) -> int:
    """The largest power of two <= n: the GPU meshes' size."""
    return 1 << (n.bit_length() - 1)


@needs_gpus
def test_collectives_move_rank_coded_data_exactly():
    n = _even(len(GPUS))
    mesh = mesh_lib.make_mesh(dp=n, devices=GPUS[:n])
    x = jnp.arange(n * 4, dtype=jnp.float32).reshape(n, 4)     # row r = rank r's data

    def shard(x):
        total = jax.lax.psum(x, "dp")
        gathered = jax.lax.all_gather(x, "dp", tiled=True)
        shifted = jax.lax.ppermute(x, "dp", [(i, (i + 1) % n) for i in range(n)])
        swapped = jax.lax.all_to_all(jnp.tile(x, (n, 1)), "dp", 0, 0, tiled=True)
        return total, gathered, shifted, swapped
    out = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("dp"), out_specs=(P("dp"), P("dp"), P("dp"),
                                                                               P("dp"))))(x)
    host = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(out[0]).reshape(n, 1, 4)[:, 0], np.tile(host.sum(0), (n, 1)))
    np.testing.assert_array_equal(np.asarray(out[1]).reshape(n, n, 4), np.tile(host, (n, 1, 1)))
    np.testing.assert_array_equal(np.asarray(out[2]), np.roll(host, 1, axis=0))
    np.testing.assert_array_equal(np.asarray(out[3]).reshape(n, n, 4), np.tile(host, (n, 1, 1)))


@needs_gpus
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_and_ulysses_attention_over_gpus_equal_the_reference(layout):
    n = _even(len(GPUS))
    mesh = mesh_lib.make_mesh(cp=n, devices=GPUS[:n])
    B, T, N, K, H = 2, 64 * n, 8, 2, 32
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in keys[1:])
    with precision_policy():
        want = reference.attention(q, k, v, causal=True)
        assert_close(ring_attention(q, k, v, mesh=mesh, layout=layout), want)
        assert_close(ring_attention(q, k, v, mesh=mesh, layout=layout, kernel="pallas"), want)   # fused blocks
        if N % n == 0:
            assert_close(ulysses_attention(q, k, v, mesh=mesh, layout="contiguous"), want)


@needs_gpus
def test_the_trainer_on_a_gpu_mesh_equals_the_unsharded_model():
    n = _even(len(GPUS))
    spec = ParallelSpec(dp=2, tp=n // 2) if n >= 4 else ParallelSpec(dp=2)
    with precision_policy():
        result = verify.parity(spec, verify.DENSE, steps=5, devices=GPUS[:n])
    assert result.passed, result.errors


@needs_gpus
def test_ragged_all_to_all_moves_each_rank_its_rows():
    """XLA:GPU's ragged_all_to_all (dropless expert parallelism's exchange without padding):
    rank r sends r+1 rows to every peer; each receives exactly those rows, in rank order."""
    if not hasattr(jax.lax, "ragged_all_to_all"):
        pytest.skip(f"jax {jax.__version__} has no jax.lax.ragged_all_to_all")
    n = _even(len(GPUS))
    mesh = mesh_lib.make_mesh(ep=n, devices=GPUS[:n])
    local = n * n                                      # rows each rank holds: room for n chunks of up to n rows

    def shard(x):                                      # x [local, 1], every row reading this rank's index
        r = jax.lax.axis_index("ep").astype(jnp.int32)
        send = jnp.full((n,), r + 1, jnp.int32)                            # r+1 rows to every peer
        starts = jnp.arange(n, dtype=jnp.int32) * (r + 1)
        where = jnp.full((n,), r * (r + 1) // 2, jnp.int32)                # in each receiver: after ranks < r
        recv = jnp.arange(1, n + 1, dtype=jnp.int32)                       # rank s sends s+1 rows
        return jax.lax.ragged_all_to_all(x, jnp.full((local, 1), -1.0), starts, send, where, recv, axis_name="ep")
    x = jnp.repeat(jnp.arange(n, dtype=jnp.float32), local)[:, None]
    got = np.asarray(jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x))
    want = np.concatenate([np.full(s + 1, s) for s in range(n)])
    for r in range(n):
        np.testing.assert_array_equal(got[r * local:r * local + want.size, 0], want)
