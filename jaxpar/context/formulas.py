"""The context-parallel collectives, bytes and step costs in closed form (pure Python: the
planner reads it).

Every `*_collectives` function has the signature shape of the other techniques'
formulas, (*, cfg, batch_size, seq_len, dtype, dp, cp, tp, ..., backward), and returns
the `comms.Collectives` the compiled program shows: the forward (backward=False) or the
backward alone (jit of the function jax.vjp returns). `cfg` needs n_heads, n_kv_heads
and head_dim (a `reference.ModelConfig` has them). b = batch_size/dp rows, heads per tp
shard N/tp and K/tp; one K/V block = 2*b*(T/cp)*(K/tp)*H elements.

    ring     forward: cp-1 collective-permutes of one stacked K/V block.
             backward: cp-1 K/V permutes again, and cp of dK/dV (it travels with its K/V
             and takes one step home), accumulated in float32 at least.
             relayout=True under zigzag adds 6 (q, K/V and the output reordered into the
             layout and back, two halves each) forward, and 6 backward (their transposes).
             hop="all_to_all" (the ring inside a pipeline stage, collectives.ring_shift):
             each of those K/V and dK/dV hops is an all-to-all of an [cp, block] buffer
             (the block in the neighbour's slot, zeros elsewhere): the same count, cp
             times the bytes.
    ulysses  4 all-to-alls forward (q, k, v to head-split; the output back) and 4
             backward, each of the whole local array; K/V heads sent are K/tp, or u when
             u > K/tp (each KV head repeated).
    hybrid   Ulysses over u = ucp on T/(cp*u) tokens, then the ring over cp on T/cp tokens
             with N/(tp*u) query heads and (K sent)/u KV heads.

XLA:CPU runs bf16 collectives in f32, so in bf16 the CPU measures twice these bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.context import zigzag
from jaxpar.errors import ConfigError

@runtime_checkable
class HeadSizes(Protocol):
    """The sizes of `reference.ModelConfig` these formulas read."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class _Local:
    b: int          # batch rows per device
    heads: int      # query heads per tp shard
    kv: int         # KV heads per tp shard
    head_dim: int
    item: int       # bytes per element of dtype
    acc: int        # bytes per element of the backward's accumulators


