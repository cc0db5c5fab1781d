"""ZeRO-1, per shard: the optimizer state sharded over dp (Rajbhandari et al. 2020, stage
1; lecture 8 sec. 7). Adam keeps two moments per weight, twice the weights' own bytes;
under plain data parallelism every dp rank keeps all of them. ZeRO-1 gives each dp rank
a dp-th of every weight to update, along one dimension of its local shard:

    dims = plan(shapes, pspecs, sizes=mesh.shape)     # per leaf: the dim split over dp, -1 none
    # inside shard_map, after the backward (g: this device's share, g[X, ...]{U_dp}):
    g = reduce_scatter_gradients(g, pspecs, dims, batch_axes=("dp",))   # g[X/dp, ...], summed
    own = slice_params(params, dims)                  # w[X/dp, ...]: a slice, no communication
    own = own + adam(g, state)                        # state[X/dp, ...]: 1/dp per device
    params = gather_params(own, dims)                 # w[X, ...] again on every dp rank

The reduce-scatter and the all-gather move what the all-reduce they replace did
(`formulas`); the optimizer's memory and work are 1/dp. `state_pspecs` lays the state out
on the mesh (dp added to the split dimension). A leaf no dimension of which dp divides
keeps its state whole and its gradient all-reduced (-1 in the plan).

ZeRO-2 (the gradients kept as their dp-th from the backward on) and ZeRO-3 (the weights
too, gathered before each use) shard more of the same: they add to this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.data.formulas import summed_axes
from jaxpar.data.reduce import check_layout
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, pspec_axes


def _is_pspec(x) -> bool:
    return isinstance(x, P)


def local_shape(shape: Sequence[int], pspec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of an array of `shape` laid out as `pspec`."""
    entries = tuple(pspec) + (None,) * (len(shape) - len(pspec))
    return tuple(n // math.prod(sizes[a] for a in pspec_axes(P(e))) if e is not None else n
                 for n, e in zip(shape, entries))


def zero_dim(local: Sequence[int], dp: int, *, skip: int = 0) -> int:
    """The dimension of a local shard that ZeRO splits over dp: the largest (after the
    first `skip`) that dp divides, the first of equals; -1 when none does."""
    best = -1
    for d in range(skip, len(local)):
        if local[d] % dp == 0 and (best < 0 or local[d] > local[best]):
            best = d
    return best


def plan(shapes, pspecs, *, sizes: Mapping[str, int], axis: str = DP, skip: int = 0):
    """Per leaf of `shapes` (global shapes, laid out as `pspecs` on a mesh of axis
    `sizes`): the dimension ZeRO splits its optimizer state along over `axis` (zero_dim of
    its local shard; -1 everywhere when the axis is one device). skip: leading dimensions
    never split (a stage layout's pp dimension)."""
    check_layout(shapes, pspecs)
    unknown = sorted({a for s in jax.tree.leaves(pspecs, is_leaf=_is_pspec) for a in pspec_axes(s)} - set(sizes))
    if unknown:
        raise ConfigError(f"pspecs name axes {unknown}; the mesh has {dict(sizes)}: name only its axes")
    dp = sizes.get(axis, 1)
    if dp == 1:
        return jax.tree.map(lambda _: -1, shapes)
    return jax.tree.map(lambda a, s: zero_dim(local_shape(a.shape, s, sizes), dp, skip=skip), shapes, pspecs)


def state_pspec(pspec: P, dim: int, ndim: int, *, axis: str = DP) -> P:
    """`pspec` of an ndim-dimensional leaf with `axis` added (innermost) to dimension
    `dim`: the layout of its optimizer state under ZeRO (unchanged for dim -1)."""
    if dim < 0:
        return pspec
    entries = list(pspec) + [None] * (ndim - len(pspec))
    e = entries[dim]
    entries[dim] = axis if e is None else (*(e if isinstance(e, tuple) else (e,)), axis)
    return P(*entries)


def state_pspecs(pspecs, dims, shapes, *, axis: str = DP):
    """state_pspec of every leaf: the PartitionSpecs of the optimizer state's moments."""
    return jax.tree.map(lambda s, d, a: state_pspec(s, d, len(a.shape), axis=axis), pspecs, dims, shapes,
                        is_leaf=_is_pspec)


def reduce_scatter_gradients(grads, pspecs, dims, *, batch_axes: Sequence[str], extra: Sequence[str] = (),
                             axis: str = DP):
    """reduce.reduce_gradients, but over `axis` a reduce-scatter along each leaf's planned
    dimension: this rank gets its dp-th of the summed gradient, g[..., X/dp, ...] (a leaf
    planned -1 is all-reduced whole). The other axes are summed first, whole."""
    check_layout(grads, pspecs, batch_axes=batch_axes, extra=extra)

    def one(g, pspec, dim):
        over = summed_axes(pspec_axes(pspec), batch_axes, extra)
        if dim < 0:
            return jax.lax.psum(g, over) if over else g
        rest = tuple(a for a in over if a != axis)
        g = jax.lax.psum(g, rest) if rest else g
        return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)
    return jax.tree.map(one, grads, pspecs, dims)


def slice_params(params, dims, *, axis: str = DP):
    """This rank's dp-th of each weight along its planned dimension (a local slice, no
    communication); a leaf planned -1 whole."""
    def one(a, dim):
        if dim < 0:
            return a
        n = a.shape[dim] // jax.lax.axis_size(axis)
        return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(axis) * n, n, axis=dim)
    return jax.tree.map(one, params, dims)


def gather_params(params, dims, *, axis: str = DP):
    """The weights rebuilt from every rank's dp-th: an all-gather over `axis` along each
    leaf's planned dimension, invariant over `axis` again (a leaf planned -1 as it is)."""
    return jax.tree.map(lambda a, dim: a if dim < 0 else jax.lax.all_gather(a, axis, axis=dim, tiled=True,
                                                                             to="invarying"), params, dims)
