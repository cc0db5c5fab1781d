"""DeepSpeed-Ulysses (lecture 5.3) and 2-D context parallelism: Ulysses inside, ring outside.

    ulysses_attention_shard(q, k, v, *, axis, causal)     per-shard, inside shard_map
    ulysses_attention(q, k, v, *, mesh, causal)           global [B, T, N, H] arrays, over cp
    hybrid_attention_shard(q, k, v, *, ulysses_axis, ring_axis, causal, layout)
    hybrid_attention(q, k, v, *, mesh, causal, layout)    over ucp (Ulysses) x cp (ring)

As in ring.py, each entry point checks its inputs once and runs the unchecked
`attend_hybrid`.

Ulysses turns "split by sequence" into "split by heads" with one all-to-all for each of
q, k and v: each of the u devices then holds the whole sequence for N/u query heads,
attends exactly as one device would, and a fourth all-to-all turns the output back.
Grouped-query aware: K/V travel with their K heads split u ways when u divides K; when
K divides u instead, each KV head is repeated u/K times first, so every device receives
the one KV head its N/u query heads read.

2-D (USP-style): the sequence is split over (cp, ucp) with ucp minor. The all-to-all over
ucp gives each device the cp-th part of the sequence for N/u heads; ring attention over
cp (any layout) finishes the job, and the way back is the same all-to-all. The
all-to-all's volume falls with u while the ring's K/V blocks shrink with u too, which is
why Ulysses goes on the fast inner links and the ring on the outer ones.

The attention inside (one device's whole sequence, or the ring) is ring.py's, keeping
only out and log-sum-exp for its backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar import mesh as mesh_lib
from jaxpar.context import zigzag
from jaxpar.context.blockwise import Blocks, check_qkv
from jaxpar.context.formulas import kv_heads_sent
from jaxpar.context.ring import (CHUNK, attend_ring, block_kernel, check_options, check_shard_tokens,
                                 qkv_pspec)
from jaxpar.errors import ConfigError
from jaxpar.kernels.attention import IMPLEMENTATIONS, attention, choose
from jaxpar.mesh import CP, UCP


def _to_heads(x, axis):
    """[B, T/u, h, H] split by sequence -> [B, T, h/u, H] split by heads."""
    return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(x, axis):
    """The inverse: [B, T, h/u, H] -> [B, T/u, h, H]."""
    return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def hybrid_attention_shard(q, k, v, *, ulysses_axis=UCP, ring_axis=CP, causal: bool = True,
                           layout: str = "contiguous", relayout: bool = False, chunk: int = CHUNK,
                           kernel: str = "xla"):
    """Attention of this shard's tokens, inside shard_map over both context axes.

    q [B, Tc, N, H], k and v [B, Tc, K, H], Tc = T/(cp*u): this device's tokens, the
    sequence split over (ring_axis, ulysses_axis), ulysses minor. ulysses_axis=None is
    ring attention alone, ring_axis=None Ulysses alone. The ring sees its cp-th of the
    sequence in `layout` order; relayout=True takes natural order and reorders the
    gathered tokens into the layout and back around the ring (ring.relayout_shard).
    Ulysses alone (ring_axis=None) under `layout` "zigzag": the u devices hold the
    sequence in zigzag order (zigzag.to_layout over u), so the gathered sequence is in
    that order too; it is put back in natural order, a local gather, before the causal
    mask and in layout order again after. kernel: how a device attends to a whole
    sequence (ring_axis=None): "xla", blockwise `chunk` keys at a time (ring.py's, cp = 1),
    or a fused kernel, "cudnn", "pallas" or "auto" (kernels.attention.choose); the ring's
    blocks (ring_axis set) take the same option through kernels.attention.choose_block
    ("cudnn" meaning the XLA blocks there: cuDNN cannot merge). Checked here
    (ConfigError); `attend_hybrid` is the same without the checks.
    """
    chunk = check_options(causal=causal, layout=layout, chunk=chunk, relayout=relayout)
    errors.one_of("kernel", kernel, IMPLEMENTATIONS)
    _, tokens, _, _, _ = check_qkv(q, k, v, needed_by="hybrid_attention_shard")
    u = 1 if ulysses_axis is None else jax.lax.axis_size(ulysses_axis)
    if ring_axis is not None:
        check_shard_tokens(tokens * u, layout)       # the ring's tokens: this device's from each of the u
    return attend_hybrid(q, k, v, ulysses_axis=ulysses_axis, ring_axis=ring_axis, causal=causal, layout=layout,
                         relayout=relayout, chunk=chunk, kernel=kernel)


def _whole(q, k, v, *, causal: bool, chunk: int, kernel: str):
    """One device's attention over the whole sequence [B, T, h, H]: blockwise in XLA
    (ring attention over no axis) or through a fused kernel."""
    impl = "xla" if kernel == "xla" else choose(kernel, dtype=q.dtype, head_dim=int(q.shape[-1]),
                                                 seq_len=int(q.shape[1]))
    if impl != "xla":
        return attention(q, k, v, causal=causal, implementation=impl)
    return attend_ring(q, k, v, axis=None, causal=causal, layout="contiguous", relayout=False, blocks=Blocks(chunk),
                       hop="ppermute")


def attend_hybrid(q, k, v, *, ulysses_axis, ring_axis, causal: bool, layout: str, relayout: bool, chunk: int,
                  kernel: str = "xla"):
    """hybrid_attention_shard on inputs its entry points have checked (ring.check_options,
    blockwise.check_qkv, the sequence's cut), per shard: q [B, Tc, N, H], k and v
    [B, Tc, K, H] -> [B, Tc, N, H]."""
    N, K = q.shape[2], k.shape[2]
    u = 1 if ulysses_axis is None else jax.lax.axis_size(ulysses_axis)
    if u > 1:
        sent = kv_heads_sent(N, K, u, axis=ulysses_axis)
        if sent != K:
            k, v = (jnp.repeat(a, sent // K, axis=2) for a in (k, v))
        q, k, v = (_to_heads(a, ulysses_axis) for a in (q, k, v))
    natural = ring_axis is None and u > 1 and causal and layout != "contiguous" and not relayout
    if natural:      # [B, T, h/u, H] in layout order -> natural order, where the causal mask holds
        q, k, v = (zigzag.from_layout(a, u, layout, axis=1) for a in (q, k, v))
    if ring_axis is None:
        o = _whole(q, k, v, causal=causal, chunk=chunk, kernel=kernel)
    else:
        blocks = Blocks(chunk, block_kernel("xla" if kernel == "cudnn" else kernel, q, q.shape[1], layout))
        o = attend_ring(q, k, v, axis=ring_axis, causal=causal, layout=layout, relayout=relayout, blocks=blocks,
                        hop="ppermute")
    if natural:
        o = zigzag.to_layout(o, u, layout, axis=1)
    return _to_sequence(o, ulysses_axis) if u > 1 else o


def ulysses_attention_shard(q, k, v, *, axis=CP, causal: bool = True, layout: str = "contiguous",
                            kernel: str = "xla"):
    """Ulysses alone over `axis`, inside shard_map: q [B, T/u, N, H], k and v [B, T/u, K, H],
    this device's tokens of a sequence in `layout` order (zigzag.to_layout over u).
    kernel: the whole-sequence attention (hybrid_attention_shard)."""
    return hybrid_attention_shard(q, k, v, ulysses_axis=axis, ring_axis=None, causal=causal, layout=layout,
                                  kernel=kernel)


def hybrid_attention(q, k, v, *, mesh, causal: bool = True, layout: str = "contiguous", ring_axis: str | None = CP,
                     ulysses_axis: str | None = UCP, relayout: bool = True, chunk: int = CHUNK):
    """2-D context parallelism on global arrays q [B, T, N, H], k and v [B, T, K, H]:
    Ulysses over `ulysses_axis` inside, ring attention over `ring_axis` outside; equal
    to reference.attention(q, k, v, causal=causal). Batch over dp and heads over tp
    where the mesh has them. relayout as in ring_attention (natural order in and out);
    relayout=False takes and returns the sequence in `layout` order over the ring's cp,
    or over the Ulysses devices when ring_axis is None (zigzag.to_layout)."""
    return _global_attention(q, k, v, mesh=mesh, causal=causal, layout=layout, axes=(ring_axis, ulysses_axis),
                             relayout=relayout, chunk=chunk, kernel="xla")


def ulysses_attention(q, k, v, *, mesh, causal: bool = True, axis: str = CP, layout: str = "contiguous",
                      chunk: int = CHUNK, kernel: str = "xla"):
    """Ulysses on global arrays over `axis` (cp): equal to reference.attention. layout:
    the order of the sequence in and out (zigzag: zigzag.to_layout over the cp devices,
    as a composed model holds its tokens; the causal mask follows it). kernel: the
    whole-sequence attention on each device (hybrid_attention_shard); "cudnn" is refused
    (ConfigError) where it cannot run."""
    return _global_attention(q, k, v, mesh=mesh, causal=causal, layout=layout, axes=(None, axis), relayout=False,
                             chunk=chunk, kernel=kernel)


def _global_attention(q, k, v, *, mesh, causal: bool, layout: str, axes: tuple, relayout: bool, chunk: int,
                      kernel: str):
    """hybrid_attention and ulysses_attention: axes = (ring_axis, ulysses_axis), either None."""
    ring_axis, ulysses_axis = axes
    errors.flag("relayout", relayout)
    errors.one_of("kernel", kernel, IMPLEMENTATIONS)
    chunk = check_options(causal=causal, layout=layout, chunk=chunk)
    B, T, N, K, H = check_qkv(q, k, v, needed_by="hybrid_attention")
    seq_axes = tuple(a for a in axes if a is not None)
    if not seq_axes:
        raise ConfigError("hybrid_attention needs ring_axis, ulysses_axis or both: give the mesh axis names")
    pspec = qkv_pspec(mesh, seq_axes=seq_axes, n_heads=N, n_kv_heads=K, batch_size=B, needed_by="hybrid_attention")
    tp = mesh_lib.axis_size(mesh, mesh_lib.TP)
    u = mesh_lib.axis_size(mesh, ulysses_axis) if ulysses_axis else 1
    cp = mesh_lib.axis_size(mesh, ring_axis) if ring_axis else 1
    if u > 1:
        kv_heads_sent(N // tp, K // tp, u, axis=ulysses_axis)
    mesh_lib.require_divisible("seq_len", T, mesh, seq_axes, why="each device holds seq_len/(cp*u) tokens")
    zigzag.check_sequence(T, cp if ring_axis else u, layout)
    if ring_axis is None:       # before compiling: the kernel asked for can run these inputs
        choose(kernel, dtype=q.dtype, head_dim=H, platform=mesh.devices.flat[0].platform)
    shard = functools.partial(attend_hybrid, ulysses_axis=ulysses_axis if u > 1 else None, ring_axis=ring_axis,
                              causal=causal, layout=layout, relayout=relayout, chunk=chunk, kernel=kernel)
    return jax.shard_map(shard, mesh=mesh, in_specs=(pspec,) * 3, out_specs=pspec)(q, k, v)
