"""The trainer on uneven pipeline stages (`ParallelSpec(layers_per_stage=...)`).

* parity with the unsharded model, step by step (losses, gradient norms, final weights,
  `verify.parity`, which also checks every collective of the compiled step against the
  formulas, the layer collectives counted per real layer): pp4 with stages of 1, 2, 2
  and 1 layers, dp2 x pp2 x tp2 with ZeRO-1 and stages of 1 and 3 layers, and pp2 x tp2
  interleaved with two chunks of 1 and 3 layers on each device, dp2 x pp2 x tp2 with
  ZeRO-3 and recompute, stages of 2 and 1 layers, and pp2 x cp2 x tp2 with recompute,
  stages of 1 and 2;
* the state's padding: the padded layers stay zero and `canonical` returns [L, ...];
* what uneven stages are refused with (pp=1) and counts that do not fit, each a
  ConfigError naming the fix.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.train import verify
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

SIX = dataclasses.replace(verify.DENSE, n_layers=6)


# chunks, SP, MoE and the other schedules with uneven stages: tests/train/test_drawn.py draws them
# (its pipeline family draws interleaved on pp3 x tp2 with SP, 1/1/2/1/1/1, among its five)
@pytest.mark.parametrize("spec, cfg", [
    (ParallelSpec(pp=4, microbatches=4, layers_per_stage=(1, 2, 2, 1)), SIX),
    (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2, zero=1, layers_per_stage=(1, 3)), verify.DENSE),
    # ZeRO-3 and recompute with collectives inside the stages: a one-layer stage among
    # deeper ones is scanned like them (padded), so the count keeps its output's collectives
    (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2, zero=3, recompute="full", layers_per_stage=(2, 1)),
     dataclasses.replace(verify.DENSE, n_layers=3)),
    (ParallelSpec(pp=2, cp=2, tp=2, microbatches=2, recompute="full", layout="zigzag", layers_per_stage=(1, 2)),
     dataclasses.replace(verify.DENSE, n_layers=3)),
], ids=["pp4-1221", "dp2-pp2-tp2-zero1-13", "dp2-pp2-tp2-zero3-recompute-21", "pp2-cp2-tp2-recompute-12"])
def test_uneven_stages_train_like_the_unsharded_model(spec, cfg):
    r = verify.parity(spec, cfg, steps=3)
    assert r.passed, (r.errors, r.measured, r.expected)


def test_the_padding_stays_zero_and_is_not_returned():
    spec = ParallelSpec(pp=4, microbatches=4, layers_per_stage=(1, 2, 2, 1))
    trainer = Trainer(SIX, spec, verify.OPTIM, batch_size=8, seq_len=16, devices=jax.devices()[:4])
    state = trainer.init()
    state, _ = trainer.step(state, np.zeros((8, 17), np.int32) + np.arange(17) % SIX.vocab)
    blocks = jax.device_get(state.params["blocks"])
    for leaf in jax.tree.leaves(blocks):
        assert leaf.shape[:3] == (4, 1, 2)
        assert not np.any(leaf[0, 0, 1]) and not np.any(leaf[3, 0, 1])     # stages 0 and 3: one layer, one padding
    params = trainer.canonical(state)[0]
    assert all(a.shape[0] == 6 for a in jax.tree.leaves(params["blocks"]))
    assert "layers 1/2/2/1" in spec.describe()


@pytest.mark.parametrize("options, piece", [
    (dict(dp=2, layers_per_stage=(1, 3)), "with pp=1"),
    (dict(pp=2, layers_per_stage="1,3"), "must be None or a tuple"),
])
def test_what_uneven_stages_are_refused_with(options, piece):
    with pytest.raises(ConfigError, match=r"layers_per_stage") as e:
        spec = ParallelSpec(**options)
        spec.check(verify.DENSE, batch_size=8, seq_len=16)
    assert piece in str(e.value)


@pytest.mark.parametrize("counts, piece", [
    ((1, 2), "sums to 3, the model has 4 layers"),
    ((1, 1, 2), "has 3 entries for 2 model stages"),
])
def test_counts_that_do_not_fit_the_model_are_listed(counts, piece):
    with pytest.raises(ConfigError, match="does not fit the model") as e:
        ParallelSpec(pp=2, microbatches=2, layers_per_stage=counts).check(verify.DENSE, batch_size=8, seq_len=16)
    assert piece in str(e.value)


def test_even_counts_are_the_even_spec_and_indivisible_layers_suggest_a_split():
    ParallelSpec(pp=2, microbatches=2, layers_per_stage=(2, 2)).check(verify.DENSE, batch_size=8, seq_len=16)
    with pytest.raises(ConfigError, match=r"or give layers_per_stage, e\.g\. \(1, 2, 2, 1\)"):
        ParallelSpec(pp=4, microbatches=4).check(SIX, batch_size=8, seq_len=16)
