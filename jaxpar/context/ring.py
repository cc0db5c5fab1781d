"""Ring attention (lecture 5.2): K/V blocks travel a ring of cp devices, each step merged
into the queries' running result by log-sum-exp, causal blocks above the diagonal skipped.

    ring_attention_shard(q, k, v, *, axis, causal, layout)   per-shard, inside shard_map
    ring_attention(q, k, v, *, mesh, causal, layout)         global [B, T, N, H] arrays

Each entry point checks its inputs once (ConfigError): the global one what needs the
whole arrays and the mesh, the per-shard one what it alone sees; both then run
`attend_ring`, the unchecked per-shard attention.

Forward, on rank i of the `axis` ring: step 0 attends to its own K/V; before computing a
step it sends the K/V it holds to rank i+1 (`ppermute`), so the transfer of the next
block overlaps the current block's compute, and at step r it holds the K/V of rank
i - r. Each step runs the block kind that `zigzag.plan` gives for (r, i): a whole block,
the masked diagonal, half a block (zigzag) or nothing (contiguous, keys all in the
future). cp - 1 sends of one stacked K/V buffer in all.

Backward (`jax.custom_vjp`): only q, k, v, the output and its log-sum-exp are kept
(no score matrix); the ring runs again, each step adding the block's dQ locally while
dK/dV accumulate in a buffer that travels round the ring with the K/V they belong to and
takes one last step home: cp - 1 K/V sends and cp dK/dV sends.

Grouped-query attention is native: K/V keep their K heads on the wire (a GQA model
sends N/K times less than repeating them would).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar import errors
from jaxpar import mesh as mesh_lib
from jaxpar.collectives import ring_shift
from jaxpar.context import zigzag
from jaxpar.context.blockwise import Blocks, acc_dtype, check_qkv, group, heads_major, merge, ungroup
from jaxpar.context.formulas import HOPS
from jaxpar.context.zigzag import DIAGONAL, EARLY_KV, FULL, LATE_Q, SKIP
from jaxpar.errors import ConfigError
from jaxpar.kernels import flash
from jaxpar.kernels.attention import choose_block
from jaxpar.mesh import CP, DP, TP

# the name of the K/V buffer that travels (jax.ad_checkpoint.checkpoint_name): a remat
# policy that keeps it gives the backward the forward's buffer, not a recomputed copy
KV_NAME = "ring_kv"
CHUNK = 128         # keys per chunk inside a block (benchmarks/context.py measures the choice)
MAX_CHUNK = 1 << 20


def _size(axis) -> int:
    return 1 if axis is None else jax.lax.axis_size(axis)


def _attend_block(block: int, q, kv, scale, blocks: Blocks):
    """(o, lse) of one block (its kind: zigzag.KINDS) over the queries q it covers (all or
    the late half)."""
    k, v = kv[0], kv[1]
    c = q.shape[3] // 2
    if block in (FULL, DIAGONAL):
        return blocks.forward(q, k, v, scale=scale, causal=block == DIAGONAL)
    if block == EARLY_KV:
        return blocks.forward(q, k[:, :, :c], v[:, :, :c], scale=scale, causal=False)
    return blocks.forward(q[:, :, :, c:], k, v, scale=scale, causal=False)          # LATE_Q


def _forward_step(block: int, q, scale, blocks, o, lse, kv):
    """The running (o, lse) after merging one `block` (its kind: zigzag.KINDS)."""
    if block == SKIP:
        return o, lse
    bo, blse = _attend_block(block, q, kv, scale, blocks)
    if block == LATE_Q:
        c = q.shape[3] // 2
        lo, llse = merge(o[:, :, :, c:], lse[..., c:], bo, blse)
        return o.at[:, :, :, c:].set(lo), lse.at[..., c:].set(llse)
    return merge(o, lse, bo, blse)


def _backward_step(block: int, q, do, lse, delta, scale, blocks, dq, dkv, kv):
    """(dq, dkv) after adding one `block`'s gradients (dkv stacked [dk, dv])."""
    if block == SKIP:
        return dq, dkv
    k, v = kv[0], kv[1]
    c = q.shape[3] // 2
    run = functools.partial(blocks.backward, scale=scale, causal=False)
    if block in (FULL, DIAGONAL):
        bq, bk, bv = blocks.backward(q, k, v, do, lse, delta, scale=scale, causal=block == DIAGONAL)
        return dq + bq, dkv + jnp.stack([bk, bv])
    if block == EARLY_KV:
        bq, bk, bv = run(q, k[:, :, :c], v[:, :, :c], do, lse, delta)
        return dq + bq, dkv.at[:, :, :, :c].add(jnp.stack([bk, bv]))
    late = lambda x: x[..., c:, :]
    bq, bk, bv = run(late(q), k, v, late(do), lse[..., c:], delta[..., c:])
    return dq.at[:, :, :, c:].add(bq), dkv + jnp.stack([bk, bv])


