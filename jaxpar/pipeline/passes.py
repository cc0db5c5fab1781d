"""The three passes of one stage inside the pipeline program (lecture 2.4, 2.5):

    F  forward: y = stage(x), and what B will need (the vjp's residuals, or only x);
    B  backward: dL/dx from dL/dy, and, unless the schedule splits the backward, the
       weight gradient, added in place into the accumulator;
    W  weight gradient alone (zero-bubble schedules), from what B left for it.

Two kinds of stage:
  `Stack`  a `stage.layers` stage: its layers run under `lax.scan`, so the program does not
           grow with the layers per stage. F keeps each layer's vjp residuals, stacked on a
           leading layer axis, minus the layer's weights (B reads them from the parameters).
           A split B keeps each layer's output gradient, so W is the weight matmuls alone.
  `Whole`  any other stage function: one vjp over the whole stage; F keeps its residuals
           minus the parameters it was taken with respect to.

Chunk c's layer l is read from the [v, Lc, ...] parameters by one dynamic slice, and its
gradient added into the [v, Lc, ...] accumulator by one dynamic update: weight gradients
go in place, only in the passes that make them. With `recompute=True` F keeps only x and
B (and W) run the forward again.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _start(index: tuple, ndim: int) -> tuple:
    return tuple(jnp.asarray(i, jnp.int32) for i in (*index, *(0,) * (ndim - len(index))))


def read(tree, index: tuple):
    """The entry at `index` (leading dims) of every leaf: one dynamic slice each."""
    def one(a):
        start = _start(index, a.ndim)
        return jax.lax.dynamic_slice(a, start, (*(1,) * len(index), *a.shape[len(index):])).reshape(
            a.shape[len(index):])
    return jax.tree.map(one, tree)


def add(acc, index: tuple, delta):
    """acc[index] += delta for every leaf, in place (a dynamic update of that entry only)."""
    def one(a, d):
        start = _start(index, a.ndim)
        sizes = (*(1,) * len(index), *a.shape[len(index):])
        old = jax.lax.dynamic_slice(a, start, sizes)
        return jax.lax.dynamic_update_slice(a, old + d.reshape(sizes).astype(a.dtype), start)
    return jax.tree.map(one, acc, delta)


def shapes_and_axes(fn: Callable) -> tuple[list, list[tuple[str, ...]]]:
    """(ShapeDtypeStructs of the list fn() returns, the axes each leaf varies over)."""
    axes = []

    def traced():
        out = fn()
        axes.extend(tuple(jax.typeof(a).manual_axis_type.varying) for a in out)
        return out
    return jax.eval_shape(traced), axes


class _Vjp:
    """A function's vjp split into the leaves to store and the rest: the parameters it was
    taken at (not stored: B has them) and constants. A forward must be traced before a
    rebuild, inside shard_map as the branches are: `learn` does it (with recompute, B
    traces its own forward first)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.treedef = self.layout = None

    def forward(self, params, x):
        y, vjp_fn = jax.vjp(self.fn, params, x)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        ids = {id(a): j for j, a in enumerate(jax.tree.leaves(params))}
        layout = [("p", ids[id(a)]) if id(a) in ids else ("s", None) if isinstance(a, jax.core.Tracer)
                  else ("c", a) for a in leaves]
        self.treedef, self.layout = treedef, layout   # the same in every trace of fn
        return y, [a for a, (kind, _) in zip(leaves, layout) if kind == "s"]

    def rebuild(self, params, stored) -> Callable:
        leaves, stored = jax.tree.leaves(params), iter(stored)
        return jax.tree.unflatten(self.treedef, [leaves[j] if kind == "p" else next(stored) if kind == "s" else j
                                                 for kind, j in self.layout])


class Stack:
    """A `layers` stage of `depth` layers, scanned."""

    def __init__(self, layer_fn: Callable, depth: int, recompute: bool):
        self.vjp, self.depth, self.recompute = _Vjp(layer_fn), depth, recompute

    def learn(self, params, x):
        """Shapes of the stored residuals and of what a split B keeps for W."""
        self.stored, self.stored_axes = shapes_and_axes(lambda: self.forward(params, 0, x)[1])
        self.kept = jax.ShapeDtypeStruct((self.depth, *x.shape), x.dtype)

    def _residuals(self, params, c, x):
        def body(h, l):
            return self.vjp.forward(read(params, (c, l)), h)
        return jax.lax.scan(body, x, jnp.arange(self.depth))

    def forward(self, params, c, x):
        if self.recompute:
            def body(h, l):
                return self.vjp.fn(read(params, (c, l)), h), None
            return jax.lax.scan(body, x, jnp.arange(self.depth))[0], [x]
        return self._residuals(params, c, x)

    def _stored(self, params, c, stored):
        return self._residuals(params, c, stored[0])[1] if self.recompute else stored

    def backward(self, params, c, stored, g, acc, *, weights: bool):
        """(dL/dx, acc with this chunk's weight gradients added if `weights`, the per-layer
        output gradients W needs)."""
        res = self._stored(params, c, stored)

        def body(carry, inp):
            g, acc = carry
            l, res_l = inp
            d_w, dx = self.vjp.rebuild(read(params, (c, l)), res_l)(g)
            return (dx, add(acc, (c, l), d_w) if weights else acc), g
        (dx, acc), kept = jax.lax.scan(body, (g, acc), (jnp.arange(self.depth), res), reverse=True)
        return dx, acc, kept

    def weight(self, params, c, stored, kept, acc):
        res = self._stored(params, c, stored)

        def body(acc, inp):
            l, res_l, g = inp
            return add(acc, (c, l), self.vjp.rebuild(read(params, (c, l)), res_l)(g)[0]), None
        return jax.lax.scan(body, acc, (jnp.arange(self.depth), res, kept))[0]


class Whole:
    """Any stage function, as one vjp over the stage."""

    def __init__(self, stage_fn: Callable, recompute: bool):
        self.vjp, self.recompute = _Vjp(stage_fn), recompute

    def learn(self, params, x):
        self.stored, self.stored_axes = shapes_and_axes(lambda: self.forward(params, 0, x)[1])
        self.kept = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def forward(self, params, c, x):
        chunk = read(params, (c,))
        if self.recompute:
            return self.vjp.fn(chunk, x), [x]
        return self.vjp.forward(chunk, x)

    def _pullback(self, params, c, stored):
        chunk = read(params, (c,))
        if self.recompute:
            return jax.vjp(self.vjp.fn, chunk, stored[0])[1]
        return self.vjp.rebuild(chunk, stored)

    def backward(self, params, c, stored, g, acc, *, weights: bool):
        d_chunk, dx = self._pullback(params, c, stored)(g)
        return dx, add(acc, (c,), d_chunk) if weights else acc, g

    def weight(self, params, c, stored, kept, acc):
        return add(acc, (c,), self._pullback(params, c, stored)(kept)[0])
