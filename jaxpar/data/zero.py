"""ZeRO-1, -2 and -3 (FSDP), per shard. ZeRO-1: the optimizer state sharded over dp
(Rajbhandari et al. 2020, stage 1; lecture 8 sec. 7). Adam keeps two moments per weight,
twice the weights' own bytes; under plain data parallelism every dp rank keeps all of
them. ZeRO-1 gives each dp rank a dp-th of every weight to update, along one dimension
of its local shard:

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

ZeRO-2 keeps the gradients as their dp-th from the reduction on. Inside one compiled step
that is what the program above already does: the full local gradient is a temporary of
the backward either way, reduce-scattered once, and only the dp-th lives on into the
optimizer. So the trainer's zero=2 compiles to ZeRO-1's program (tests/train/
test_zero3.py holds its collectives equal); the two differ only where gradients outlive
one backward (accumulated over several backward passes), which a one-jit step has not.

ZeRO-3 (FSDP) stores the weights themselves as their dp-th (their PartitionSpecs gain dp,
`state_pspecs`) and gathers them where they are used, inside each layer's function:

    layer = gathered(layer_fn, dims)        # dims: the layer's leaves' planned dimensions
    y = layer(p, x)                         # p[..., X/dp, ...]: all-gather over dp, run

The all-gather's transpose is a reduce-scatter over dp: the gradient of p comes out of
the layer's backward as its dp-th, summed over dp already (the step's reduction then
skips dp for it: its pspec names dp). The gathered weights are not kept for the backward:
the layer's vjp keeps its residuals but them (a jax.custom_vjp keeps p, the dp-th,
instead), and the backward gathers them again (FSDP's re-gather): per use, 2 all-gathers
of the layer's weights and 1 reduce-scatter of its gradient (`formulas.zero3_bytes`; a
weight the pullback does not read, as an embedding's, is not gathered again). The
optimizer updates the dp-th each rank holds; nothing is gathered after it.

    layer = gathered(layer_fn, dims, fuse=True)   # the trainer's: one flat buffer per layer

gathers the layer's weights with one all-gather (FSDP's flat parameter: each dp-th
flattened and concatenated, `_flat_gather`) and reduce-scatters their gradients with one
(`_flat_scatter`), per group of one dtype and one type (the mesh axes a weight varies
over): the same bytes, a dp-wide rendezvous per layer instead of per weight. A weight
split along its first dimension comes out of the gathered buffer [dp, N] as a slice, a
reshape away from its place; along another it is a transpose, so the trainer plans
ZeRO-3's dimensions with plan(..., first=True): the first dimension dp divides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import errors
from jaxpar.collectives import varying_axes
from jaxpar.data.formulas import summed_axes
from jaxpar.data.reduce import check_bound, check_layout
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, pspec_axes


def _is_pspec(x) -> bool:
    return isinstance(x, P)


def local_shape(shape: Sequence[int], pspec: P, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard of an array of `shape` laid out as `pspec`."""
    entries = tuple(pspec) + (None,) * (len(shape) - len(pspec))
    return tuple(n // math.prod(sizes[a] for a in pspec_axes(P(e))) if e is not None else n
                 for n, e in zip(shape, entries))


def zero_dim(local: Sequence[int], dp: int, *, skip: int = 0, first: bool = False) -> int:
    """The dimension of a local shard that ZeRO splits over dp: the largest (after the
    first `skip`) that dp divides, the first of equals; -1 when none does. first: the
    first that dp divides instead (a flat buffer's layout, `gather_for_use`)."""
    best = -1
    for d in range(skip, len(local)):
        if local[d] % dp == 0 and (best < 0 or local[d] > local[best]):
            best = d
            if first:
                break
    return best


def plan(shapes, pspecs, *, sizes: Mapping[str, int], axis: str = DP, skip: int = 0, first: bool = False):
    """Per leaf of `shapes` (global shapes, laid out as `pspecs` on a mesh of axis
    `sizes`): the dimension ZeRO splits its optimizer state along over `axis` (zero_dim of
    its local shard; -1 everywhere when the axis is one device, or absent from `sizes`: a
    mesh without it). skip: leading dimensions never split (a stage layout's pp
    dimension). first: the first dimension dp divides, not the largest (`zero_dim`).
    Checked first (`check_plan`)."""
    check_plan(shapes, pspecs, sizes=sizes, axis=axis, skip=skip, first=first)
    dp = sizes.get(axis, 1)
    if dp == 1:
        return jax.tree.map(lambda _: -1, shapes)
    return jax.tree.map(lambda a, s: zero_dim(local_shape(a.shape, s, sizes), dp, skip=skip, first=first),
                        shapes, pspecs)


