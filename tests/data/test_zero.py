"""ZeRO-1's pieces: the plan by hand, the optimizer state's layout, the reduce-scatter, the
slice and the all-gather exact on rank-coded inputs, two AdamW steps equal to the unsharded
ones with a dp-th of the state per device, the collectives equal to data.formulas."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar import testing
from jaxpar.collectives import varying
from jaxpar.data import verify, zero
from jaxpar.errors import ConfigError


@pytest.mark.parametrize("local, dp, skip, dim", [
    ((8, 12), 4, 0, 1),          # the largest dimension dp divides
    ((12, 12), 4, 0, 0),         # the first of equals
    ((12, 6), 4, 0, 0),          # 6: not divisible by 4
    ((3, 5), 2, 0, -1),          # none: the state stays whole
    ((16, 8), 8, 1, 1),          # the first `skip` dimensions never split
    ((1, 2, 6), 2, 1, 2),
])
def test_zero_dim_by_hand(local, dp, skip, dim):
    assert zero.zero_dim(local, dp, skip=skip) == dim


@pytest.mark.parametrize("local, dp, skip, dim", [
    ((8, 16), 4, 0, 0),          # the first dp divides, not the largest
    ((6, 12, 16), 4, 0, 1),      # 6: not divisible by 4
    ((16, 8), 8, 1, 1),          # the first `skip` dimensions never split
    ((3, 5), 2, 0, -1),
])
def test_zero_dim_first_by_hand(local, dp, skip, dim):
    assert zero.zero_dim(local, dp, skip=skip, first=True) == dim


def test_the_plan_reads_the_local_shard_and_is_whole_on_one_dp_device():
    shapes = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32), "v": jax.ShapeDtypeStruct((4, 6), jnp.float32)}
    pspecs = {"w": P("tp", None), "v": P()}
    assert zero.plan(shapes, pspecs, sizes={"dp": 2, "tp": 4}) == {"w": 1, "v": 1}      # w's shard: [4, 8]
    assert zero.plan(shapes, pspecs, sizes={"dp": 4, "tp": 2}) == {"w": 0, "v": 0}      # [8, 8]: the first
    assert zero.plan(shapes, pspecs, sizes={"dp": 1, "tp": 2}) == {"w": -1, "v": -1}
    assert zero.local_shape((16, 8, 3), P(("tp", "dp")), {"dp": 2, "tp": 4}) == (2, 8, 3)


def test_the_state_is_laid_out_with_dp_added_to_the_planned_dimension():
    assert zero.state_pspec(P(), 0, 2) == P("dp", None)
    assert zero.state_pspec(P("tp", None), 0, 2) == P(("tp", "dp"), None)
    assert zero.state_pspec(P(("ep", "tp")), 0, 3) == P(("ep", "tp", "dp"), None, None)
    assert zero.state_pspec(P(None, "tp"), 1, 2) == P(None, ("tp", "dp"))
    assert zero.state_pspec(P("tp"), -1, 2) == P("tp")


def test_reduce_scatter_slice_and_gather_are_exact_on_rank_coded_inputs():
    """dp4 x tp2: g = (dp rank + 1) * w on each device, w = arange; rank r gets the
    planned dim's r-th quarter of 10 w (summed over dp only), its quarter of w, and the
    all-gather rebuilds w on every device."""
    m = mesh_lib.make_mesh(dp=4, tp=2)
    w = {"a": jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6), "b": jnp.arange(3, dtype=jnp.float32)}
    pspecs = {"a": P(), "b": P()}
    dims = zero.plan(w, pspecs, sizes=dict(m.shape))
    assert dims == {"a": 0, "b": -1}

    def per_device(w):
        g = jax.tree.map(lambda a: a * (jax.lax.axis_index("dp") + 1), varying(w, ("dp",)))
        g = zero.reduce_scatter_gradients(g, pspecs, dims, batch_axes=("dp",))
        own = zero.slice_params(w, dims)
        return g, own, zero.gather_params(own, dims)

    every = {"a": P("dp"), "b": P()}
    g, own, back = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=(pspecs,), out_specs=(every, every, pspecs)))(w)
    np.testing.assert_array_equal(g["a"], 10 * w["a"])        # quarters, in rank order: the whole sum
    np.testing.assert_array_equal(g["b"], 10 * w["b"])        # planned -1: all-reduced whole
    np.testing.assert_array_equal(own["a"], w["a"])
    for k in w:                                               # whole again on every device
        np.testing.assert_array_equal(back[k], w[k])


def test_two_adamw_steps_equal_the_unsharded_ones_with_a_dp_th_of_the_state():
    r = verify.check_zero1()
    assert r.passed, (r.errors, r.measured, r.expected)
    rs, ag = r.expected["step"]["reduce-scatter"], r.expected["step"]["all-gather"]
    assert rs == ag == (3, 4 * (12 * 64 + 64 + 64 * 12))      # w1, b1, w2 split over 8; b2 [12] whole
    assert r.expected["step"]["all-reduce"] == (1, 4 * 12)
    assert r.measured == r.expected
    assert "1.7 KiB of 12.6 KiB" in r.note and "whole: b2" in r.note     # 2 (6400/8 + 48) + 4 bytes


_W = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}


@pytest.mark.parametrize("shapes, pspecs, kw, words", [
    (_W, {"w": P("cp")}, dict(sizes={"dp": 2}), r"pspecs name axes \['cp'\]; the mesh has"),
    (_W, {"v": P()}, dict(sizes={"dp": 2}), "one jax.sharding.PartitionSpec per leaf"),
    (_W, {"w": P()}, dict(sizes={"dp": 0}), r"sizes\['dp'\]=0: need at least 1"),
    (_W, {"w": P()}, dict(sizes={"dp": -2}), r"sizes\['dp'\]=-2: need at least 1"),
    (_W, {"w": P()}, dict(sizes={"dp": 2.0}), r"sizes\['dp'\]=2.0 is a float"),
    (_W, {"w": P()}, dict(sizes=[("dp", 2)]), "sizes=.* is a list, not a mapping"),
    (_W, {"w": P()}, dict(sizes={"dp": 2}, skip=-1), "skip=-1: need at least 0"),
    (_W, {"w": P()}, dict(sizes={"dp": 2}, first=1), "first=1 is a int: give True or False"),
    ({"w": jax.ShapeDtypeStruct((8,), jnp.float32)}, {"w": P(None, "dp")}, dict(sizes={"dp": 2}),
     r"shapes\['w'\] has shape \(8,\) but its pspec .* names 2 dimensions"),
    ({"w": jax.ShapeDtypeStruct((6, 4), jnp.float32)}, {"w": P("tp")}, dict(sizes={"dp": 2, "tp": 4}),
     r"dimension 0 of shapes\['w'\]=6 is not divisible by tp=4.*Fix"),
    ({"w": "8x4"}, {"w": P()}, dict(sizes={"dp": 2}), r"shapes\['w'\] is a str, not an array"),
])
def test_bad_plans_are_refused(shapes, pspecs, kw, words):
    with pytest.raises(ConfigError, match=words):
        zero.plan(shapes, pspecs, **kw)


def test_a_mesh_without_the_axis_is_one_device_along_it():
    assert zero.plan(_W, {"w": P()}, sizes={"tp": 2}) == {"w": -1}


def test_zero3_against_the_pipeline_on_one_model():
    """The tour's row: both gradients equal jax.grad's; ZeRO-3's gathers and reduce-scatters
    and the pipeline's sends equal their formulas, from the compiled programs."""
    r = verify.check_zero3_vs_pp()
    assert r.passed, (r.errors, r.measured, r.expected)
    weights = 4 * verify.STACK_LAYERS * verify.STACK_D * verify.STACK_F * 2        # w1 and w2, float32
    zero3 = r.measured["ZeRO-3"]
    first_w1 = 4 * verify.STACK_D * verify.STACK_F                                  # not read again (see verify)
    assert zero3["all-gather"][1] == 2 * weights - first_w1 and zero3["reduce-scatter"][1] == weights
    b = r.measured["PP"]["collective-permute"][1] / (2 * verify.PP_MICROBATCHES * 4 * verify.STACK_SEQ
                                                     * verify.STACK_D)
    assert b == 2 * len(jax.devices()) // verify.PP_MICROBATCHES       # rows per microbatch: 16 / 4 on 8 devices
    assert "ZeRO-3 moves" in r.note and "per microbatch each way" in r.note


