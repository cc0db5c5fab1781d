"""Megatron's f and g, and the sequence-parallel pair: collective ops with their gradients.

Each op is a `jax.custom_vjp` whose forward and backward collectives are written out, so
the code reads like the lecture's figures (section 3.2 and 4.4). Call them inside
`jax.shard_map` over the tensor-parallel axis (`axis`, usually mesh.TP).

    op                     forward                     backward                   Megatron name
    copy_to_tp     (f)     identity                    all-reduce (psum)          copy_to_tensor_model_parallel_region
    reduce_from_tp (g)     all-reduce (psum)           identity                   reduce_from_tensor_model_parallel_region
    gather_from_sp         all-gather along T          reduce-scatter along T     gather_from_sequence_parallel_region
    reduce_scatter_to_sp   reduce-scatter along T      all-gather along T         reduce_scatter_to_sequence_parallel_region

Types under shard_map's `check_vma` (varying manual axes): a value *invariant* over tp is
the same on every tp device (x before a column-parallel layer, a replicated norm gain); a
*varying* one differs per device (a weight shard, a partial sum). f turns invariant into
varying (`pcast(.., to="varying")`, a.k.a. pvary) and g varying into invariant (psum), so
the ops carry the same types as JAX's own collectives and their transposes:

    f == pvary              (JAX transposes pvary to psum)
    g == psum               (JAX transposes psum to pvary)
    gather_from_sp == all_gather(tiled)          (transposes to psum_scatter)
    reduce_scatter_to_sp == psum_scatter(tiled)  (transposes to all_gather)

tests/tensor/test_ops.py checks each equality, values and gradients. Writing them by hand
is the lesson (exercise 4: why the backward of f is an all-reduce); JAX would insert the
same collectives implicitly.

Paper: Shoeybi et al. 2019 (Megatron-LM, f and g); Korthikanti et al. 2022 (sequence
parallelism, the all-gather / reduce-scatter pair).
"""

from __future__ import annotations

import jax

from jaxpar.collectives import collective_op, is_varying, pvary


def _single(x, axis: str) -> bool:
    # Over one device, on a value not split over it, every op is the identity; skip it,
    # since XLA keeps a collective over a group of one. (A value typed varying over a
    # size-1 axis still goes through the op, which its type needs.)
    return jax.lax.axis_size(axis) == 1 and not is_varying(x, axis)


def _all_gather(x, axis, dim):
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def _reduce_scatter(x, axis, dim):
    return jax.lax.psum_scatter(pvary(x, axis), axis, scatter_dimension=dim, tiled=True)


#                 forward                                backward
_f = collective_op(lambda x, axis, _: pvary(x, axis),    lambda g, axis, _: jax.lax.psum(g, axis))
_g = collective_op(lambda x, axis, _: jax.lax.psum(x, axis), lambda g, axis, _: pvary(g, axis))
_ag = collective_op(_all_gather, _reduce_scatter)
_rs = collective_op(_reduce_scatter, _all_gather)


def copy_to_tp(x, axis: str):
    """Megatron's f. x[..]{invariant over tp} -> the same x, now varying over tp.

    Forward: nothing moves. Backward: all-reduce (psum over `axis`) of the gradient, since
    every tp device used x in its own column shard and dL/dx is the sum of their parts.
    Applied to a replicated norm gain under sequence parallelism, this is the all-reduce
    of the gain's gradient of lecture exercise 5c.
    """
    return x if _single(x, axis) else _f(x, axis, None)


def reduce_from_tp(x, axis: str):
    """Megatron's g. x[..]{U_tp} (a partial sum per tp device) -> psum_tp(x), invariant.

    Forward: all-reduce over `axis`. Backward: identity: every device's partial sum got
    the same gradient (marked varying again, as psum's transpose does).
    """
    return x if _single(x, axis) else _g(x, axis, None)


def gather_from_sp(x, axis: str, dim: int = 1):
    """Enter the tensor-parallel region from the sequence-parallel one.

    x[B, T_tp, D] -> x[B, T, D] (all-gather along `dim`, in tp-rank order).
    Backward: reduce-scatter along `dim`: each device's gradient of the full sequence is a
    partial sum (it used its own column shard), so sum them and keep this device's T/t rows.
    """
    return x if _single(x, axis) else _ag(x, axis, dim)


def reduce_scatter_to_sp(x, axis: str, dim: int = 1):
    """Leave the tensor-parallel region into the sequence-parallel one.

    x[B, T, D]{U_tp} (partial sums) -> x[B, T_tp, D]: reduce-scatter along `dim`.
    Backward: all-gather along `dim` (every partial sum fed every token's output).
    """
    return x if _single(x, axis) else _rs(x, axis, dim)
