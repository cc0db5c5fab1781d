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

What F stores never holds a parameter (`split_vjp` states the invariant); its shapes, and
the template that rebuilds the pullback in B, are learned by tracing F once (`learn`), and
returned as a `Residuals` value: the passes hold no state. Chunk c's layer l is read from
the [chunks, Lc, ...] parameters by one dynamic slice, and its gradient added into the
[chunks, Lc, ...] accumulator by one dynamic update: weight gradients go in place, only in the
passes that make them. With `recompute="full"` F keeps only x and B (and W) run the forward
again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.collectives import varying, varying_axes
from jaxpar.mesh import PP
from jaxpar.pipeline.plan import LAYER_SCOPE


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
        axes.extend(varying_axes(a) for a in out)
        return out
    return jax.eval_shape(traced), axes


# ---- a vjp split into what F stores and what B re-reads -----------------------------------

class VjpTemplate(NamedTuple):
    """Where each leaf of a vjp function comes from; static, the same in every trace of
    the function: ("param", j) the j-th leaf of the parameters, ("stored", None) a leaf F
    stores, ("constant", value) a value the function closes over."""
    treedef: Any
    sources: tuple


def _parameter_positions(params) -> dict[int, int]:
    """{id of a parameter leaf: its position}: a residual that IS a parameter is that leaf."""
    return {id(a): j for j, a in enumerate(jax.tree.leaves(params))}


def split_vjp(fn: Callable, params, x) -> tuple[jax.Array, list, VjpTemplate]:
    """(y = fn(params, x), the pullback's leaves to store, the template that rebuilds it).

    Invariant, the basis of the runtime's memory claim (a residual slot holds activations,
    and its size follows the schedule, not the weights): the stored leaves exclude every
    leaf of `params`. A vjp function is a pytree whose leaves are its residuals; a residual
    that is a parameter (the same traced array, as `jax.vjp` keeps x of x @ w for dw and w
    for dx) is recorded by its position, and `join_vjp` re-reads it from the weights in B.
    Leaves that are not traced (constants the function closes over) stay in the template.
    Call it under a trace (the program's shard_map): outside one, every residual is a
    constant. tests/pipeline/test_passes.py holds the invariant for the lecture's MLP layer,
    a reference transformer block, a whole stage and an NNX block."""
    y, pullback = jax.vjp(fn, params, x)
    leaves, treedef = jax.tree.flatten(pullback)
    position = _parameter_positions(params)
    sources = tuple(("param", position[id(a)]) if id(a) in position
                    else ("stored", None) if isinstance(a, jax.core.Tracer) else ("constant", a) for a in leaves)
    return y, [a for a, (kind, _) in zip(leaves, sources) if kind == "stored"], VjpTemplate(treedef, sources)


def join_vjp(template: VjpTemplate, params, stored) -> Callable:
    """The pullback `split_vjp` split: the parameters re-read from `params`, the stored
    leaves back in place."""
    leaves, stored = jax.tree.leaves(params), iter(stored)
    return jax.tree.unflatten(template.treedef, [leaves[j] if kind == "param" else next(stored) if kind == "stored"
                                                 else j for kind, j in template.sources])


class Residuals(NamedTuple):
    """What one stage's F stores for B, learned by tracing F once (`Stack.learn`,
    `Whole.learn`): the program sizes its slots by it and B rebuilds the pullback with it."""
    stored: list                  # ShapeDtypeStructs of F's stored leaves (Stack: [Lc, ...] each)
    axes: list                    # the manual axes each stored leaf varies over
    kept: jax.ShapeDtypeStruct    # what a split B keeps for W: [Lc, mb, ...] (Stack) or [mb, ...]
    template: VjpTemplate | None      # None with recompute: B traces the forward again


def _learn(stored_fn: Callable, kept: jax.ShapeDtypeStruct) -> Residuals:
    """Residuals from one trace of stored_fn() -> (stored leaves, template or None)."""
    templates = []

    def stored():
        leaves, template = stored_fn()
        templates.append(template)
        return leaves
    shapes, axes = shapes_and_axes(stored)
    return Residuals(stored=shapes, axes=axes, kept=kept, template=templates[0])