def _dispatch(table: np.ndarray, axis, step_fn):
    """step(r, state, kv) -> step_fn(block of (r, this rank), state, kv): static when the
    plan runs one block kind on every later step, else a lax.switch over the kinds it uses."""
    kinds = sorted(set(int(k) for k in table[1:].flat))
    position = np.zeros(len(zigzag.KINDS), np.int32)
    position[kinds] = np.arange(len(kinds), dtype=np.int32)
    branches = [functools.partial(step_fn, block) for block in kinds]

    def step(r, state, kv):
        if len(kinds) == 1:
            return branches[0](state, kv)
        which = jnp.asarray(position[table])[r, jax.lax.axis_index(axis)]
        return jax.lax.switch(which, branches, state, kv)
    return step


def _ring(cp: int, axis, kv, first, step, after=lambda state: state, hop: str = "ppermute"):
    """The ring loop. state = first(kv) on the own block, then step(r, state, kv_r) for
    r = 1..cp-1 with kv_r the K/V of rank i - r; the held K/V is sent on to rank i+1
    before each step's compute (cp - 1 sends), and `after(state)` runs after every step
    (the backward's dK/dV hop), each send a `hop` (collectives.ring_shift). Steps
    1..cp-2 are one lax.scan: the program does not grow with cp."""
    send = lambda x: ring_shift(x, axis, cp, hop=hop)
    nxt = send(kv) if cp > 1 else None
    state = after(first(kv))
    if cp > 2:
        def body(carry, r):
            state, cur = carry
            ahead = send(cur)
            return (after(step(r, state, cur)), ahead), None
        (state, nxt), _ = jax.lax.scan(body, (state, nxt), jnp.arange(1, cp - 1))
    if cp > 1:
        state = after(step(cp - 1, state, nxt))
    return state


def _forward(q, kv, axis, causal, layout, blocks, hop):
    """(o, lse) of grouped q [B, K, G, Tq, H] over the ring's stacked K/V [2, B, K, Tk, H]; o in q's dtype."""
    cp = _size(axis)
    scale = 1.0 / math.sqrt(q.shape[-1])
    table = zigzag.plan(cp, layout, causal)
    step = _dispatch(table, axis, lambda block, state, kv: _forward_step(block, q, scale, blocks, *state, kv))
    o, lse = _ring(cp, axis, kv, lambda kv: _attend_block(int(table[0, 0]), q, kv, scale, blocks), step, hop=hop)
    return o.astype(q.dtype), lse


