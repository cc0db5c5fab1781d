"""The parity check itself (`train.verify.parity`, `mixed_parity`): each step judged at the
weights it started from, so it passes a correct program whose weights drift apart over
several AdamW steps, and fails each of three bugs planted in the sharded step, in float32
and in bf16, through the gradients it applied (read back from AdamW's first moment)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxpar import reference
from jaxpar.testing import tolerance
from jaxpar.train import step as step_lib
from jaxpar.train import verify
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer


def test_a_correct_program_whose_weights_drift_apart_passes():
    """dp2 with ZeRO-1: one embedding element whose gradient is near zero takes a full AdamW
    step in whichever direction its rounding left it, and after 20 steps the weights are
    1e-5 apart; at each step's own weights everything agrees to the float32 rule."""
    cfg = reference.ModelConfig(n_layers=2, d_model=24, n_heads=8, n_kv_heads=4, head_dim=4, d_ff=64, mlp="swiglu",
                                vocab=48)
    r = verify.parity(ParallelSpec(dp=2, zero=1), cfg, batch_size=4, seq_len=16)
    assert r.passed, r.errors
    assert set(r.errors) == {"losses", "grad norms", "step loss", "step norm", "gradients", "gradient directions",
                             "gradient scales", "updates"}


def _double_one_leaf(grads, _):
    """The last layer's mlp_norm gain: 2.5 % of the gradient's norm (verify.DENSE, first
    batch), so the norm moves by 0.1 %, and AdamW's update not at all."""
    mlp_norm = grads["blocks"]["mlp_norm"]                                    # [pp, v, Lc, D]
    return {**grads, "blocks": {**grads["blocks"], "mlp_norm": mlp_norm.at[:, :, -1].multiply(2)}}


def _drop_one_layer(grads, _):
    return {**grads, "blocks": {k: g.at[:, :, 0].set(0) for k, g in grads["blocks"].items()}}    # [pp, v, Lc, ...]


def _first_microbatch_twice(grads, again):
    """`again()`: the gradients of the step with every microbatch the first one, m times
    its gradient: adding 1/m of them counts the first microbatch twice (the loss reported
    stays right)."""
    repeated, m = again()
    return jax.tree.map(lambda g, a: g + a / m, grads, repeated)


PLANTS = {"nothing": lambda grads, _: grads, "one leaf's gradient doubled": _double_one_leaf, "one layer's gradient dropped": _drop_one_layer,
          "the first microbatch counted twice": _first_microbatch_twice}


@pytest.fixture
def plant(monkeypatch):
    """Plant a bug of PLANTS in the sharded step: every Trainer built after it computes its
    gradients, then the bug changes them before the reduction (a fresh step cache: no
    other test's Trainer is touched)."""
    def apply(kind):
        original, bug = Trainer._loss_and_gradients, PLANTS[kind]

        def wrong(self, program, params, inputs, targets):
            loss, grads, load = original(self, program, params, inputs, targets)

            def again():
                m = self.schedule.microbatches
                first = lambda a: jnp.concatenate([a[:a.shape[0] // m]] * m)
                return original(self, program, params, first(inputs), first(targets))[1], m
            return loss, bug(grads, again), load
        monkeypatch.setattr(Trainer, "_loss_and_gradients", wrong)
        monkeypatch.setattr(step_lib, "_BUILT", {})
    return apply


MESH = ParallelSpec(dp=2, tp=2, microbatches=2)


@pytest.mark.parametrize("kind", list(PLANTS))
def test_a_planted_bug_fails_the_float32_check_by_its_gradients(plant, kind):
    plant(kind)
    r = verify.parity(MESH, verify.DENSE, steps=2)
    assert r.passed == (kind == "nothing"), r.errors
    if kind != "nothing":
        assert r.errors["gradients"] > 100 * tolerance(jnp.float32)[0], r.errors


@pytest.mark.parametrize("kind", list(PLANTS))
def test_a_planted_bug_fails_the_bf16_check_by_a_leaf_s_direction_or_length(plant, kind):
    """AdamW's update hides each of them (it divides a gradient by its own scale), and the
    global norm the doubled gain (0.1 %, under bf16's 1e-2); a leaf's direction or length
    shows each."""
    plant(kind)
    r = verify.mixed_parity(dataclasses.replace(MESH, dp=1), verify.DENSE, steps=2)
    assert r.passed == (kind == "nothing"), r.errors
    bounds = verify.MIXED_BOUNDS
    if kind != "nothing":
        assert (r.errors["gradient scales"] > 5 * bounds["gradient scales"]
                or r.errors["gradient directions"] > 10 * bounds["gradient directions"]), r.errors
