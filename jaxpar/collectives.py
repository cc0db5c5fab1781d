"""Typed helpers shared by the techniques: shard_map's varying types, collective ops
defined by their two halves, ring neighbours.

Under shard_map's `check_vma` (varying manual axes) a value is *invariant* over an axis
(the same on every device of it) or *varying* (it differs per device). A scan carry and
the branches of a switch must agree on the type, and autodiff transposes `pvary` to
`psum`, so the techniques type their values explicitly with these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import jax
import jax.numpy as jnp


def varying_axes(x) -> tuple[str, ...]:
    """The mesh axes x is typed varying over, sorted: inside shard_map, those of its type's
    manual axes it may differ over; outside shard_map, and for a value whose type has no
    manual axes, none. x: an array, tracer or ShapeDtypeStruct."""
    try:
        axes = jax.typeof(x).manual_axis_type.varying
    except AttributeError:
        return ()
    return tuple(sorted(axes))


def is_varying(x, axis: str) -> bool:
    """Whether x is typed varying over `axis` (inside shard_map)."""
    return axis in varying_axes(x)


def pvary(x, axis: str):
    """Mark x as varying over `axis` (no data moves). A no-op if it already varies."""
    return x if is_varying(x, axis) else jax.lax.pcast(x, axis, to="varying")


def varying(tree, axes: Iterable[str]):
    """Every leaf of `tree` typed varying over every axis in `axes`."""
    axes = tuple(axes)

    def one(a):
        for axis in axes:
            a = pvary(a, axis)
        return a
    return jax.tree.map(one, tree)


def collective_op(forward: Callable, backward: Callable) -> Callable:
    """A custom_vjp op (x, axis, dim) -> forward(x, axis, dim) whose gradient is
    g -> backward(g, axis, dim): a pair of collectives is all there is to Megatron's f and
    g and the sequence-parallel pair, so each is defined by its two halves."""
    @partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, axis, dim):
        return forward(x, axis, dim)

    op.defvjp(lambda x, axis, dim: (forward(x, axis, dim), None),
              lambda axis, dim, _, g: (backward(g, axis, dim),))
    return op


def ring_pairs(n: int, shift: int = 1) -> list[tuple[int, int]]:
    """The (source, destination) pairs of a ppermute sending `shift` places round a ring of n."""
    return [(i, (i + shift) % n) for i in range(n)]


def ring_shift(x, axis: str, n: int, *, hop: str = "ppermute"):
    """x sent one place round the ring of the n devices of `axis` (rank i gets rank i-1's).

    hop="ppermute": one collective-permute. hop="all_to_all": the same move as an
    all-to-all of an [n, ...] buffer holding x in the neighbour's slot and zeros
    elsewhere ((n-1) times the bytes; equal at n = 2). The second is for code that runs
    inside a pipeline stage, where one pp rank at a time takes the branch: XLA:CPU meets
    a collective-permute with every device of the program (a permute the other pp ranks
    skip never completes), an all-to-all with its replica group only.
    """
    if hop == "ppermute":
        return jax.lax.ppermute(x, axis, ring_pairs(n))
    me = jax.lax.axis_index(axis)
    buf = jax.lax.dynamic_update_index_in_dim(jnp.zeros((n, *x.shape), x.dtype), x, (me + 1) % n, 0)
    got = jax.lax.all_to_all(buf, axis, 0, 0, tiled=True)         # slot j: what rank j sent here
    return jax.lax.dynamic_index_in_dim(got, (me + n - 1) % n, 0, keepdims=False)