def _local(cfg, batch_size, seq_len, dtype, dp, tp, axes: dict[str, int]) -> _Local:
    if not isinstance(cfg, HeadSizes):
        raise ConfigError(f"cfg is a {type(cfg).__name__}: give a reference.ModelConfig (n_heads, n_kv_heads, "
                          "head_dim)")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("dp", dp), ("tp", tp), *axes.items()):
        errors.whole(name, value)
    errors.divisible("batch_size", batch_size, "dp", dp, why="dp splits the batch", fix=f"a multiple of {dp}")
    n = 1
    for value in axes.values():
        n *= value
    split = [a for a, value in axes.items() if value > 1] or list(axes)[:1]
    errors.divisible("seq_len", seq_len, " x ".join(split), n, why="each device holds its share of the sequence",
                     fix=f"a multiple of {n}")
    for name in ("n_heads", "n_kv_heads"):
        errors.divisible(name, getattr(cfg, name), "tp", tp, why="tp splits the heads", fix="another tp")
    item = np.dtype(dtype).itemsize
    return _Local(batch_size // dp, cfg.n_heads // tp, cfg.n_kv_heads // tp, cfg.head_dim, item, max(item, 4))


def kv_heads_sent(n_heads: int, n_kv_heads: int, u: int, *, axis: str = "ucp") -> int:
    """KV heads Ulysses over u devices (mesh axis `axis`) sends per token: K when u
    divides K, u when K divides u (each KV head repeated u/K times). Refuses head counts
    it cannot split."""
    if n_heads % u:
        raise ConfigError(f"n_heads={n_heads} is not divisible by {axis}={u}: Ulysses gives each of the {u} devices "
                          f"n_heads/{u} whole heads. Fix: {axis} in ({errors.divisors(n_heads)}), or the ring "
                          "(context.ring_attention), which splits the sequence instead")
    if n_kv_heads % u and u % n_kv_heads:
        raise ConfigError(f"n_kv_heads={n_kv_heads} and {axis}={u}: Ulysses splits the KV heads {u} ways or repeats "
                          f"each one {axis}/n_kv_heads times, so one must divide the other. Fix: {axis} in "
                          f"({errors.divisors(n_kv_heads)}) or a multiple of {n_kv_heads}")
    return n_kv_heads if n_kv_heads % u == 0 else u


# how K/V move one place round the ring (collectives.ring_shift's `hop`; ring.check_options)
HOPS = ("ppermute", "all_to_all")


def _ring(loc: _Local, tokens: int, heads: int, kv: int, cp: int, relayout: bool, backward: bool,
          hop: str = "ppermute") -> Collectives:
    if cp == 1:
        return Collectives()
    block = 2 * loc.b * tokens * kv * loc.head_dim          # elements of one stacked K/V block
    q = loc.b * tokens * heads * loc.head_dim
    width = cp if hop == "all_to_all" else 1                 # an all-to-all hop exchanges [cp, block]
    if backward:
        count, nbytes = 2 * cp - 1, width * ((cp - 1) * block * loc.item + cp * block * loc.acc)
    else:
        count, nbytes = cp - 1, width * (cp - 1) * block * loc.item
    kind = "all-to-all" if hop == "all_to_all" else "collective-permute"
    out = Collectives({kind: (count, nbytes)})
    if relayout:   # q, K/V and the output (or dO, dQ, dK/dV): two halves each
        out = out + Collectives({"collective-permute": (6, (2 * q + block) * loc.item)})
    return out


def _ulysses(loc: _Local, tokens: int, kv_sent: int) -> Collectives:
    q = loc.b * tokens * loc.heads * loc.head_dim
    kv = loc.b * tokens * kv_sent * loc.head_dim
    return Collectives({"all-to-all": (4, (2 * q + 2 * kv) * loc.item)})


def _hybrid(cfg, batch_size, seq_len, dtype, dp, cp, u, tp, layout, relayout, backward, ulysses_axis,
            hop="ppermute") -> Collectives:
    loc = _local(cfg, batch_size, seq_len, dtype, dp, tp, {"cp": cp, ulysses_axis: u})
    relayout = zigzag.check_layout(layout) == "zigzag" and errors.flag("relayout", relayout)
    errors.flag("backward", backward)
    errors.one_of("hop", hop, HOPS)
    out = Collectives()
    kv = loc.kv
    if u > 1:
        kv = kv_heads_sent(loc.heads, loc.kv, u, axis=ulysses_axis)
        out = _ulysses(loc, seq_len // (cp * u), kv)
    return out + _ring(loc, seq_len // cp, loc.heads // u, kv // u, cp, relayout, backward, hop)


def hybrid_collectives(*, cfg: HeadSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, cp: int = 1,
                       ucp: int = 1, tp: int = 1, layout: str = "contiguous", relayout: bool = False,
                       backward: bool = False) -> Collectives:
    """Ulysses over ucp inside, the ring over cp outside (ulysses.hybrid_attention)."""
    return _hybrid(cfg, batch_size, seq_len, dtype, dp, cp, ucp, tp, layout, relayout, backward, "ucp")


def ring_collectives(*, cfg: HeadSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, cp: int = 1,
                     tp: int = 1, layout: str = "contiguous", relayout: bool = False, hop: str = "ppermute",
                     backward: bool = False) -> Collectives:
    """ring.ring_attention's forward or backward program (hop: how K/V move, see above)."""
    return _hybrid(cfg, batch_size, seq_len, dtype, dp, cp, 1, tp, layout, relayout, backward, "ucp", hop)


def ulysses_collectives(*, cfg: HeadSizes, batch_size: int, seq_len: int, dtype, dp: int = 1, cp: int = 1,
                        tp: int = 1, backward: bool = False) -> Collectives:
    """ulysses.ulysses_attention (Ulysses over cp) forward or backward program."""
    return _hybrid(cfg, batch_size, seq_len, dtype, dp, 1, cp, tp, "contiguous", False, backward, "cp")


def ring_step(*, cfg: HeadSizes, batch_size: int, seq_len: int, dtype, cp: int) -> dict[str, float]:
    """One ring step of one device, without data parallelism (exercise 6b): the FLOPs of a
    full block (QK^T and PV, 2*2*c^2*N*H for c = T/cp tokens per device), the bytes of
    the K/V block it sends (2*c*K*H), and their ratio. The FLOPs grow with c^2 and the
    bytes with c, so a longer sequence hides the transfer behind the compute."""
    loc = _local(cfg, batch_size, seq_len, dtype, 1, 1, {"cp": cp})
    c = seq_len // cp
    flops = 4 * loc.b * c * c * loc.heads * loc.head_dim
    sent = 2 * loc.b * c * loc.kv * loc.head_dim * loc.item
    return {"tokens_per_device": c, "flops": flops, "bytes": sent, "flops_per_byte": flops / sent}
