"""Context parallelism: compiled memory as T grows, and speed against the public
`ringattention` package and dense attention.

    python -m benchmarks.context          (or python -m benchmarks.run context)

Rows, all from compiled programs (8 fake CPU devices by default; cp=4 uses 4 of them):
  memory  forward+backward temp bytes per device of jaxpar's causal zigzag ring for
          T = 1k..8k (B=1, 8 heads of 64): per (T/cp)^2 it stays flat, and it stays
          below one T x T score matrix; beside it one device's dense attention
          (jax.nn.dot_product_attention, XLA's implementation) at the same T;
  peer    forward+backward time at T=4096, cp=4, 8 heads of 64, causal: jaxpar's zigzag
          ring vs `ringattention_jax.ring_attention` (Liu et al.'s package, its blockwise
          JAX path, inside shard_map on the same mesh, query/key chunks of 512, token-level
          causal mask) and vs dense attention on one device; ratio of medians of REPEATS
          alternated runs after warm-up, and the max error of each against
          reference.attention in float32 (equal accuracy is part of the claim).

`ringattention` is optional (`pip install ringattention einops`); its package __init__
calls a JAX API removed in current releases, so its ringattention_jax module is loaded
from its file. Without it the peer row says so.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import comms, mesh, reference
from jaxpar.context import ring
from jaxpar.context.verify import attention_inputs
from jaxpar.testing import max_abs_diff

REPEATS = 5
N, H, CP = 8, 64, 4
CHUNK = 512


def _mesh():
    return mesh.make_mesh(cp=CP, devices=jax.devices()[:CP])


def _step(fn):
    """jit of (q, k, v, do) -> (out, (dq, dk, dv)): one forward + backward."""
    def step(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(do)
    return jax.jit(step)


def _ours(m):
    return lambda q, k, v: ring.ring_attention(q, k, v, mesh=m, causal=True, layout="zigzag")


def _dense(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def load_peer():
    """ringattention_jax.ring_attention, or None when the package is not installed."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ringattention_jax.py"
    module_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.ring_attention


def _peer(m, peer_fn, T):
    kwargs = dict(causal_block_size=1, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                  query_chunk_size=min(CHUNK, T // CP), key_chunk_size=min(CHUNK, T // CP), dtype=jnp.float32,
                  policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)
    shard = lambda q, k, v: peer_fn(q, k, v, None, None, None, mesh.CP, True, kwargs)
    spec = P(None, mesh.CP, None, None)
    return jax.shard_map(shard, mesh=m, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


def memory_rows() -> list[dict]:
    m = _mesh()
    rows = []
    for T in (1024, 2048, 4096, 8192):
        q, k, v, do = attention_inputs(1, T, N, N, H)
        temp = lambda fn: _step(fn).lower(q, k, v, do).compile().memory_analysis().temp_size_in_bytes
        start = time.perf_counter()
        ours = temp(_ours(m))
        compile_s = time.perf_counter() - start
        dense = temp(_dense)
        scores = N * T * T * 4
        local = N * (T // CP) ** 2 * 4
        rows.append({"row": "memory", "T": T, "cp": CP, "ring temp": comms.human_bytes(ours),
                     "ring / (T/cp)^2 scores": round(ours / local, 2), "ring / one TxT": round(ours / scores, 3),
                     "dense 1 device": comms.human_bytes(dense), "ring compile s": round(compile_s, 1)})
    return rows


def _time(fns: dict, args, repeats=REPEATS) -> dict[str, list[float]]:
    times = {name: [] for name in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(*args))           # warm-up (and compile)
    for _ in range(repeats):
        for name, fn in fns.items():               # alternated: the machine's noise hits both
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def peer_rows(T: int = 4096) -> list[dict]:
    m = _mesh()
    peer_fn = load_peer()
    q, k, v, do = attention_inputs(1, T, N, N, H)
    fns = {"jaxpar zigzag ring": _step(_ours(m)), "dense 1 device": _step(_dense)}
    if peer_fn is not None:
        fns["ringattention (peer)"] = _step(_peer(m, peer_fn, T))
    ref = jax.jit(lambda q, k, v, do: _step(lambda q, k, v: reference.attention(q, k, v))(q, k, v, do))(q, k, v, do)
    errors = {name: max_abs_diff(fn(q, k, v, do), ref) for name, fn in fns.items()}
    times = _time(fns, (q, k, v, do))
    ours = times["jaxpar zigzag ring"]
    rows = []
    for name, ts in times.items():
        rows.append({"row": "peer", "T": T, "cp": CP, "program": name, "fwd+bwd s": round(statistics.median(ts), 3),
                     "jaxpar / this": round(statistics.median(ours) / statistics.median(ts), 3),
                     "best ratio": round(min(ours) / min(ts), 3), "max error": f"{errors[name]:.1e}"})
    if peer_fn is None:
        rows.append({"row": "peer", "program": "ringattention not installed: pip install ringattention einops"})
    return rows


def run() -> list[dict]:
    if len(jax.devices()) < CP:
        return [{"row": "skipped", "reason": f"needs {CP} devices, {len(jax.devices())} present"}]
    return memory_rows() + peer_rows()