def test_gathered_layer_is_exact_and_regathers_in_the_backward():
    """zero.gathered on rank-coded shards: the forward sees the whole weight, the gradient
    is the dp-th of the sum over dp (the reduce-scatter), and the compiled backward gathers
    again (two all-gathers of the weight)."""
    m = mesh_lib.make_mesh(dp=4, devices=jax.devices()[:4])
    w = jnp.arange(32.0).reshape(8, 4)
    def mlp(p, x):                  # x [B, 4]: w read in the backward for the hidden gradient
        return jnp.einsum("bf,fd->bd", jnp.tanh(jnp.einsum("bd,fd->bf", x, p["w"])), p["w"])
    layer = zero.gathered(mlp, {"w": 0})

    def per_device(shard, x):
        return jax.grad(lambda s: jnp.sum(layer({"w": s}, x)))(shard)
    f = jax.jit(jax.shard_map(per_device, mesh=m, in_specs=(P("dp"), P("dp")), out_specs=P("dp")))
    x = jnp.linspace(-1, 1, 4 * 3 * 4).reshape(12, 4)
    np.testing.assert_allclose(f(w, x), jax.grad(lambda w: jnp.sum(mlp({"w": w}, x)))(w), rtol=1e-5, atol=1e-6)
    text = f.lower(w, x).compile().as_text()
    assert text.count(" all-gather(") == 2 and text.count(" reduce-scatter(") == 1


