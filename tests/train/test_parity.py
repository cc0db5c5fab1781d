"""The parity check itself (`train.verify.parity`, `mixed_parity`): each step judged at the
weights it started from, so it passes a correct program whose weights drift apart over
several AdamW steps, and fails each of three bugs planted in the sharded step through the
gradients it applied (read back from AdamW's first moment), and in bf16 the one AdamW's
update and the norm hide."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxpar import reference
from jaxpar.testing import tolerance
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
    mlp_norm = grads["blocks"]["mlp_norm"]                                    # [pp, chunks, Lc, D]
    return {**grads, "blocks": {**grads["blocks"], "mlp_norm": mlp_norm.at[:, :, -1].multiply(2)}}


def _drop_one_layer(grads, _):
    return {**grads, "blocks": {k: g.at[:, :, 0].set(0) for k, g in grads["blocks"].items()}}    # [pp, chunks, Lc, ...]


def _first_microbatch_twice(grads, again):
    """`again()`: the gradients of the step with every microbatch the first one, m times
    its gradient: adding 1/m of them counts the first microbatch twice (the loss reported
    stays right)."""
    repeated, m = again()
    return jax.tree.map(lambda g, a: g + a / m, grads, repeated)


PLANTS = {"one leaf's gradient doubled": _double_one_leaf, "one layer's gradient dropped": _drop_one_layer,
          "the first microbatch counted twice": _first_microbatch_twice}


@pytest.fixture
def plant(monkeypatch):
    """Plant a bug of PLANTS in the sharded step: every Trainer built after it computes its
    gradients, then the bug changes them before the reduction (verify.parity without a
    TrainerCache builds its own Trainer: no other test's is touched)."""
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
    return apply


MESH = ParallelSpec(dp=2, tp=2, microbatches=2)


@pytest.mark.parametrize("kind", list(PLANTS))
def test_a_planted_bug_fails_the_float32_check_by_its_gradients(plant, kind):
    plant(kind)
    r = verify.parity(MESH, verify.DENSE, steps=2)
    assert not r.passed
    assert r.errors["gradients"] > 100 * tolerance(jnp.float32)[0], r.errors


def test_a_doubled_gain_fails_the_bf16_check_by_its_length(plant):
    """The former bf16 check missed it: AdamW's update hides it (it divides a gradient by
    its own scale), the global norm moves by 0.1 %, under bf16's 1e-2; the leaf's length is
    off by 9 % (bf16's rounding: at most 0.9 %). The same mesh with nothing planted passes
    (tests/train/test_bf16.py)."""
    plant("one leaf's gradient doubled")
    r = verify.mixed_parity(dataclasses.replace(MESH, microbatches=1), verify.DENSE, steps=2)
    assert not r.passed
    assert r.errors["grad norms"] <= verify.MIXED_BOUNDS["grad norms"], r.errors
    assert r.errors["gradient scales"] > 2 * verify.MIXED_BOUNDS["gradient scales"], r.errors