def _backward(q, kv, o, lse, do, axis, causal, layout, blocks, hop):
    cp = _size(axis)
    scale = 1.0 / math.sqrt(q.shape[-1])
    table = zigzag.plan(cp, layout, causal)
    dt = acc_dtype(q.dtype)
    delta = jnp.sum(do.astype(dt) * o.astype(dt), axis=-1)
    step = _dispatch(table, axis,
                     lambda block, state, kv: _backward_step(block, q, do, lse, delta, scale, blocks, *state, kv))

    def first(kv):
        zeros = (jnp.zeros(q.shape, dt), jnp.zeros(kv.shape, dt))
        return _backward_step(int(table[0, 0]), q, do, lse, delta, scale, blocks, *zeros, kv)

    send = lambda x: ring_shift(x, axis, cp, hop=hop)
    after = (lambda state: (state[0], send(state[1]))) if cp > 1 else (lambda state: state)
    dq, dkv = _ring(cp, axis, kv, first, step, after, hop=hop)
    return dq.astype(q.dtype), dkv.astype(kv.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _ring_attention(q, kv, axis, causal, layout, blocks, hop):
    return _forward(q, kv, axis, causal, layout, blocks, hop)[0]


def _ring_fwd(q, kv, axis, causal, layout, blocks, hop):
    o, lse = _forward(q, kv, axis, causal, layout, blocks, hop)
    return o, (q, kv, o, lse)


def _ring_bwd(axis, causal, layout, blocks, hop, res, do):
    return _backward(*res, do, axis, causal, layout, blocks, hop)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def relayout_shard(x, *, axis, layout: str, inverse: bool = False, seq_dim: int = 3):
    """This rank's tokens of a sequence split contiguously over `axis`, returned as its
    tokens in `layout` (inverse=True: the way back). For zigzag two collective-permutes
    of half the local tokens each: rank i needs chunks i and 2cp-1-i, one even and one
    odd, and each chunk j sits on rank j // 2; the identity for contiguous or cp = 1."""
    cp = _size(axis)
    if layout == "contiguous" or cp == 1:
        return x
    c = x.shape[seq_dim] // 2
    first, second = (jax.lax.slice_in_dim(x, a, a + c, axis=seq_dim) for a in (0, c))
    even_rank = jax.lax.axis_index(axis) % 2 == 0
    pick = lambda a, b: jnp.where(even_rank, a, b)
    home = lambda j: j if j < cp else 2 * cp - 1 - j      # the rank whose zigzag pair holds chunk j
    if not inverse:   # rank s holds chunks 2s (first) and 2s+1 (second)
        even = jax.lax.ppermute(first, axis, [(s, home(2 * s)) for s in range(cp)])
        odd = jax.lax.ppermute(second, axis, [(s, home(2 * s + 1)) for s in range(cp)])
        return jnp.concatenate([pick(even, odd), pick(odd, even)], axis=seq_dim)
    # rank i holds chunks i (first) and 2cp-1-i (second); chunk j goes home to rank j // 2, half j % 2
    own = lambda i: (i, 2 * cp - 1 - i)
    even_chunk = lambda i: own(i)[i % 2]
    odd_chunk = lambda i: own(i)[1 - i % 2]
    lo = jax.lax.ppermute(pick(first, second), axis, [(i, even_chunk(i) // 2) for i in range(cp)])
    hi = jax.lax.ppermute(pick(second, first), axis, [(i, odd_chunk(i) // 2) for i in range(cp)])
    return jnp.concatenate([lo, hi], axis=seq_dim)


def check_options(*, causal, layout, chunk, relayout=False, custom_backward=True, hop="ppermute") -> int:
    """Refuse (ConfigError) ring attention options that are not: causal, relayout and
    custom_backward booleans, layout one of zigzag.LAYOUTS, chunk a whole number up to
    MAX_CHUNK, hop one of formulas.HOPS. Returns chunk as an int. Each entry point
    (ring_attention, ring_attention_shard, ulysses' hybrid ones) calls it once."""
    errors.flag("causal", causal)
    errors.flag("relayout", relayout)
    errors.flag("custom_backward", custom_backward)
    zigzag.check_layout(layout)
    errors.one_of("hop", hop, HOPS)
    return errors.whole("chunk", chunk, maximum=MAX_CHUNK)


def check_shard_tokens(tokens: int, layout: str) -> None:
    """Refuse a rank's `tokens` the layout cannot cut: zigzag holds two chunks per rank.
    What only the per-shard entry points must check: the global ones check the whole
    sequence (zigzag.check_sequence), which implies it."""
    if layout == "zigzag" and tokens % 2:
        raise ConfigError(f"each rank holds {tokens} tokens: the zigzag layout needs an even number (two chunks per "
                          "rank). Fix: a sequence length that is a multiple of 2*cp")


def ring_attention_shard(q, k, v, *, axis=CP, causal: bool = True, layout: str = "contiguous",
                         relayout: bool = False, chunk: int = CHUNK, hop: str = "ppermute", kernel: str = "xla"):
    """Attention of this shard's queries over the whole ring's keys, inside shard_map.

    q [B, Tc, N, H], k and v [B, Tc, K, H], Tc = T/cp: this rank's tokens, in `layout`
    order (zigzag.to_layout); relayout=True takes them in natural order instead and
    swaps them into the layout and back (`relayout_shard`, 6 collective-permutes under
    zigzag). `axis` names the ring (None: one device, no communication). Returns
    [B, Tc, N, H]. Each block's keys are taken `chunk` at a time (blockwise.chunk_size),
    so scores are Tc x chunk at a time, never Tc x Tc. hop: how K/V move round the ring,
    "ppermute", or "all_to_all" inside a pipeline stage (collectives.ring_shift says why).
    kernel: what computes each block, "xla" (the blockwise ops, keys `chunk` at a time),
    "pallas" (the fused kernel, kernels.flash) or "auto" (kernels.attention.choose_block:
    the XLA blocks until the kernel's GPU tests have passed on a GPU, PALLAS_AUTO).
    Checked here (ConfigError); `attend_ring` is the same without the checks.
    """
    chunk = check_options(causal=causal, layout=layout, chunk=chunk, relayout=relayout, hop=hop)
    _, tokens, _, _, _ = check_qkv(q, k, v, needed_by="ring_attention_shard")
    check_shard_tokens(tokens, layout)
    return attend_ring(q, k, v, axis=axis, causal=causal, layout=layout, relayout=relayout,
                       blocks=Blocks(chunk, block_kernel(kernel, q, tokens, layout)), hop=hop)


def block_kernel(kernel: str, q, tokens: int, layout: str) -> str:
    """The kernel of a ring's blocks for q's dtype and head_dim when a rank holds `tokens`:
    the zigzag layout's blocks are down to half of them (kernels.attention.choose_block)."""
    block = tokens // (2 if layout == "zigzag" else 1)
    return choose_block(kernel, dtype=q.dtype, tq=block, tk=block, head_dim=int(q.shape[-1]))


def attend_ring(q, k, v, *, axis, causal: bool, layout: str, relayout: bool, blocks: Blocks, hop: str,
                custom_backward: bool = True):
    """ring_attention_shard on inputs its entry points have checked (check_options,
    blockwise.check_qkv, check_shard_tokens or zigzag.check_sequence), per shard:
    q [B, Tc, N, H], k and v [B, Tc, K, H] -> [B, Tc, N, H]; `blocks` how each block
    computes (its kernel resolved: block_kernel)."""
    move = functools.partial(relayout_shard, axis=axis, layout=layout if relayout else "contiguous")
    kv = checkpoint_name(jnp.stack([heads_major(k), heads_major(v)]), KV_NAME)   # [2, B, K, Tc, H]: one buffer travels
    o = _ring_kv(move(group(q, k.shape[2])), move(kv), axis, causal, layout, blocks, custom_backward, hop)
    return ungroup(move(o, inverse=True))


def _ring_kv(q, kv, axis, causal, layout, blocks, custom_backward, hop):
    if custom_backward:
        return _ring_attention(q, kv, axis, causal, layout, blocks, hop)
    return _forward(q, kv, axis, causal, layout, blocks, hop)[0]


def qkv_pspec(mesh, *, seq_axes: tuple[str, ...], n_heads: int, n_kv_heads: int, batch_size: int,
              needed_by: str) -> P:
    """The PartitionSpec of q, k, v and the output on `mesh`: batch over dp, sequence over
    `seq_axes`, heads over tp, each only where the mesh has that axis."""
    mesh_lib.require_mesh(mesh, axes=seq_axes, needed_by=needed_by)
    batch = DP if DP in mesh.shape else None
    mesh_lib.require_divisible("batch_size", batch_size, mesh, (DP,), why="dp splits the batch")
    heads = TP if mesh_lib.axis_size(mesh, TP) > 1 else None
    if heads:
        mesh_lib.require_divisible("n_heads", n_heads, mesh, (TP,), why="tp splits the query heads")
        mesh_lib.require_divisible("n_kv_heads", n_kv_heads, mesh, (TP,),
                                   why="tp splits the KV heads with the query heads they serve")
    return P(batch, seq_axes if len(seq_axes) > 1 else seq_axes[0], heads, None)


def ring_attention(q, k, v, *, mesh, causal: bool = True, layout: str = "contiguous", relayout: bool = True,
                   chunk: int = CHUNK, custom_backward: bool = True, kernel: str = "xla"):
    """Ring attention on global arrays: q [B, T, N, H], k and v [B, T, K, H]; equal to
    reference.attention(q, k, v, causal=causal). The sequence is split over the cp axis
    of `mesh`, the batch over dp and the heads over tp where the mesh has them.

    relayout=True takes and returns the sequence in natural order; under zigzag each
    rank then swaps half its tokens into the layout before the ring and back after it
    (`relayout_shard`: 2 collective-permutes for q, 2 for K/V, 2 for the output).
    relayout=False takes it already in layout order (`zigzag.to_layout`, as a data
    loader would deliver it) and returns it so, with no communication beyond the ring's.
    kernel: what computes each block (ring_attention_shard). custom_backward=False
    differentiates the forward loop by autodiff (it keeps every block's scores: the
    reference for the memory-efficient backward).
    """
    errors.flag("relayout", relayout)
    chunk = check_options(causal=causal, layout=layout, chunk=chunk, custom_backward=custom_backward)
    B, T, N, K, H = check_qkv(q, k, v, needed_by="ring_attention")
    pspec = qkv_pspec(mesh, seq_axes=(CP,), n_heads=N, n_kv_heads=K, batch_size=B, needed_by="ring_attention")
    cp = mesh_lib.axis_size(mesh, CP)
    zigzag.check_sequence(T, cp, layout)
    blocks = Blocks(chunk, block_kernel(kernel, q, T // cp, layout))
    shard = functools.partial(attend_ring, axis=CP, causal=causal, layout=layout, relayout=relayout, blocks=blocks,
                              custom_backward=custom_backward, hop="ppermute")
    # Pallas' interpreter (the kernel off a GPU) cannot run inside a shard_map that checks
    # varying axes (its loops lose them); ring attention has no psum for the check to guard
    interpreted = blocks.kernel == "pallas" and flash.interpret_here()
    return jax.shard_map(shard, mesh=mesh, in_specs=(pspec,) * 3, out_specs=pspec,
                         check_vma=not interpreted)(q, k, v)
