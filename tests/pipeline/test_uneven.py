"""Uneven pipeline stages (`layers_per_stage`): the runtime against the unsharded model.

* one schedule of each kind (1F1B at p=4, interleaved with v=2, ZB-H1 with its split
  backward, DualPipe-V with the V placement, GPipe with recompute; a dp x pp mesh with
  first- and last-stage functions), every case with a stage of one layer and one of
  several: the loss, every parameter gradient, the input gradient and the first and last
  stages' gradients equal the unsharded model's (float32; float64 to ~1e-12 on one case),
  with NaN in every unused slot, and the compiled collectives equal the formula's (the
  padding adds none);
* what F stores for B holds activations only, as with even stages (the skipped padding
  keeps no weight);
* even counts given explicitly lower to the very program of the default split;
* the padded stage layout and back (`to_stages` / `from_stages`) for both placements;
* ConfigError, before anything compiles, for counts that do not fit.

One compile per case (a few seconds each at these sizes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar.errors import ConfigError
from jaxpar.pipeline import passes, runtime, stage, stage_layers, verify
from jaxpar.schedules import schedule
from jaxpar.testing import assert_close, compiled_collectives

WIDTH = 32


def _run(name, p, m, counts, *, chunks=None, layers="mlp", dp=1, recompute="none", dtype=jnp.float32):
    """(loss, Grads, the compiled collectives, the formula's, the reference's loss and Grads)."""
    s = schedule.make(name, stages=p, microbatches=m, chunks=chunks)
    stage_fn, params, batch = verify.model(layers, sum(counts), 2 * m * dp, dtype)
    mesh = mesh_lib.make_mesh(dp=dp, pp=p, devices=jax.devices()[:dp * p])
    pipe = runtime.pipeline(s, stage_fn, params, batch, mesh=mesh, recompute=recompute, bubble_fill=float("nan"),
                            layers_per_stage=counts)
    compiled = pipe.step.lower(runtime.to_stages(params, s, counts), *batch, None, None).compile()
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), params, batch)
    ref_loss, ref = stage.unsharded(stage_fn, params, batch)
    return (loss, grads, compiled_collectives(compiled, pipe.plan.runs()),
            verify.expected_collectives(pipe, params, batch), ref_loss, ref)


CASES = [  # (schedule, p, m, layers per model stage, chunks, stage layers, recompute)
    ("1f1b", 4, 4, (1, 3, 2, 1), None, "mlp", "none"),
    ("interleaved", 2, 4, (1, 2, 3, 1), 2, "mlp", "none"),      # chunk 0 of device 0 light, chunk 1 of device 0 heavy
    ("zb-h1", 4, 4, (2, 1, 1, 3), None, "mlp", "none"),         # B and W split: W skips the padding too
    ("dualpipe-v", 2, 4, (1, 3, 2, 1), None, "mlp", "none"),    # V placement: device 0 holds stages 0 and 3
    ("gpipe", 2, 2, (3, 1), None, "mlp", "full"),                # recompute: B runs the padded forward again
    ("1f1b", 2, 2, (1, 3), None, "blocks", "none"),             # reference transformer blocks
]


@pytest.mark.parametrize("name, p, m, counts, chunks, layers, recompute", CASES,
                         ids=[f"{c[0]}-p{c[1]}-{'-'.join(map(str, c[3]))}-{c[5]}" for c in CASES])
def test_uneven_stages_match_unsharded(name, p, m, counts, chunks, layers, recompute):
    loss, grads, measured, expected, ref_loss, ref = _run(name, p, m, counts, chunks=chunks, layers=layers,
                                                          recompute=recompute)
    assert_close(loss, ref_loss)
    assert_close(grads.inputs, ref.inputs)
    assert_close(grads.params, ref.params)      # [L, ...]: the caller's layout, no padding
    assert measured == expected


def test_uneven_stages_in_float64(x64):
    loss, grads, _, _, ref_loss, ref = _run("1f1b", 4, 4, (1, 2, 4, 1), dtype=jnp.float64)
    for got, want in ((loss, ref_loss), (grads.inputs, ref.inputs), (grads.params, ref.params)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def _first(fp, x):
    return jnp.tanh(x @ fp["w"])


def _head_loss(lp, y, targets):
    return jnp.mean(jnp.square(y @ lp["w"] + lp["b"] - targets))


def test_uneven_stages_with_first_and_last_functions_on_dp_pp():
    """dp=2 x pp=2, stages of 1 and 3 layers, the first stage's function and the loss's
    parameters: every gradient against jax.value_and_grad of the whole model."""
    s = schedule.make("1f1b", stages=2, microbatches=2)
    rng = np.random.default_rng(3)
    params = stage.mlp_params(4, WIDTH)
    first = {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / WIDTH ** 0.5, jnp.float32)}
    last = {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / WIDTH ** 0.5, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(WIDTH), jnp.float32)}
    inputs, targets = stage.mlp_batch(8, WIDTH)
    mesh = mesh_lib.make_mesh(dp=2, pp=2, devices=jax.devices()[:4])
    loss, grads = runtime.run(s, stage.mlp_stage, params, (inputs, targets), mesh=mesh, first_fn=_first,
                              first_params=first, loss_fn=_head_loss, last_params=last, layers_per_stage=(1, 3))

    def whole(params, first, last, inputs):
        return _head_loss(last, stage.mlp_stage(params, _first(first, inputs)), targets)
    ref_loss, ref = jax.value_and_grad(whole, argnums=(0, 1, 2, 3))(params, first, last, inputs)
    assert_close(loss, ref_loss)
    assert_close((grads.params, grads.first, grads.last, grads.inputs), ref)


def _stored_shapes(counts, depth):
    """The ShapeDtypeStructs of what F stores for one microbatch, learned inside a
    shard_map over pp=2 (Stack.learn), with `counts` [p][chunks] (None: even stages)."""
    mesh = mesh_lib.make_mesh(pp=2, devices=jax.devices()[:2])
    found = []

    def per_device(params, x):
        params = jax.tree.map(lambda a: a[0], params)
        found.append(passes.Stack(stage.mlp_layer, depth, "none", counts).learn(params, x[0]))
        return x
    params = jax.tree.map(lambda a: a.reshape(2, 1, depth, *a.shape[1:]), stage.mlp_params(2 * depth, WIDTH))
    x = jnp.zeros((2, 4, WIDTH))
    jax.eval_shape(jax.shard_map(per_device, mesh=mesh, in_specs=(jax.sharding.PartitionSpec("pp"),) * 2,
                                 out_specs=jax.sharding.PartitionSpec("pp")), params, x)
    return found[0].stored


def test_padding_stores_activations_only():
    """The residuals F keeps per microbatch are the same leaves with and without the
    padding's conditional: no weight is stored, whatever the layer count."""
    assert _stored_shapes(((1,), (3,)), 3) == _stored_shapes(None, 3)
    assert all(a.shape[-1] == WIDTH and a.shape[-2] == 4 for a in _stored_shapes(((1,), (3,)), 3))


