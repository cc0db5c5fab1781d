"""Collectives by mesh size: logical bytes, ring wire bytes per device, and measured time.

For a per-device block of `BLOCK_BYTES`, one psum (all-reduce), all_gather and
psum_scatter over the first n devices. `bytes` and `wire_bytes` come from the compiled
program (jaxpar.comms); the ring factor `wire/bytes` should read 2(n-1)/n for the
all-reduce and (n-1)/n for the others. `stats_ms` is what collective_stats costs
(lowering + compiling + reading the HLO); `run_us` the median time of one execution.
On one device the collective stays in the program (XLA:CPU keeps it) but sends nothing:
its wire bytes are zero.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import comms, mesh

BLOCK_BYTES = 1 << 20  # 1 MiB per device: large enough to time, small enough for CPU
REPEATS = 5

OPS = {
    "psum": ("all-reduce", lambda x: jax.lax.psum(x, "dp"), lambda n: 2 * (n - 1) / n),
    "all_gather": ("all-gather", lambda x: jax.lax.all_gather(x, "dp", tiled=True),
                   lambda n: (n - 1) / n),
    "psum_scatter": ("reduce-scatter", lambda x: jax.lax.psum_scatter(x, "dp", tiled=True), lambda n: (n - 1) / n),
}


def _sizes(total: int) -> list[int]:
    sizes, n = [], 1
    while n <= total:
        sizes.append(n)
        n *= 2
    return sizes


def _median_us(f, x) -> float:
    jax.block_until_ready(f(x))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def run() -> list[dict]:
    rows = []
    elems = BLOCK_BYTES // 4
    for n in _sizes(len(jax.devices())):
        m = mesh.make_mesh(dp=n, devices=jax.devices()[:n])
        x = jnp.ones((n * elems // 256, 256), jnp.float32)  # f32[n*1024, 256]: 1 MiB per device
        for name, (kind, body, factor) in OPS.items():
            f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("dp"), out_specs=P("dp")))
            start = time.perf_counter()
            stats = comms.collective_stats(f, x)[kind]
            stats_ms = (time.perf_counter() - start) * 1e3
            rows.append({
                "op": name, "devices": n, "count": stats["count"], "bytes": stats["bytes"],
                "wire_bytes": int(stats["wire_bytes"]),
                "wire/bytes": stats["wire_bytes"] / stats["bytes"] if stats["bytes"] else 0.0,
                "ring formula": factor(n), "stats_ms": stats_ms, "run_us": _median_us(f, x),
            })
    return rows