# ---- the two kinds of stage -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Stack:
    """A `layers` stage of `depth` layers, scanned. Uneven stages: `counts` [p][chunks] the
    layers chunk c of device d really holds (`stage.padded_layers`), depth the largest;
    a layer at or past its chunk's count is padding, skipped by a `lax.cond`: the identity
    in F, its output gradient passed through in B, no weight gradient (None: every chunk
    holds depth layers, and the program has no conditional at all)."""

    layer_fn: Callable
    depth: int
    recompute: str          # "none" or "full": request.RECOMPUTE
    counts: tuple[tuple[int, ...], ...] | None = None

    def learn(self, params, x) -> Residuals:
        """What F stores (traced on chunk 0: every chunk's are alike) and what a split B
        keeps: each layer's output gradient, [depth, mb, ...]."""
        def stored():
            if self.recompute == "full":
                return self.forward(params, 0, x)[1], None
            return self._residuals(params, 0, x)[1:]
        return _learn(stored, jax.ShapeDtypeStruct((self.depth, *x.shape), x.dtype))

    def _held(self, c, l):
        """Whether layer l of chunk c is a real layer on this device (uneven stages only)."""
        counts = jnp.asarray(self.counts, jnp.int32)                    # [p, chunks]
        return l < jax.lax.dynamic_index_in_dim(counts[jax.lax.axis_index(PP)], c, 0, keepdims=False)

    def _residuals(self, params, c, x) -> tuple[jax.Array, list, VjpTemplate]:
        """(y, each layer's stored leaves stacked on a layer axis, the layers' vjp template)."""
        templates = []

        def run(layer_params, h):
            y, stored, template = split_vjp(self.layer_fn, layer_params, h)
            templates.append(template)
            return y, stored

        def body(h, l):
            if self.counts is None:
                return run(read(params, (c, l)), h)
            return _unless_padding(self._held(c, l), run, lambda layer_params, h, out: (h, out[1]),
                                   read(params, (c, l)), h)
        y, stored = jax.lax.scan(body, x, jnp.arange(self.depth))
        return y, stored, templates[0]

    def forward(self, params, c, x) -> tuple[jax.Array, list]:
        """(y, what F stores): chunk c's layers on x [mb, ...]."""
        if self.recompute == "full":
            def body(h, l):
                if self.counts is None:
                    return self.layer_fn(read(params, (c, l)), h), None
                return _unless_padding(self._held(c, l), self.layer_fn, lambda layer_params, h, out: h,
                                       read(params, (c, l)), h), None
            return jax.lax.scan(body, x, jnp.arange(self.depth))[0], [x]
        return self._residuals(params, c, x)[:2]

    def _stored(self, params, c, stored, template) -> tuple[list, VjpTemplate]:
        if self.recompute == "full":
            return self._residuals(params, c, stored[0])[1:]
        return stored, template

    def backward(self, params, c, stored, g, acc, *, weights: bool, template: VjpTemplate | None):
        """(dL/dx, acc with this chunk's weight gradients added if `weights`, the per-layer
        output gradients W needs [depth, mb, ...])."""
        res, template = self._stored(params, c, stored, template)

        def pullback(layer_params, res_l, g):
            d_w, dx = join_vjp(template, layer_params, res_l)(g)
            return (dx, d_w) if weights else dx

        def skipped(layer_params, res_l, g, out):      # padding: g passes through, no weight gradient
            return (g, out[1]) if weights else g

        def body(carry, inp):
            g, acc = carry
            l, res_l = inp
            if self.counts is None:
                out = pullback(read(params, (c, l)), res_l, g)
            else:
                out = _unless_padding(self._held(c, l), pullback, skipped, read(params, (c, l)), res_l, g)
            dx, d_w = out if weights else (out, None)
            return (dx, add(acc, (c, l), d_w) if weights else acc), g
        (dx, acc), kept = jax.lax.scan(body, (g, acc), (jnp.arange(self.depth), res), reverse=True)
        return dx, acc, kept

    def weight(self, params, c, stored, kept, acc, *, template: VjpTemplate | None):
        """acc with chunk c's weight gradients added, from the output gradients B kept."""
        res, template = self._stored(params, c, stored, template)

        def weights_of(layer_params, res_l, g):
            return join_vjp(template, layer_params, res_l)(g)[0]

        def body(acc, inp):
            l, res_l, g = inp
            if self.counts is None:
                d_w = weights_of(read(params, (c, l)), res_l, g)
            else:
                d_w = _unless_padding(self._held(c, l), weights_of, lambda *args: args[-1],
                                      read(params, (c, l)), res_l, g)
            return add(acc, (c, l), d_w), None
        return jax.lax.scan(body, acc, (jnp.arange(self.depth), res, kept))[0]


def _unless_padding(held, fn: Callable, padding: Callable, *operands):
    """fn(*operands) where `held` (a real layer), else padding(*operands, zeros): `zeros`
    shaped and typed (dtype, varying axes) as fn's outputs, for the outputs padding does
    not pass through. One `lax.cond`: a padded layer costs no compute."""
    treedefs = []

    def flat():
        out = fn(*operands)
        treedefs.append(jax.tree.structure(out))
        return jax.tree.leaves(out)
    shapes, axes = shapes_and_axes(flat)

    def skip(*ops):
        zeros = jax.tree.unflatten(treedefs[0], [jnp.zeros(a.shape, a.dtype) for a in shapes])
        leaves = jax.tree.leaves(padding(*ops, zeros))
        return jax.tree.unflatten(treedefs[0], [varying(a, ax) for a, ax in zip(leaves, axes)])
    with jax.named_scope(LAYER_SCOPE):     # a reader of the compiled program counts its collectives per real layer
        return jax.lax.cond(held, fn, skip, *operands)


@dataclasses.dataclass(frozen=True)
class Whole:
    """Any stage function, as one vjp over the stage."""

    stage_fn: Callable
    recompute: str          # "none" or "full": request.RECOMPUTE

    def learn(self, params, x) -> Residuals:
        """What F stores (traced on chunk 0) and what a split B keeps: the output gradient."""
        def stored():
            if self.recompute == "full":
                return self.forward(params, 0, x)[1], None
            return split_vjp(self.stage_fn, read(params, (0,)), x)[1:]
        return _learn(stored, jax.ShapeDtypeStruct(x.shape, x.dtype))

    def forward(self, params, c, x) -> tuple[jax.Array, list]:
        chunk = read(params, (c,))
        if self.recompute == "full":
            return self.stage_fn(chunk, x), [x]
        return split_vjp(self.stage_fn, chunk, x)[:2]

    def _pullback(self, params, c, stored, template) -> Callable:
        chunk = read(params, (c,))
        if self.recompute == "full":
            return jax.vjp(self.stage_fn, chunk, stored[0])[1]
        return join_vjp(template, chunk, stored)

    def backward(self, params, c, stored, g, acc, *, weights: bool, template: VjpTemplate | None):
        d_chunk, dx = self._pullback(params, c, stored, template)(g)
        return dx, add(acc, (c,), d_chunk) if weights else acc, g

    def weight(self, params, c, stored, kept, acc, *, template: VjpTemplate | None):
        return add(acc, (c,), self._pullback(params, c, stored, template)(kept)[0])
