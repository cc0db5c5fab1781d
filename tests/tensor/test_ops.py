"""Megatron's f and g and the sequence-parallel pair equal JAX's own collectives and their
transposes (pvary/psum, all_gather/psum_scatter): values and gradients, exactly, on
rank-coded inputs; and each compiles to the collective its docstring names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import comms
from jaxpar import mesh as mesh_lib
from jaxpar.collectives import pvary
from jaxpar.tensor.ops import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from jaxpar.mesh import TP

B, T, D = 2, 8, 3

# op, JAX's equivalent, in_pspec, out_pspec, input shape given t, (forward, backward) collective
OPS = {
    "f": (lambda x: copy_to_tp(x, TP), lambda x: pvary(x, TP), P(), P(TP), lambda t: (B, T, D),
          (None, "all-reduce")),
    "g": (lambda x: reduce_from_tp(x, TP), lambda x: jax.lax.psum(x, TP), P(TP), P(), lambda t: (t * B, T, D),
          ("all-reduce", None)),
    "all-gather/reduce-scatter": (
        lambda x: gather_from_sp(x, TP, 1), lambda x: jax.lax.all_gather(x, TP, axis=1, tiled=True),
        P(None, TP), P(TP), lambda t: (B, T, D), ("all-gather", "reduce-scatter")),
    "reduce-scatter/all-gather": (
        lambda x: reduce_scatter_to_sp(x, TP, 1), lambda x: jax.lax.psum_scatter(x, TP, scatter_dimension=1, tiled=True),
        P(TP), P(None, TP), lambda t: (t * B, T, D), ("reduce-scatter", "all-gather")),
}


def _mesh(tp):
    return mesh_lib.make_mesh(tp=tp, devices=jax.devices()[:tp])


def _value_and_vjp(body, mesh, in_pspec, out_pspec, x, ct):
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_pspec, out_specs=out_pspec)
    y, vjp = jax.vjp(fn, x)
    return y, vjp(ct)[0], fn


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", list(OPS))
def test_op_equals_jax_transpose_exactly(name, tp):
    ours, theirs, in_pspec, out_pspec, shape, _ = OPS[name]
    m = _mesh(tp)
    x = jnp.arange(np.prod(shape(tp)), dtype=jnp.float32).reshape(shape(tp))   # rank-coded
    out_shape = jax.eval_shape(jax.shard_map(theirs, mesh=m, in_specs=in_pspec, out_specs=out_pspec), x).shape
    ct = jnp.arange(np.prod(out_shape), dtype=jnp.float32).reshape(out_shape) * 10 + 1
    y, dx, _ = _value_and_vjp(ours, m, in_pspec, out_pspec, x, ct)
    y_ref, dx_ref, _ = _value_and_vjp(theirs, m, in_pspec, out_pspec, x, ct)
    np.testing.assert_array_equal(y, y_ref)       # integer-valued floats: sums are exact
    np.testing.assert_array_equal(dx, dx_ref)


def test_op_values_by_hand():
    """What each op computes, on rank-coded blocks, written out without JAX's collectives."""
    t = 4
    m = _mesh(t)
    x = jnp.arange(B * T * D, dtype=jnp.float32).reshape(B, T, D)
    parts = jnp.arange(t * B * T * D, dtype=jnp.float32).reshape(t * B, T, D)
    total = parts.reshape(t, B, T, D).sum(0)

    def run(name, arg):
        ours, _, in_pspec, out_pspec, _, _ = OPS[name]
        return jax.shard_map(ours, mesh=m, in_specs=in_pspec, out_specs=out_pspec)(arg)

    np.testing.assert_array_equal(run("f", x), jnp.tile(x, (t, 1, 1)))          # each device: x
    np.testing.assert_array_equal(run("g", parts), total)                         # sum of partials
    np.testing.assert_array_equal(run("all-gather/reduce-scatter", x), jnp.tile(x, (t, 1, 1)))
    np.testing.assert_array_equal(run("reduce-scatter/all-gather", parts), total)
    # backward of f: the all-reduce of the per-device cotangents
    _, dx, _ = _value_and_vjp(OPS["f"][0], m, P(), P(TP), x, parts)
    np.testing.assert_array_equal(dx, total)


@pytest.mark.parametrize("name", list(OPS))
def test_op_compiles_to_its_collectives(name):
    ours, _, in_pspec, out_pspec, shape, (fwd_kind, bwd_kind) = OPS[name]
    t = 4
    m = _mesh(t)
    x = jnp.ones(shape(t), jnp.float32)
    fn = jax.shard_map(ours, mesh=m, in_specs=in_pspec, out_specs=out_pspec)
    ct = jnp.ones(jax.eval_shape(fn, x).shape, jnp.float32)
    fwd = comms.nonzero(comms.collective_stats(jax.jit(fn), x))
    bwd = comms.nonzero(comms.collective_stats(jax.jit(lambda x, ct: jax.vjp(fn, x)[1](ct)), x, ct))
    nbytes = 4 * B * T * D   # comms convention: AR of the array, AG gathered size, RS pre-scatter size
    assert fwd == ({fwd_kind: (1, nbytes)} if fwd_kind else {})
    assert bwd == ({bwd_kind: (1, nbytes)} if bwd_kind else {})


def test_ops_are_identity_on_one_device():
    """tp = 1 with nothing split over tp (how tp_block runs it): no collective at all."""
    m = _mesh(1)
    x = jnp.arange(B * T * D, dtype=jnp.float32).reshape(B, T, D)
    for name, (ours, *_) in OPS.items():
        fn = jax.jit(jax.shard_map(ours, mesh=m, in_specs=P(), out_specs=P()))
        np.testing.assert_array_equal(fn(x), x)
        assert comms.nonzero(comms.collective_stats(fn, x)) == {}, name