def _lowered(counts):
    s = schedule.make("1f1b", stages=2, microbatches=2)
    stage_fn, params, batch = verify.model("mlp", 4, 4)
    mesh = mesh_lib.make_mesh(pp=2, devices=jax.devices()[:2])
    pipe = runtime.pipeline(s, stage_fn, params, batch, mesh=mesh, layers_per_stage=counts)
    return pipe.step.lower(runtime.to_stages(params, s, counts), *batch, None, None).as_text()


def test_even_counts_build_the_even_program():
    even = _lowered(None)
    assert _lowered((2, 2)) == even
    assert _lowered((1, 3)) != even


@pytest.mark.parametrize("name, chunks", [("1f1b", None), ("interleaved", 2), ("dualpipe-v", None)])
def test_padded_layout_round_trips(name, chunks):
    s = schedule.make(name, stages=2, microbatches=4, chunks=chunks)
    counts = (1, 3) if s.virtual_stages == 2 else (1, 2, 3, 1)
    params = {"w": jnp.arange(sum(counts) * 3.0).reshape(sum(counts), 3) + 1, "b": jnp.arange(sum(counts)) + 1}
    staged = runtime.to_stages(params, s, counts)
    assert staged["w"].shape == (2, s.chunks, 3, 3)
    held = stage.padded_layers(s, counts)
    for d in range(2):
        for c in range(s.chunks):
            k = s.stage_of(d, c)
            first = sum(counts[:k])
            np.testing.assert_array_equal(staged["b"][d, c, :counts[k]], params["b"][first:first + counts[k]])
            assert not np.any(staged["b"][d, c, held[d, c]:])          # the padding: zeros
    back = runtime.from_stages(staged, s, counts)
    assert jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), back, params) == {"w": True, "b": True}


@functools.cache
def _request_args():
    s = schedule.make("1f1b", stages=4, microbatches=4)
    stage_fn, params, batch = verify.model("mlp", 6, 8)
    return s, stage_fn, params, batch, mesh_lib.make_mesh(pp=4, devices=jax.devices()[:4])


@pytest.mark.parametrize("counts, match", [
    ((1, 2, 2, 2), r"sums to 7, the model has 6 layers.*layers_per_stage=\(1, 2, 2, 1\)"),
    ((2, 2, 2), r"has 3 entries for 4 model stages"),
    ((0, 2, 2, 2), r"entries \[0\] are not whole numbers >= 1"),
    ((1.0, 2, 2, 1), r"entries \[1.0\] are not whole numbers"),
    ("1,2,2,1", r"give a tuple of whole numbers"),
])
def test_bad_counts_are_refused(counts, match):
    s, stage_fn, params, batch, mesh = _request_args()
    with pytest.raises(ConfigError, match=match):
        runtime.request(s, stage_fn, params, batch, mesh=mesh, layers_per_stage=counts)


@pytest.mark.parametrize("args, match", [
    ((2, 4), r"n_layers=2: need at least 4; every one of the 4 stages holds at least one layer"),
    ((2, 0), r"n_stages=0: need at least 1"),
    ((6, 4.0), r"n_stages=4.0 is a float, not a whole number"),
])
def test_even_or_near_refuses_stages_it_cannot_fill(args, match):
    with pytest.raises(ConfigError, match=match):
        stage_layers.even_or_near(*args)
    assert stage_layers.even_or_near(6, 4) == (1, 2, 2, 1) and stage_layers.even_or_near(4, 4) == (1, 1, 1, 1)


def test_uneven_needs_a_layers_stage():
    s, _, params, batch, mesh = _request_args()
    with pytest.raises(ConfigError, match=r"uneven stages.*stage\.layers\(layer_fn\)"):
        runtime.request(s, lambda p, x: stage.mlp_stage(p, x), params, batch, mesh=mesh,
                        layers_per_stage=(1, 2, 2, 1))


def test_indivisible_layers_name_layers_per_stage():
    s, stage_fn, params, batch, mesh = _request_args()
    with pytest.raises(ConfigError, match="6 layers do not split into p.v = 4.1 = 4 stages.*layers_per_stage"):
        runtime.request(s, stage_fn, params, batch, mesh=mesh)
