"""The invariant behind the pipeline's memory claim (passes.split_vjp): what F stores
between F and B excludes the stage's parameters, which B re-reads from the weights, so
a residual slot holds activations only.

Checked under a trace, as the program runs it, on the lecture's MLP layer, a reference
transformer block, a user's flax NNX block and a plain stage function that closes over a
constant: no stored leaf is a parameter, the pullback rebuilt from the stored leaves and
the weights equals jax.vjp's, and a stage's stored bytes are proportional to the
microbatch's rows (a stored weight would not be). A control undoes the split and shows
that these checks then fail. No program is compiled: each case traces in milliseconds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import reference
from jaxpar.pipeline import modules, passes, stage, verify
from jaxpar.testing import assert_close

ROWS, WIDTH = 3, 8   # ROWS != WIDTH: an activation [ROWS, WIDTH] never has a weight's shape [WIDTH, WIDTH]
CFG = reference.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32)


def _whole(params, x):
    """A plain stage function (passes.Whole) that closes over a constant. It uses its
    parameters whole: slices it takes of them are its own residuals (docs/pipeline.md,
    Limits)."""
    return jnp.tanh(x @ params["w"] + params["b"]) + jnp.linspace(-0.1, 0.1, WIDTH)


def _layer(kind: str):
    """(fn, params, x) of one layer (or, for "whole", one chunk) of each kind of stage."""
    rng = np.random.default_rng(0)
    if kind == "mlp":
        return stage.mlp_layer, jax.tree.map(lambda a: a[0], stage.mlp_params(1, WIDTH)), \
            jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)
    if kind == "block":
        params = reference.layer_params(reference.init_params(jax.random.key(0), CFG), 0)
        return functools.partial(reference.block, cfg=CFG), params, \
            jnp.asarray(rng.standard_normal((ROWS, 5, CFG.d_model)), jnp.float32)
    if kind == "whole":
        return _whole, jax.tree.map(lambda a: a[0], stage.mlp_params(1, WIDTH)), \
            jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)
    fn, params = modules.nnx_layers([verify.NnxBlock(WIDTH, nnx.Rngs(0))])
    return fn.layer_fn, jax.tree.map(lambda a: a[0], params), \
        jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)


def traced_split(fn, params, x) -> dict:
    """split_vjp traced under jit, as inside the program: which stored leaves are
    parameters (the same traced array), how many of the pullback's leaves are, and the
    rebuilt pullback's cotangents next to jax.vjp's."""
    found = {}

    def run(params, x):
        y, stored, template = passes.split_vjp(fn, params, x)
        weights = jax.tree.leaves(params)
        is_param = lambda a: any(a is w for w in weights)
        found["stored"] = [(a.shape, is_param(a)) for a in stored]
        found["in_pullback"] = sum(map(is_param, jax.tree.leaves(jax.vjp(fn, params, x)[1])))
        g = jnp.ones_like(y)
        return passes.join_vjp(template, params, stored)(g), jax.vjp(fn, params, x)[1](g)

    found["rebuilt"], found["reference"] = jax.jit(run)(params, x)
    return found


@pytest.mark.parametrize("kind", ["mlp", "block", "whole", "nnx"])
def test_stored_residuals_exclude_the_parameters(kind):
    fn, params, x = _layer(kind)
    found = traced_split(fn, params, x)
    weight_shapes = {w.shape for w in jax.tree.leaves(params)}
    assert found["in_pullback"] > 0, "nothing to exclude: the pullback holds no parameter"
    assert found["stored"] and not any(is_param for _, is_param in found["stored"]), found["stored"]
    assert not any(shape in weight_shapes for shape, _ in found["stored"]), (found["stored"], weight_shapes)
    assert_close(found["rebuilt"], found["reference"])


def stored_bytes(rows: int, width: int = WIDTH) -> int:
    """Bytes a 2-layer MLP Stack's F stores for a microbatch of `rows` (Stack.learn)."""
    params = jax.tree.map(lambda a: a.reshape(1, 2, *a.shape[1:]), stage.mlp_params(2, width))   # [chunks, Lc, ...]
    learned = passes.Stack(stage.mlp_layer, depth=2, recompute="none").learn(params, jnp.zeros((rows, width)))
    return sum(a.size * a.dtype.itemsize for a in learned.stored)


def test_a_stage_stores_activations_only():
    """What a layers stage stores scales with the microbatch's rows, as activations do:
    a [W, W] weight among them would not double with the rows."""
    assert stored_bytes(2 * ROWS) == 2 * stored_bytes(ROWS) > 0


def test_the_checks_fail_with_the_split_undone(monkeypatch):
    """Control: when split_vjp recognises no parameter, F stores the weights, and each
    check above sees it."""
    monkeypatch.setattr(passes, "_parameter_positions", lambda params: {})
    fn, params, x = _layer("mlp")
    found = traced_split(fn, params, x)
    assert any(is_param for _, is_param in found["stored"])
    assert (WIDTH, WIDTH) in {shape for shape, _ in found["stored"]}
    assert stored_bytes(2 * ROWS) != 2 * stored_bytes(ROWS)
