"""The pipeline runtime at scale: one scan whatever m, layers scanned, the
built step cached, weight gradients in place (memory flat in m at p = 2), stages from
flax NNX modules, and the guarded ppermutes counted exactly.

Programs are compared by their lowered StableHLO (no XLA compile: cheap), memory by the
compiled program's temp bytes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import comms
from jaxpar import mesh as mesh_lib
from jaxpar.errors import ConfigError
from jaxpar.pipeline import modules, runtime, stage, verify
from jaxpar.schedules import schedule
from jaxpar.pipeline import plan as plan_lib
from jaxpar.testing import assert_close

WIDTH = 8


def pp_mesh(p: int, dp: int = 1):
    sizes = dict(dp=dp, pp=p) if dp > 1 else dict(pp=p)
    return mesh_lib.make_mesh(devices=jax.devices()[:dp * p], **sizes)


def lowered_ops(name: str, p: int, m: int, per_stage: int = 1) -> int:
    """Operations in the lowered program of `name` (one op per line of the StableHLO)."""
    s = schedule.make(name, stages=p, microbatches=m)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          stage.mlp_params(per_stage * s.virtual_stages, WIDTH))
    x = jax.ShapeDtypeStruct((2 * m, WIDTH), jnp.float32)
    pipe = runtime.pipeline(s, stage.mlp_stage, params, (x, x), mesh=pp_mesh(p))
    staged = jax.eval_shape(lambda q: runtime.to_stages(q, s), params)
    text = pipe.step.lower(staged, x, x, None, None).as_text()
    return sum(1 for line in text.splitlines() if "=" in line or line.strip().startswith(("stablehlo.", "func.")))


def smallest_m(name: str, p: int, at_least: int) -> int:
    for m in range(at_least, 4 * at_least):
        try:
            schedule.make(name, stages=p, microbatches=m)
            return m
        except ValueError:
            continue
    raise AssertionError(name)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", schedule.KNOWN)
def test_program_size_does_not_grow_with_m(name, p):
    small, large = smallest_m(name, p, 8), smallest_m(name, p, 64)
    plans = [plan_lib.plan(schedule.make(name, stages=p, microbatches=m)) for m in (small, large)]
    assert [pl.scans for pl in plans] == [1, 1]
    assert plans[1].steps > plans[0].steps   # the trip count grows, the program does not
    assert lowered_ops(name, p, small) == lowered_ops(name, p, large)


def test_program_size_does_not_grow_with_layers_per_stage():
    assert lowered_ops("1f1b", 2, 4, per_stage=2) == lowered_ops("1f1b", 2, 4, per_stage=8)


def test_1f1b_memory_is_flat_in_m_at_p2():
    """Before, every extra scan at p = 2 held a copy of the stage's weights."""
    temps = []
    for m in (8, 16):
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stage.mlp_params(4, 128))
        x = jax.ShapeDtypeStruct((8 * m, 128), jnp.float32)
        s = schedule.make("1f1b", stages=2, microbatches=m)
        pipe = runtime.pipeline(s, stage.mlp_stage, params, (x, x), mesh=pp_mesh(2), input_grads=False)
        staged = jax.eval_shape(lambda q: runtime.to_stages(q, s), params)
        temps.append(pipe.step.lower(staged, x, x, None, None).compile().memory_analysis().temp_size_in_bytes)
    assert temps[1] <= 1.05 * temps[0], temps


def test_run_caches_the_built_step(monkeypatch):
    builds = []
    real = runtime.pipeline
    monkeypatch.setattr(runtime, "pipeline", lambda *a, **k: builds.append(1) or real(*a, **k))
    runtime.cache_clear()
    s = schedule.make("1f1b", stages=2, microbatches=2)
    params, batch = stage.mlp_params(2, WIDTH), stage.mlp_batch(4, WIDTH)
    first = runtime.run(s, stage.mlp_stage, params, batch, mesh=pp_mesh(2))
    other = jax.tree.map(lambda a: a * 2, params)                       # other values, same shapes
    runtime.run(schedule.make("1f1b", stages=2, microbatches=2), stage.mlp_stage, other, batch, mesh=pp_mesh(2))
    again = runtime.run(s, stage.mlp_stage, params, batch, mesh=pp_mesh(2))
    assert len(builds) == 1
    assert_close(jax.tree.leaves(first), jax.tree.leaves(again))
    runtime.run(s, stage.mlp_stage, params, batch, mesh=pp_mesh(2), recompute="full")   # another option
    runtime.run(s, stage.mlp_stage, params, stage.mlp_batch(8, WIDTH), mesh=pp_mesh(2))  # another shape
    assert len(builds) == 3


def test_a_request_is_checked_once_and_keys_the_cache():
    """runtime.request checks and keeps shapes only; requests that build the same program
    are equal and hash alike (the schedule by its table, functions by identity, NaN fill
    by its repr), any other option makes another; a Request is passed alone. Nothing compiles."""
    params, batch = stage.mlp_params(2, WIDTH), stage.mlp_batch(4, WIDTH)
    req = lambda **kw: runtime.request(schedule.make("1f1b", stages=2, microbatches=2), stage.mlp_stage,
                                       kw.pop("params", params), batch, mesh=pp_mesh(2), **kw)
    one = req()
    assert one == req(params=jax.tree.map(lambda a: a * 2, params)) and hash(one) == hash(req())
    assert req(bubble_fill=float("nan")) == req(bubble_fill=float("nan")) != one
    assert len({one, req(recompute="full"), req(input_grads=False), req(loss_fn=lambda y, t: jnp.mean(y - t))}) == 4
    assert jax.tree.leaves(one.params) == [jax.ShapeDtypeStruct((2, WIDTH), jnp.float32),
                                           jax.ShapeDtypeStruct((2, WIDTH, WIDTH), jnp.float32)]
    assert (one.n_layers, one.depth, one.batch_axes, one.input_grads, one.scale) == (2, 1, (), True, 2)
    with pytest.raises(ConfigError, match="a Request carries its arguments and options: pass it alone"):
        runtime.pipeline(one, recompute="full")