@pytest.mark.parametrize("dp, tp", [(4, 2), (8, 1), (1, 8)])
def test_fused_gathers_are_the_per_weight_ones_exactly_in_one_collective_per_group(dp, tp):
    """gathered(..., fuse=True) on rank-coded shards of weights of two dtypes, split along
    different dimensions, one varying over tp: the output, the input's and every weight's
    gradient equal to the unsharded function's, and bit for bit to one collective per
    weight's, with one all-gather forward, one backward and one reduce-scatter per group of
    one dtype and type (float32 invariant over tp, float32 varying over tp, float64; the
    vector planned -1 stays whole)."""
    m = mesh_lib.make_mesh(dp=dp, tp=tp)
    with jax.enable_x64(True):
        rank_coded = lambda shape, dtype, k: (jnp.arange(np.prod(shape), dtype=dtype).reshape(shape) + 1) / (8 + k)
        w = {"a": rank_coded((8, 4), jnp.float32, 0), "b": rank_coded((3, 8 * tp, 2), jnp.float32, 1),
             "c": rank_coded((4, 8), jnp.float64, 2), "d": rank_coded((2, 8), jnp.float32, 3),
             "v": rank_coded((4,), jnp.float32, 4)}
        pspecs = {"a": P("dp"), "b": P(None, ("tp", "dp")), "c": P(None, "dp"), "d": P(None, "dp"), "v": P()}
        dims = {"a": 0, "b": 1, "c": 1, "d": 1, "v": -1} if dp > 1 else dict.fromkeys(w, -1)   # as zero.plan

        # two outputs, each held to its own dtype's rule: y32 from the float32 weights (and h),
        # y64 = h @ c in float64, so the float64 weight's gradient (h's rows, computed alike on
        # any mesh, times y64) is float64's to 1e-12
        def fn(p, x):               # every weight read in the backward but d and v
            h = jnp.tanh(x @ p["a"]) * p["v"]                                     # [B, 4]
            t = jnp.einsum("bf,fkj->bkj", h[:, :3], p["b"]).sum(axis=(1, 2))     # b: [3, 8, 2] per tp rank
            return jax.lax.psum(t, "tp")[:, None] + p["d"].sum(0), h.astype(jnp.float64) @ p["c"]

        def loss(y32, y64):
            return jnp.sum(y32 ** 2), jnp.sum(y64 ** 2)

        def per_device(shard, x, fuse):
            layer = zero.gathered(fn, dims, fuse=fuse)
            out, (grads, dx) = jax.value_and_grad(lambda s, x: sum(loss(*layer(s, x))), argnums=(0, 1))(shard, x)
            return jax.lax.psum(loss(*layer(shard, x)), "dp"), grads, dx

        x = jnp.linspace(-1, 1, 2 * dp * 8).reshape(2 * dp, 8).astype(jnp.float32)
        run = {fuse: jax.jit(jax.shard_map(lambda s, x, fuse=fuse: per_device(s, x, fuse), mesh=m,
                                           in_specs=(pspecs, P("dp")), out_specs=(P(), pspecs, P("dp"))))
               for fuse in (False, True)}
        (out, grads, dx), (fused_out, fused_grads, fused_dx) = run[False](w, x), run[True](w, x)

        def unsharded(p, x):        # fn on the whole weights and batch: tp's sum over b is the sum over all of b
            h = jnp.tanh(x @ p["a"]) * p["v"]
            t = jnp.einsum("bf,fkj->bkj", h[:, :3], p["b"]).sum(axis=(1, 2))
            return loss(t[:, None] + p["d"].sum(0), h.astype(jnp.float64) @ p["c"])
        ref_out = unsharded(w, x)
        ref_grads, ref_dx = jax.grad(lambda p, x: sum(unsharded(p, x)), argnums=(0, 1))(w, x)
        assert (out[1].dtype, grads["c"].dtype) == (jnp.float64, jnp.float64)
        for got, want in ((out, ref_out), (dx, ref_dx), (grads, ref_grads)):
            testing.assert_close(got, want)         # leaf by leaf, each by its dtype (jaxpar.testing.tolerance)
        for a, b in zip(fused_out, out):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(fused_dx, dx)
        for k in w:
            assert fused_grads[k].dtype == w[k].dtype
            np.testing.assert_array_equal(fused_grads[k], grads[k])
        text = run[True].lower(w, x).compile().as_text()
    groups = 3 if dp > 1 else 0        # {a, d}, {b} (varies over tp), {c} (float64); none over one device
    regathered = 3 if dp > 1 else 0    # {a} (of {a, d}: d's pullback reads no weight), {b}, {c}
    assert text.count(" all-gather(") == groups + regathered, text.count(" all-gather(")
    assert text.count(" reduce-scatter(") == groups
