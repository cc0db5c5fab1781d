"""Data parallelism's collectives in closed form (pure Python): the gradient reduction
and ZeRO-1's reduce-scatter and all-gather, from the weights as one device holds them.

A weight enters as a `Weight`: the bytes of this device's shard of it, the mesh axes its
PartitionSpec names, the axes its gradient is summed over beyond the batch axes (pp for
the embedding and the LM head, whose gradient only their stage's device holds), and
whether ZeRO splits its optimizer state over dp (`zero.plan` found a dimension).

    reduction  each weight's gradient, nbytes, all-reduced over the batch axes its
               PartitionSpec does not split, then its extra axes; under ZeRO over the
               same axes but dp, whose share is the reduce-scatter below
    ZeRO-1     per ZeRO weight, a reduce-scatter over dp of its gradient (nbytes: the
               operand, the whole local gradient) and an all-gather over dp of its
               updated dp-th (nbytes: the gathered result); ZeRO-2 the same
    ZeRO-3     per use of a ZeRO weight (a layer's forward and backward on one
               microbatch): an all-gather of it forward, another in the backward where
               the pullback reads the weight itself (`regather`), and a reduce-scatter
               of its gradient, each nbytes; its all-reduce over dp is gone

Bytes are logical sizes (`comms`' convention). On a ring of n devices a device sends
2(n-1)/n of an all-reduce's bytes and (n-1)/n of a reduce-scatter's or all-gather's, so
ZeRO-1's pair sends what the all-reduce did (Rajbhandari et al. 2020, sec. 7).
Axes of one device are left out: the step names only the axes that split.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError

DP = "dp"      # jaxpar.mesh.DP (mesh imports JAX; this module must not)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weight:
    """One weight as data parallelism sees it. nbytes: this device's shard (its local
    gradient is the same size); itemsize: bytes per element; split: the mesh axes its
    PartitionSpec names; extra: axes its gradient is also summed over; zero: ZeRO splits
    its optimizer state (and reduce-scatters its gradient) over dp."""

    nbytes: int
    itemsize: int
    split: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    zero: bool = False
    # ZeRO-3: the backward reads this weight itself (a matmul's matrix), so it is gathered
    # again there; a norm's gain (its pullback keeps the gain broadcast) and an embedding
    # (a lookup's pullback reads no weight) are not
    regather: bool = False

    def __post_init__(self):
        errors.whole("nbytes", self.nbytes, minimum=0)
        errors.whole("itemsize", self.itemsize)
        for name in ("split", "extra"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(a, str) for a in value):
                raise ConfigError(f"{name}={value!r}: give a tuple of mesh axis names, e.g. ('tp',)")
        errors.flag("zero", self.zero)
        errors.flag("regather", self.regather)


def summed_axes(split: Collection[str], batch_axes: Sequence[str], extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The axes a gradient is summed over: the batch axes its layout does not split
    (`split`: the axes its PartitionSpec names), in batch_axes' order, then `extra`."""
    return tuple(a for a in batch_axes if a not in split) + tuple(extra)


def all_reduce_axes(weight: Weight, batch_axes: Sequence[str]) -> tuple[str, ...]:
    """The axes the all-reduce of a weight's gradient spans: summed_axes, but under ZeRO
    without dp (its reduce-scatter's axis)."""
    over = summed_axes(weight.split, batch_axes, weight.extra)
    return tuple(a for a in over if a != DP) if weight.zero else over


def group_size(axes: Iterable[str], sizes: Mapping[str, int]) -> int:
    """The devices one all-reduce over `axes` spans (1: no collective)."""
    return math.prod(sizes[a] for a in axes)


def reduction_bytes(weights: Iterable[Weight], *, sizes: Mapping[str, int],
                    batch_axes: Sequence[str]) -> dict[int, float]:
    """{group size: bytes} of the all-reduces summing the gradients (count-free: XLA's
    combiner fuses all-reduces of one group into fewer instructions, the bytes stay)."""
    out: dict[int, float] = {}
    for w in weights:
        n = group_size(all_reduce_axes(w, batch_axes), sizes)
        if n > 1:
            out[n] = out.get(n, 0.0) + w.nbytes
    return out


def zero_bytes(weights: Iterable[Weight], *, dp: int) -> dict[str, float]:
    """{"reduce-scatter": bytes, "all-gather": bytes} of ZeRO-1 over dp devices: each
    ZeRO weight's local bytes, once each way (0 when dp is one device)."""
    total = float(sum(w.nbytes for w in weights if w.zero)) if dp > 1 else 0.0
    return {"reduce-scatter": total, "all-gather": total}


def dp_collectives(weights: Sequence[Weight], *, sizes: Mapping[str, int],
                   batch_axes: Sequence[str]) -> Collectives:
    """The reduction and ZeRO-1 as the compiled program runs them: one all-reduce per
    group of devices (XLA:CPU's combiner merges the gradients' all-reduces of one group,
    all ready after the backward, into one instruction at these sizes; the bytes hold
    at any size), and one reduce-scatter and one all-gather per ZeRO weight."""
    groups: dict[frozenset, float] = {}
    for w in weights:
        axes = frozenset(a for a in all_reduce_axes(w, batch_axes) if sizes[a] > 1)
        if axes:
            groups[axes] = groups.get(axes, 0.0) + w.nbytes
    dp = sizes.get(DP, 1)
    zero = [w for w in weights if w.zero] if dp > 1 else []
    total = zero_bytes(zero, dp=dp)
    return Collectives({"all-reduce": (len(groups), sum(groups.values())),
                        "reduce-scatter": (len(zero), total["reduce-scatter"]),
                        "all-gather": (len(zero), total["all-gather"])})


def zero3_bytes(weights: Iterable[Weight], *, dp: int, forward: float, backward: float,
                scatters: float) -> dict[str, float]:
    """{"all-gather": bytes, "reduce-scatter": bytes} of ZeRO-3 over dp devices: each ZeRO
    weight's bytes nbytes (its local shard over the other axes: the gathered size, and
    its gradient's before the scatter) gathered `forward` times, those with `regather`
    `backward` times more, and scattered `scatters` times (0 when dp is one device).
    Per layer per microbatch that is 2 gathers and 1 scatter: the weights move about
    three times their bytes per use, where ZeRO-1 moves them twice per step."""
    if dp == 1:
        return {"all-gather": 0.0, "reduce-scatter": 0.0}
    weights = [w for w in weights if w.zero]
    total = float(sum(w.nbytes for w in weights))
    again = float(sum(w.nbytes for w in weights if w.regather))
    return {"all-gather": forward * total + backward * again, "reduce-scatter": scatters * total}