def test_guarded_permutes_are_counted_exactly():
    """The compiled program holds one guarded ppermute per channel; comms.resolve turns
    its upper bound (every step) into the plan's count, and refuses a count above it."""
    s = schedule.make("1f1b", stages=4, microbatches=8)
    params, batch = stage.mlp_params(4, WIDTH), stage.mlp_batch(16, WIDTH)
    pipe = runtime.pipeline(s, stage.mlp_stage, params, batch, mesh=pp_mesh(4))
    ops = comms.collective_ops(pipe.step, runtime.to_stages(params, s), *batch, None, None)
    permutes = [o for o in ops if o.kind == "collective-permute"]
    assert len(permutes) == len(pipe.plan.channels) == 2 and all(o.conditional for o in permutes)
    assert all(o.executions == pipe.plan.steps for o in permutes)
    exact = comms.summarize(comms.resolve(ops, pipe.plan.runs()))["collective-permute"]
    assert exact["count"] == pipe.plan.permutes == 29 and exact["in_conditional"] == 0
    with pytest.raises(ConfigError, match="more than the 20 executions"):
        comms.resolve(ops, {plan_lib.scope("F", "right"): 21, plan_lib.scope("B", "left"): 1})
    with pytest.raises(ConfigError, match="no conditional collective in the scopes"):
        comms.resolve(ops, {"not_there": 1})


Block = verify.NnxBlock   # a user's own block: RMSNorm, an MLP, a residual


class Stack(nnx.Module):
    def __init__(self, blocks):
        self.blocks = nnx.List(blocks)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("name,p,m,dp", [("1f1b", 2, 4, 2), ("dualpipe-v", 2, 3, 1)])
def test_nnx_module_stage_matches_the_module_unsharded(name, p, m, dp):
    s = schedule.make(name, stages=p, microbatches=m)
    blocks = [Block(16, nnx.Rngs(i)) for i in range(2 * s.virtual_stages)]
    stage_fn, params = modules.nnx_layers(blocks)
    rng = np.random.default_rng(0)
    x, t = (jnp.asarray(rng.standard_normal((2 * m * dp, 16)), jnp.float32) for _ in range(2))
    loss, grads = runtime.run(s, stage_fn, params, (x, t), mesh=pp_mesh(p, dp))
    assert isinstance(grads.params, nnx.State)
    ref_loss, (ref_model, ref_x) = nnx.value_and_grad(lambda mdl, x: jnp.mean((mdl(x) - t) ** 2),
                                                      argnums=(0, 1))(Stack(blocks), x)
    per_layer = modules.unstack(grads.params)
    ref_layers = [nnx.state(ref_model.blocks[j], nnx.Param) for j in range(len(blocks))]
    assert_close((loss, grads.inputs, [jax.tree.leaves(g) for g in per_layer]),
                 (ref_loss, ref_x, [jax.tree.leaves(g) for g in ref_layers]))


def test_nnx_layers_refuses_what_it_cannot_stack():
    with pytest.raises(ConfigError, match="give a non-empty list of nnx.Module"):
        modules.nnx_layers([])
    with pytest.raises(ConfigError, match=r"blocks\[1\] is a int, not a flax nnx.Module"):
        modules.nnx_layers([Block(4, nnx.Rngs(0)), 3])
    with pytest.raises(ConfigError, match=r"blocks\[1\] is not built like blocks\[0\]"):
        modules.nnx_layers([Block(4, nnx.Rngs(0)), Block(8, nnx.Rngs(1))])


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 2), ("dualpipe-v", 2, 3)])
def test_first_and_last_stage_functions_with_their_own_params(name, p, m):
    """A first-stage projection (float inputs: d loss / d inputs goes through it) and a
    last-stage loss with its own head; under DualPipe-V both ends are on device 0."""
    s = schedule.make(name, stages=p, microbatches=m)
    params = stage.mlp_params(s.virtual_stages, WIDTH)
    rng = np.random.default_rng(3)
    first = {"w": jnp.asarray(rng.standard_normal((5, WIDTH)) / 3, jnp.float32)}
    last = {"head": jnp.asarray(rng.standard_normal((WIDTH, 3)) / 3, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((2 * m, 5)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((2 * m, 3)), jnp.float32)
    first_fn = lambda fp, x: jnp.tanh(x @ fp["w"])
    loss_fn = lambda lp, y, t: jnp.mean(jnp.square(y @ lp["head"] - t))
    loss, grads = runtime.run(s, stage.mlp_stage, params, (x, t), mesh=pp_mesh(p), first_fn=first_fn,
                              first_params=first, last_params=last, loss_fn=loss_fn, bubble_fill=float("nan"))

    def whole(params, first, last, x):
        return loss_fn(last, stage.mlp_stage(params, first_fn(first, x)), t)
    ref_loss, ref = jax.value_and_grad(whole, argnums=(0, 1, 2, 3))(params, first, last, x)
    assert_close((loss, grads.params, grads.first, grads.last, grads.inputs), (ref_loss, *ref))
