"""Data parallelism's gradient reduction, per shard (lecture 8 sec. 1; PyTorch DDP, Li et
al. 2020): the one reduction every runtime ends with.

Each device of the batch axes (dp; in the composed model also ep, and cp, which splits
the sequence) runs the same model on its own rows and gets the gradient of its rows'
share of the loss: g{U_batch}, a partial sum. The step sums the shares ONCE, after the
backward: each weight's gradient over the batch axes its PartitionSpec does not split.
A weight split over a batch axis (an expert's FFN over ep) is a different weight on each
device of that axis; its gradient there is already whole and is not summed.

    grads = reduce_gradients(grads, pspecs, batch_axes=("dp",))   # inside shard_map
    # g[...]{U_dp} -> psum over dp -> g[...]: one all-reduce of the local gradient per
    # weight (XLA's combiner merges those of one group; formulas.reduction_bytes)

The caller scales each device's loss by 1 / (the devices of the batch axes) (or takes
its rows' sum over the global count), so that the sum is the gradient of the mean.
For the sum to happen here and only here the parameters must be typed varying over
the batch axes before differentiating (`collectives.varying`): the gradient of an
invariant parameter is summed over the axis by autodiff already (pvary's transpose).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.data import formulas
from jaxpar.errors import ConfigError
from jaxpar.mesh import pspec_axes


def _is_pspec(x) -> bool:
    return isinstance(x, P)


def check_layout(tree, pspecs, *, batch_axes: Sequence[str] = (), extra: Sequence[str] = ()) -> None:
    """Refuse (ConfigError) `pspecs` that are not one PartitionSpec per leaf of `tree`,
    and axis lists that are not mesh axis names: checked while tracing, before any compute."""
    for name, axes in (("batch_axes", batch_axes), ("extra", extra)):
        if isinstance(axes, str) or not all(isinstance(a, str) for a in axes):
            raise ConfigError(f"{name}={axes!r}: give a tuple of mesh axis names, e.g. ('dp',)")
    want, got = jax.tree.structure(tree), jax.tree.structure(pspecs, is_leaf=_is_pspec)
    bad = [s for s in jax.tree.leaves(pspecs, is_leaf=_is_pspec) if not _is_pspec(s)]
    if want != got or bad:
        raise ConfigError(f"pspecs {got} for gradients {want}: give one jax.sharding.PartitionSpec per leaf, "
                          "the same structure" + (f" ({bad[0]!r} is a {type(bad[0]).__name__})" if bad else ""))


def check_bound(axes: Sequence[str], *, caller: str) -> None:
    """Refuse (ConfigError) a mesh axis of `axes` that no enclosing shard_map binds: per-shard
    code called outside shard_map (or over a mesh without that axis)."""
    for a in axes:
        try:
            jax.lax.axis_size(a)
        except NameError:
            raise ConfigError(f"{caller} sums over mesh axis {a!r}, which nothing binds here: it is per-shard "
                              f"code. Fix: call it inside jax.shard_map over a mesh with a {a!r} axis") from None


def reduce_gradients(grads, pspecs, *, batch_axes: Sequence[str], extra: Sequence[str] = ()):
    """Each leaf of `grads` (this device's share) psum'd over the batch axes its
    PartitionSpec in `pspecs` (the same structure) does not split, and over `extra`
    (e.g. pp, for a weight only one pipeline stage's device holds a gradient of). Per
    shard: call inside shard_map (ConfigError outside, for an axis it would sum over).
    Leaves stay their local shape; an empty sum is no op."""
    check_layout(grads, pspecs, batch_axes=batch_axes, extra=extra)

    def one(g, pspec):
        over = formulas.summed_axes(pspec_axes(pspec), batch_axes, extra)
        check_bound(over, caller="reduce_gradients")
        return jax.lax.psum(g, over) if over else g
    return jax.tree.map(one, grads, pspecs)


def weights(shapes, pspecs, *, sizes: Mapping[str, int], extra: Sequence[str] = (),
            zero_dims=None) -> list[formulas.Weight]:
    """The leaves of `shapes` (global arrays or ShapeDtypeStructs) laid out as `pspecs` on
    a mesh of axis `sizes`, as `formulas` reads them; `zero_dims` (zero.plan's, the same
    structure) marks the weights ZeRO splits."""
    dims = jax.tree.leaves(zero_dims) if zero_dims is not None else [-1] * len(jax.tree.leaves(shapes))
    out = []
    for a, pspec, d in zip(jax.tree.leaves(shapes), jax.tree.leaves(pspecs, is_leaf=_is_pspec), dims, strict=True):
        axes = pspec_axes(pspec)
        item = jnp.dtype(a.dtype).itemsize
        out.append(formulas.Weight(nbytes=math.prod(a.shape) // math.prod(sizes[x] for x in axes) * item,
                                   itemsize=item, split=tuple(sorted(axes)), extra=tuple(extra), zero=d >= 0))
    return out
