"""recompute="dots": F keeps the outputs of the matmuls without batch dimensions and of
the collectives, B recomputes the rest (norms, rotary embedding, attention scores and
softmax, activations). The step trains like the unsharded model, runs the same
collectives as without recompute (none again in B), and its compiled step holds less.
The drawn configurations (tests/train/drawn.py) draw it with every technique."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.mesh import TP, make_mesh
from jaxpar.train import model, summary, verify
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

SPEC = dict(dp=2, pp=2, tp=2, microbatches=2)


def _kept(fn, *args, axis_size=None):
    """[(primitive name, keep_dots's answer)] over fn's jaxpr, in order (inside a
    shard_map over tp when axis_size is given)."""
    if axis_size:
        mesh = make_mesh(tp=axis_size, devices=jax.devices()[:axis_size])
        fn = jax.shard_map(fn, mesh=mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec())
    answers = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            answers.append((eqn.primitive.name, model.keep_dots(eqn.primitive, *eqn.invars, **eqn.params)))
            for value in eqn.params.values():
                if isinstance(value, (jex.ClosedJaxpr, jex.Jaxpr)):
                    walk(getattr(value, "jaxpr", value))
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return answers


def test_the_policy_keeps_projections_and_collectives_not_attention_or_elementwise():
    x, w = jnp.ones((2, 8, 4)), jnp.ones((4, 6))

    def layer(x):
        h = x @ w                                              # a projection: no batch dimensions
        scores = jnp.einsum("bqd,bkd->bqk", h, h)             # attention's scores: batched
        return jax.lax.psum(jax.nn.softmax(scores) * jax.lax.rsqrt(h.sum()), TP)
    kept = _kept(layer, x, axis_size=2)
    of = lambda test: [answer for name, answer in kept if test(name)]
    assert of(lambda n: n == "dot_general") == [True, False]      # the projection, not the scores
    assert of(lambda n: n.startswith("psum")) == [True]
    assert not any(of(lambda n: n in ("exp", "rsqrt", "reduce_max", "reduce_sum", "mul", "div")))


@pytest.fixture(scope="module")
def trainers():
    return {r: Trainer(verify.DENSE, ParallelSpec(**SPEC, recompute=r), verify.OPTIM, batch_size=8, seq_len=16)
            for r in ("none", "dots")}


def test_dots_runs_the_same_collectives_and_holds_less(trainers):
    counts = {}
    for r, trainer in trainers.items():
        c = summary.collectives(trainer, trainer.compiled)
        assert summary.matches(c), r
        counts[r] = (c["sends"], c["reductions"], [c["stages"][d] for d in range(trainer.spec.pp)])
    assert counts["dots"] == counts["none"]           # B sends nothing F's collectives sent
    temp = {r: t.compiled.memory_analysis().temp_size_in_bytes for r, t in trainers.items()}
    # the residual slots hold the projections' outputs, not the norms', scores', softmax's
    # and activation's as well: 0.35 here (d_model 16, 16 tokens)
    assert temp["dots"] < 0.6 * temp["none"], temp


def test_dots_trains_like_the_unsharded_model_in_float64():
    # float32 at 1e-5: the drawn configurations (recompute drawn among "none", "full", "dots")
    with jax.enable_x64(True):
        r = verify.parity(ParallelSpec(**SPEC, recompute="dots"), steps=3, dtype=jnp.float64)
    assert max(r.errors.values()) <= 1e-12, r.errors
    assert r.passed
    assert np.isfinite(list(r.errors.values())).all()