def check_plan(shapes, pspecs, *, sizes, axis, skip, first) -> None:
    """Refuse (ConfigError) what `plan` cannot read: pspecs not one PartitionSpec per leaf,
    a leaf that is not an array (or ShapeDtypeStruct), sizes not whole numbers >= 1 by
    axis name, a pspec naming an axis `sizes` lacks or more dimensions than its leaf has,
    a dimension its pspec's axes do not divide, skip not a whole number >= 0, first not a
    bool."""
    check_layout(shapes, pspecs)
    errors.mapping("sizes", sizes, "mesh.shape")
    for name, n in sizes.items():
        errors.whole(f"sizes[{name!r}]", n, fix="give each mesh axis its device count, e.g. sizes=mesh.shape")
    if not isinstance(axis, str):
        raise ConfigError(f"axis={axis!r}: give the name of the mesh axis ZeRO splits over, e.g. axis='dp'")
    errors.whole("skip", skip, minimum=0, fix="skip counts the leading dimensions never split, e.g. skip=1")
    errors.flag("first", first)
    unknown = sorted({a for s in jax.tree.leaves(pspecs, is_leaf=_is_pspec) for a in pspec_axes(s)} - set(sizes))
    if unknown:
        raise ConfigError(f"pspecs name axes {unknown}; the mesh has {dict(sizes)}: name only its axes")
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    for (path, a), pspec in zip(leaves, jax.tree.leaves(pspecs, is_leaf=_is_pspec)):
        where = f"shapes{jax.tree_util.keystr(path)}"
        shape = errors.array(where, a, nonempty=False)
        if len(pspec) > len(shape):
            raise ConfigError(f"{where} has shape {shape} but its pspec {pspec} names {len(pspec)} dimensions: "
                              f"give a pspec of at most {len(shape)} entries")
        for d, entry in enumerate(pspec):
            axes = sorted(pspec_axes(P(entry)))
            if axes:
                n = math.prod(sizes[x] for x in axes)
                errors.divisible(f"dimension {d} of {where}", shape[d], " x ".join(axes), n,
                                 why=f"its pspec {pspec} splits it {n} ways, one piece per device",
                                 fix="a pspec whose axes divide the dimension, or a mesh that does")


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
        check_bound(over, caller="reduce_scatter_gradients")
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


# ---- ZeRO-3: the weights gathered where they are used ------------------------------------

SCOPE = "zero3_gather"          # the named scope of the gathers and the reduce-scatters


def _groups(arrays: Mapping, dims: Mapping[str, int]) -> list[list[str]]:
    """The names of `arrays` planned dims >= 0, grouped by (dtype, the mesh axes they vary
    over): the leaves one flat buffer can carry without changing their type (`fused`)."""
    groups: dict = {}
    for name, a in arrays.items():
        if dims.get(name, -1) >= 0:
            groups.setdefault((jnp.dtype(a.dtype), varying_axes(a)), []).append(name)
    return list(groups.values())


def _flat_gather(shards: Sequence, dims: Sequence[int], axis: str) -> list:
    """The leaves `shards` (each [..., X/dp, ...] along its dims entry) gathered over
    `axis` with one all-gather: each shard flattened into one buffer [N], gathered as
    [dp, N], each leaf cut out [dp, n] and its rank dimension put back in place of X/dp."""
    flat = jnp.concatenate([a.reshape(-1) for a in shards])
    every = jax.lax.all_gather(flat, axis, axis=0, tiled=False)          # [dp, N]
    out, start = [], 0
    for a, d in zip(shards, dims):
        part = every[:, start:start + a.size].reshape(every.shape[0], *a.shape)
        start += a.size
        part = jnp.moveaxis(part, 0, d)                                   # [..., dp, X/dp, ...]
        out.append(part.reshape(*a.shape[:d], -1, *a.shape[d + 1:]))
    return out


def _flat_scatter(grads: Sequence, dims: Sequence[int], axis: str) -> list:
    """`_flat_gather`'s transpose: the gradients (each [..., X, ...]) reduce-scattered over
    `axis` with one reduce-scatter of their concatenation [dp, N]; this rank's dp-th of
    each, summed over `axis`."""
    dp = jax.lax.axis_size(axis)
    rows, shapes = [], []
    for g, d in zip(grads, dims):
        split = g.reshape(*g.shape[:d], dp, g.shape[d] // dp, *g.shape[d + 1:])
        shapes.append(split.shape[:d] + split.shape[d + 1:])
        rows.append(jnp.moveaxis(split, d, 0).reshape(dp, -1))
    mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0, tiled=False)
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(mine[start:start + n].reshape(shape))
        start += n
    return out


def gather_for_use(params, dims, *, axis: str = DP, fuse: bool = False):
    """Each leaf planned dims >= 0 gathered over `axis` along that dimension (varying ->
    varying), under the named scope SCOPE; leaves not in `dims` (or planned -1) as they
    are. params: a dict of this device's shards [..., X/dp, ...]; dims: {name: dimension}.
    fuse: one all-gather per group of leaves of one dtype and type (FSDP's flat parameter,
    `_flat_gather`) instead of one per leaf: the same bytes in fewer collectives, each a
    rendezvous of every dp device."""
    with jax.named_scope(SCOPE):
        if not fuse:
            return {name: jax.lax.all_gather(a, axis, axis=dims[name], tiled=True) if dims.get(name, -1) >= 0
                    else a for name, a in params.items()}
        out = dict(params)
        for names in _groups(params, dims):
            out.update(zip(names, _flat_gather([params[n] for n in names], [dims[n] for n in names], axis)))
        return out


