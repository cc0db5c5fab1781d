"""Data parallelism's reduction: each gradient summed over exactly the batch axes its
PartitionSpec does not split (rank-coded, exact), the MLP's gradient equal to the whole
batch's, the compiled all-reduces equal to data.formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import comms
from jaxpar import mesh as mesh_lib
from jaxpar.collectives import varying
from jaxpar.data import formulas, verify
from jaxpar.data.reduce import reduce_gradients, weights
from jaxpar.errors import ConfigError
from jaxpar.testing import compiled_collectives

AXES = ("dp", "ep", "tp")
EVERY = P(AXES)          # a leading dimension of one row per device: each device's own value


def _mesh():
    return mesh_lib.make_mesh(dp=2, ep=2, tp=2)


def _rank_coded(pspecs, *, batch_axes=("dp", "ep"), extra=()):
    """Per device, g = 100 dp + 10 ep + tp + 1 in every leaf, reduced; returned as [8]:
    each device's value, in the mesh's device order (dp, ep, tp)."""
    def per_device():
        rank = sum(jax.lax.axis_index(a) * w for a, w in zip(AXES, (100, 10, 1))) + 1
        grads = jax.tree.map(lambda _: jnp.full((1, 3), rank, jnp.float32), pspecs, is_leaf=lambda x: isinstance(x, P))
        return reduce_gradients(grads, jax.tree.map(lambda s: P(None, *s), pspecs, is_leaf=lambda x: isinstance(x, P)),
                                batch_axes=batch_axes, extra=extra)
    out = jax.jit(jax.shard_map(per_device, mesh=_mesh(), in_specs=(),
                                out_specs=jax.tree.map(lambda _: EVERY, pspecs, is_leaf=lambda x: isinstance(x, P))))()
    return jax.tree.map(lambda a: np.asarray(a)[:, 0], out)


def _by_hand(summed):
    """[8] per device (dp, ep, tp order): the sum over the `summed` axes of 100 dp + 10 ep + tp + 1."""
    ranks = np.array([(d, e, t) for d in range(2) for e in range(2) for t in range(2)])
    out = []
    for r in ranks:
        group = [q for q in ranks if all(q[i] == r[i] for i, a in enumerate(AXES) if a not in summed)]
        out.append(sum(100 * d + 10 * e + t + 1 for d, e, t in group))
    return np.array(out, np.float32)


def test_each_gradient_is_summed_over_the_batch_axes_its_spec_does_not_split():
    pspecs = {"replicated": P(), "expert": P(None, "ep"), "tp_split": P(None, "tp")}
    got = _rank_coded(pspecs)
    np.testing.assert_array_equal(got["replicated"], _by_hand({"dp", "ep"}))
    np.testing.assert_array_equal(got["expert"], _by_hand({"dp"}))     # whole per ep rank
    np.testing.assert_array_equal(got["tp_split"], _by_hand({"dp", "ep"}))  # tp: no batch axis


def test_extra_axes_are_summed_too_and_no_axes_is_no_sum():
    got = _rank_coded({"w": P()}, batch_axes=("dp",), extra=("tp",))
    np.testing.assert_array_equal(got["w"], _by_hand({"dp", "tp"}))
    got = _rank_coded({"w": P()}, batch_axes=())
    np.testing.assert_array_equal(got["w"], _by_hand(set()))


def test_the_mlp_gradient_equals_the_whole_batch_and_its_all_reduce_the_formula():
    r = verify.check_reduction()
    assert r.passed, (r.errors, r.measured, r.expected)
    assert r.measured["step"] == r.expected["step"] == {"all-reduce": (1, sum(
        a.nbytes for a in jax.tree.leaves(verify.inputs(8)[0])))}     # all 4 gradients merged: one instruction


def test_the_reduction_bytes_per_group_equal_the_formula():
    """Weights replicated, split over ep and over tp, on dp2 x ep2 x tp2: the compiled
    all-reduces' bytes per group size equal formulas.reduction_bytes, counted by hand too."""
    m = _mesh()
    shapes = {"w": jnp.zeros((4, 8)), "expert": jnp.zeros((2, 8)), "cols": jnp.zeros((8, 6))}
    pspecs = {"w": P(), "expert": P("ep"), "cols": P(None, "tp")}

    def per_device(g):
        return reduce_gradients(varying(g, ("dp", "ep")), pspecs, batch_axes=("dp", "ep"))   # each device's share
    compiled = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=(pspecs,), out_specs=pspecs)).lower(
        shapes).compile()
    ops = comms.collective_ops_from_hlo(compiled.as_text())
    measured = {}
    for o in ops:
        measured[o.group_size] = measured.get(o.group_size, 0) + o.bytes
    expected = formulas.reduction_bytes(weights(shapes, pspecs, sizes=dict(m.shape)), sizes=dict(m.shape),
                                        batch_axes=("dp", "ep"))
    assert measured == expected == {4: 4 * 8 * 4 + 8 * 3 * 4, 2: 8 * 4}      # w and cols over dp x ep; expert over dp
    assert compiled_collectives(compiled)["all-reduce"][1] == sum(expected.values())


@pytest.mark.parametrize("pspecs, batch_axes, words", [
    ({"w": P()}, ("dp",), r"pspecs .* give one jax.sharding.PartitionSpec per leaf"),
    ({"w": P(), "b": "tp"}, ("dp",), r"'tp' is a str"),
    ({"w": P(), "b": P()}, "dp", r"batch_axes='dp': give a tuple of mesh axis names"),
])
def test_bad_layouts_are_refused(pspecs, batch_axes, words):
    grads = {"w": jnp.zeros(2), "b": jnp.zeros(2)}
    with pytest.raises(ConfigError, match=words):
        reduce_gradients(grads, pspecs, batch_axes=batch_axes)


def test_outside_shard_map_an_axis_to_sum_over_is_refused():
    grads = {"w": jnp.zeros(2)}
    with pytest.raises(ConfigError, match=r"reduce_gradients sums over mesh axis 'dp', which nothing binds.*shard_map"):
        reduce_gradients(grads, {"w": P()}, batch_axes=("dp",))
    assert reduce_gradients(grads, {"w": P("dp")}, batch_axes=("dp",)) is not None      # nothing to sum: no axis needed
