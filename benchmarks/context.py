"""Context parallelism: compiled memory as T grows, and speed against the public
`ringattention` package and dense attention.

    python -m benchmarks.context          (or python -m benchmarks.run context)

Rows, all from compiled programs (8 fake CPU devices by default; cp=4 uses 4 of them):
  memory  forward+backward temp bytes per device of jaxpar's causal zigzag ring for
          T = 1k..8k (B=1, 8 heads of 64), per (T/cp)^2 scores and per T/cp x chunk
          scores (its keys go `ring.CHUNK` at a time), and against one T x T score
          matrix; beside it one device's dense attention (jax.nn.dot_product_attention,
          XLA's implementation) at the same T;
  peer    forward+backward time at T=4096, cp=4, 8 heads of 64, causal: jaxpar's zigzag
          ring vs `ringattention_jax.ring_attention` (Liu et al.'s package, its blockwise
          JAX path, inside shard_map on the same mesh, token-level causal mask, query/key
          chunks of 256 and of 512, the faster of the two being the bar) and vs dense
          attention on one device (jax.nn.dot_product_attention); ratio of medians of REPEATS
          alternated runs after warm-up, and the max error of each (output, dQ, dK,
          dV) against reference.attention in float64 (equal accuracy is part of the
          claim: against the float32 reference a program that rounds like it looks better);
  chunk   jaxpar's ring at key chunks of 64 .. 512 and whole blocks, against the default
          `ring.CHUNK` (why 128 on CPU: the chunk's scores stay in cache).

`ringattention` is optional (`pip install ringattention einops`); its package __init__
calls a JAX API removed in current releases, so its ringattention_jax module is loaded
from its file. Without it the peer row says so.
"""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks._timing import alternated
from jaxpar import comms, mesh, reference
from jaxpar.context import ring
from jaxpar.context.verify import attention_inputs
from jaxpar.testing import max_abs_diff

REPEATS = 5
N, H, CP = 8, 64, 4
PEER_CHUNKS = (256, 512)   # the peer's query/key chunk sizes tried; its faster one is the bar


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
    package = importlib.util.find_spec("ringattention")
    if package is None or not package.submodule_search_locations:
        return None
    path = pathlib.Path(list(package.submodule_search_locations)[0]) / "ringattention_jax.py"
    found = importlib.util.spec_from_file_location("ringattention_jax", path)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module.ring_attention


def _peer(m, peer_fn, T, chunk):
    kwargs = dict(causal_block_size=1, deterministic=True, dropout_rng=None, attn_pdrop=0.0,
                  query_chunk_size=min(chunk, T // CP), key_chunk_size=min(chunk, T // CP), dtype=jnp.float32,
                  policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)
    shard = lambda q, k, v: peer_fn(q, k, v, None, None, None, mesh.CP, True, kwargs)
    pspec = P(None, mesh.CP, None, None)
    return jax.shard_map(shard, mesh=m, in_specs=(pspec,) * 3, out_specs=pspec, check_vma=False)


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
        strip = N * (T // CP) * ring.CHUNK * 4
        rows.append({"row": "memory", "T": T, "cp": CP, "ring temp": comms.human_bytes(ours),
                     "ring / (T/cp)^2 scores": round(ours / local, 3), "ring / (T/cp x chunk)": round(ours / strip, 2),
                     "ring / one TxT": round(ours / scores, 4),
                     "dense 1 device": comms.human_bytes(dense), "ring compile s": round(compile_s, 1)})
    return rows


def peer_rows(T: int = 4096) -> list[dict]:
    m = _mesh()
    peer_fn = load_peer()
    q, k, v, do = attention_inputs(1, T, N, N, H)
    fns = {"jaxpar zigzag ring": _step(_ours(m)), "dense 1 device": _step(_dense)}
    if peer_fn is not None:
        for chunk in PEER_CHUNKS:
            fns[f"ringattention chunks {chunk}"] = _step(_peer(m, peer_fn, T, chunk))
    with jax.enable_x64(True):   # the truth: every program's float32 error against float64
        wide = [jnp.asarray(np.asarray(a), jnp.float64) for a in (q, k, v, do)]
        ref = jax.tree.map(np.asarray, _step(lambda q, k, v: reference.attention(q, k, v))(*wide))
    errors = {name: max_abs_diff(fn(q, k, v, do), ref) for name, fn in fns.items()}
    times = alternated(fns, (q, k, v, do), REPEATS)
    ours = times["jaxpar zigzag ring"]
    peers = [name for name in times if name.startswith("ringattention")]
    best = min(peers, key=lambda n: statistics.median(times[n])) if peers else None
    rows = []
    for name, ts in times.items():
        rows.append({"row": "peer", "T": T, "cp": CP, "program": name, "fwd+bwd s": round(statistics.median(ts), 3),
                     "jaxpar / this": round(statistics.median(ours) / statistics.median(ts), 3),
                     "best ratio": round(min(ours) / min(ts), 3), "max error": f"{errors[name]:.1e}",
                     "note": "the peer's faster chunking: the bar" if name == best else ""})
    if peer_fn is None:
        rows.append({"row": "peer", "program": "ringattention not installed: pip install ringattention einops"})
    return rows


def chunk_rows(T: int = 4096, chunks=(64, 128, 256, 512, 1 << 20)) -> list[dict]:
    """jaxpar's ring at each key-chunk length (the last: whole blocks), against the default."""
    m = _mesh()
    q, k, v, do = attention_inputs(1, T, N, N, H)
    fns = {c: _step(lambda q, k, v, c=c: ring.ring_attention(q, k, v, mesh=m, layout="zigzag", chunk=c))
           for c in chunks}
    times = alternated(fns, (q, k, v, do), 3)
    base = statistics.median(times[ring.CHUNK])
    return [{"row": "chunk", "T": T, "cp": CP, "program": f"chunk {c}" if c < T else "whole blocks",
             "fwd+bwd s": round(statistics.median(ts), 3), "default / this": round(base / statistics.median(ts), 3),
             "note": "the default (ring.CHUNK)" if c == ring.CHUNK else ""} for c, ts in times.items()]


def run() -> list[dict]:
    if len(jax.devices()) < CP:
        return [{"row": "skipped", "reason": f"needs {CP} devices, {len(jax.devices())} present"}]
    return memory_rows() + peer_rows() + chunk_rows()