def _after(params, values):
    """params, made to depend on `values` without changing a value: x + 0.0, the 0.0 from
    a comparison of run-time values, the first floating entry of a leaf of each of
    `values` (the cotangent's, and a kept residual's for a cotangent XLA knows, as a
    loss's) above +inf: always false (nothing is above +inf, NaN neither), which XLA:CPU
    does not fold (tests/data/test_zero.py counts the compiled re-gather). The backward's
    re-gather reads the weights through it: without it XLA:CPU merges the re-gather with
    the forward's identical all-gather (even behind a jax.checkpoint's optimization
    barriers: one all-gather per weight compiled, two lowered) and keeps the whole weights
    alive from the forward to the backward (what ZeRO-3 exists to avoid)."""
    firsts = [next((a.reshape(-1)[0] for a in jax.tree.leaves(v) if isinstance(a, jax.core.Tracer)
                    and jnp.issubdtype(a.dtype, jnp.floating) and a.size), None) for v in values]
    firsts = [a for a in firsts if a is not None]
    if not firsts:
        return params
    zero = jnp.where(functools.reduce(jnp.logical_or, [a > jnp.inf for a in firsts]), 1, 0)
    return jax.tree.map(lambda a: a + zero.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def scatter_gradients(grads, dims, *, axis: str = DP, fuse: bool = False):
    """The all-gather's transpose: each leaf planned dims >= 0 reduce-scattered over `axis`
    along that dimension (summed over `axis`, this rank's dp-th kept), others as they are;
    fuse: one reduce-scatter per group of one dtype and type (`_flat_scatter`)."""
    with jax.named_scope(SCOPE):
        if not fuse:
            return {name: jax.lax.psum_scatter(g, axis, scatter_dimension=dims[name], tiled=True)
                    if dims.get(name, -1) >= 0 else g for name, g in grads.items()}
        out = dict(grads)
        for names in _groups(grads, dims):
            out.update(zip(names, _flat_scatter([grads[n] for n in names], [dims[n] for n in names], axis)))
        return out


def gathered(fn, dims, *, axis: str = DP, fuse: bool = False):
    """fn(params, *args) with params' leaves planned dims >= 0 (params: a dict; dims:
    {name: dimension}) gathered over `axis` first (`gather_for_use`), differentiated the
    FSDP way (a jax.custom_vjp): the forward keeps fn's vjp residuals but the gathered
    weights (it keeps the dp-th it was given instead); the backward gathers them again,
    runs fn's pullback and reduce-scatters the weights' gradient over `axis`
    (`scatter_gradients`). So per use: an all-gather forward, one backward (none where the
    pullback does not read the weights: an embedding lookup's), one reduce-scatter. A
    residual derived from a gathered weight (not the weight itself) is kept, as any
    residual. No leaf to gather: fn itself. fuse: the gathers and the reduce-scatter
    one per group of leaves of one dtype and type (`gather_for_use`)."""
    if not any(d >= 0 for d in dims.values()):
        return fn
    # the last trace of the forward's (the pullback's treedef, per leaf the weight it is or None);
    # every trace of one fn at one call's shapes has the same
    layout = {}

    def forward(params, *args):
        whole = gather_for_use(params, dims, axis=axis, fuse=fuse)
        out, pullback = jax.vjp(fn, whole, *args)
        leaves, treedef = jax.tree.flatten(pullback)
        weight_of = {id(whole[name]): name for name, dim in dims.items() if dim >= 0}
        names = tuple(weight_of.get(id(a)) for a in leaves)
        layout["last"] = (treedef, names)
        return out, (params, [a for a, name in zip(leaves, names) if name is None])

    def backward(residuals, cotangent):
        params, kept = residuals
        treedef, names = layout["last"]
        read = {name: dims[name] for name in names if name}        # the weights the pullback reads
        again = gather_for_use(_after(params, (cotangent, kept)), read, axis=axis, fuse=fuse) if read else {}
        kept = iter(kept)
        pullback = jax.tree.unflatten(treedef, [again[name] if name else next(kept) for name in names])
        d_whole, *d_args = pullback(cotangent)
        return (scatter_gradients(d_whole, dims, axis=axis, fuse=fuse), *d_args)

    @jax.custom_vjp
    def run(params, *args):
        return fn(gather_for_use(params, dims, axis=axis, fuse=fuse), *args)
    run.defvjp(forward, backward)
    run = functools.wraps(fn)(run)
    run.zero3_layout = layout          # for `regathered`
    return run


def regathered(fn) -> frozenset[str]:
    """The weights the backward of `gathered(...)` fn gathers again: those its pullback
    reads itself, as its last trace under a vjp found (the matmuls' matrices; not a norm's
    gain, kept broadcast, nor an embedding's, which a lookup's pullback does not read).
    Empty for a function not gathered or not yet differentiated."""
    last = getattr(fn, "zero3_layout", {}).get("last")
    return frozenset(name for name in last[1] if name) if last else frozenset()
