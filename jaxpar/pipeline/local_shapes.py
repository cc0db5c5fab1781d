"""What each device sees of a pipeline request: the batch and the parameters' pspecs checked
against the mesh, and the per-device shapes they give (`request.make` calls these once).

    batch_shapes(...) the batch's pspecs, the axes it is split over, one microbatch's local shapes
    pspecs(...)       one PartitionSpec per parameter leaf and the local ShapeDtypeStructs
    local_shape(...)  an array's per-device shape under a pspec (refusing sizes the axes do not divide)
    drop_unit(...)    a pspec without the axes of one device

Each refuses, with a ConfigError naming the value and a fix, what the mesh cannot hold.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.mesh import DP, PP, axis_size, pspec_axes


@dataclasses.dataclass(frozen=True)
class Batch:
    """What the batch's checks found."""
    in_pspec: P
    target_pspec: P
    axes: tuple[str, ...]     # the axes of more than one device the batch is split over
    input_grads: bool
    local: dict               # ShapeDtypeStructs of one microbatch's inputs and targets on a device


def batch_shapes(batch, batch_pspec, mesh, microbatches: int, first_fn, input_grads) -> Batch:
    """The batch's pspecs and per-device microbatch shapes; refused unless its rows split
    over the batch axes x microbatches (and input_grads is possible)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ConfigError(f"batch is a {type(batch).__name__}"
                          + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                          + ": give the pair (inputs [B, ...], targets [B, ...])")
    inputs, targets = batch
    kinds = "fiu" if first_fn is not None else "f"
    in_shape = errors.array("inputs", inputs, kinds=kinds, shape_doc="inputs[B, ...], the first stage's activations")
    t_shape = errors.array("targets", targets, shape_doc="targets[B, ...]")
    if not in_shape or not t_shape:
        raise ConfigError(f"inputs {in_shape} and targets {t_shape}: both need a leading batch axis [B, ...]")
    if batch_pspec is None:
        batch_pspec = P(DP) if DP in mesh.shape else P()
    in_pspec, target_pspec = batch_pspec if isinstance(batch_pspec, tuple) and not isinstance(batch_pspec, P) \
        else (batch_pspec, batch_pspec)
    local_in = local_shape(in_shape, in_pspec, mesh, "batch_pspec for the inputs")
    local_t = local_shape(t_shape, target_pspec, mesh, "batch_pspec for the targets")
    in_pspec, target_pspec = drop_unit(in_pspec, mesh), drop_unit(target_pspec, mesh)
    rows = in_shape[0]
    if t_shape[0] != rows:
        raise ConfigError(f"inputs have {rows} rows but targets {t_shape[0]}: give one target per row")
    row_axes = [a for a in (in_pspec[0] if len(in_pspec) and isinstance(in_pspec[0], tuple)
                            else (in_pspec[0],) if len(in_pspec) and in_pspec[0] else ())]
    split = math.prod(axis_size(mesh, a) for a in row_axes)
    if rows % (split * microbatches):
        over = " x ".join(f"{a}={axis_size(mesh, a)}" for a in row_axes) or f"{DP}=1"
        raise ConfigError(f"batch of {rows} rows does not split into {over} x microbatches={microbatches}: "
                          f"use a batch divisible by {split * microbatches}, or another microbatch count")
    axes = tuple(a for a in mesh.axis_names if a != PP and axis_size(mesh, a) > 1
                 and a in pspec_axes(in_pspec) | pspec_axes(target_pspec))
    one = lambda shape, a: jax.ShapeDtypeStruct((shape[0] // microbatches, *shape[1:]), jnp.result_type(a))
    return Batch(in_pspec=in_pspec, target_pspec=target_pspec, axes=axes,
                 input_grads=input_grads_of(input_grads, inputs),
                 local=dict(inputs=one(local_in, inputs), targets=one(local_t, targets)))


def input_grads_of(input_grads, inputs) -> bool:
    """Whether the step returns d loss / d inputs: `input_grads` as given, or (None) when
    the inputs are floating; refused for integer inputs (token ids)."""
    floating = jnp.issubdtype(jnp.result_type(inputs), jnp.floating)
    if input_grads is None:
        return bool(floating)
    errors.flag("input_grads", input_grads)
    if input_grads and not floating:
        raise ConfigError(f"input_grads=True but the inputs are {jnp.result_type(inputs)}: there is no gradient "
                          "with respect to integers (token ids); leave input_grads unset or False")
    return input_grads


def local_shape(shape, pspec: P, mesh, what: str, skip: int = 0) -> tuple[int, ...]:
    """The per-device shape of an array of `shape` laid out as `pspec` on its dims after the
    first `skip` (refusing axes the mesh lacks, pp, and sizes the axes do not divide)."""
    if not isinstance(pspec, P):
        raise ConfigError(f"{what}: the pspec {pspec!r} is a {type(pspec).__name__}, not a "
                          "jax.sharding.PartitionSpec: e.g. P(None, 'tp')")
    dims = shape[skip:]
    if len(pspec) > len(dims):
        raise ConfigError(f"{what}: the pspec {pspec} names {len(pspec)} dimensions, the array has {len(dims)} "
                          f"{'after its layer axis ' if skip else ''}({tuple(shape)})")
    out = list(shape)
    for j, entry in enumerate(pspec):
        axes = entry if isinstance(entry, tuple) else () if entry is None else (entry,)
        n = 1
        for a in axes:
            if a == PP or a not in mesh.shape:
                raise ConfigError(f"{what}: the pspec {pspec} names axis {a!r}; the mesh has {dict(mesh.shape)} "
                                  f"and {PP} is the pipeline's own: name the other axes only")
            n *= mesh.shape[a]
        if dims[j] % n:
            raise ConfigError(f"{what}: dimension {skip + j} of {tuple(shape)} is {dims[j]}, not divisible by "
                              f"{' x '.join(axes)} = {n} in the pspec {pspec}: use a size divisible by {n}")
        out[skip + j] = dims[j] // n
    return tuple(out)


def drop_unit(pspec: P, mesh) -> P:
    """pspec without the axes of one device (a value split over one device is whole, and
    shard_map would type it varying over an axis nothing sums over)."""
    def entry(e):
        axes = tuple(a for a in (e if isinstance(e, tuple) else () if e is None else (e,))
                     if mesh.shape.get(a, 2) > 1)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return P(*(entry(e) for e in pspec))


def pspecs(tree, given, mesh, what: str, skip: int = 0):
    """(the pspec tree, one P per leaf of tree as `given`, default P(); the local ShapeDtypeStructs)."""
    if given is None:
        given = jax.tree.map(lambda _: P(), tree)
    is_p = lambda x: isinstance(x, P)
    if jax.tree.structure(given, is_leaf=is_p) != jax.tree.structure(tree):
        raise ConfigError(f"{what} has the structure {jax.tree.structure(given, is_leaf=is_p)}, the parameters "
                          f"{jax.tree.structure(tree)}: give one PartitionSpec per array")
    for pspec in jax.tree.leaves(given, is_leaf=is_p):
        if not is_p(pspec):
            raise ConfigError(f"{what}: the pspec {pspec!r} is a {type(pspec).__name__}, not a "
                              "jax.sharding.PartitionSpec: e.g. P(None, 'tp')")
    dropped = jax.tree.map(lambda s: drop_unit(s, mesh), given, is_leaf=is_p)
    local = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(local_shape(jnp.shape(a), s, mesh, what, skip),
                                                            jnp.result_type(a)), tree, dropped, is_leaf=None)
    return dropped, local


def edge_pspecs(tree, given, mesh, what: str):
    """`pspecs` of the first or last stage's params, or (None, None) without them."""
    return pspecs(tree, given, mesh, what) if tree is not None else (None, None)
