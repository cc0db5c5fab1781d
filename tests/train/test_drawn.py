"""Every composition the trainer accepts trains like the unsharded model: configurations
drawn from everything `ParallelSpec.problems()` accepts (tests/train/drawn.py), 3 steps
each against the unsharded model (`verify.parity`: each step's loss, norm, gradients and
update at the same weights, and the run's losses and norms, to the float32 rule), and the
step's collectives equal to the formulas (the pipeline's sends, every stage collective on
every pp rank, the gradient reduction, norm, loss and ZeRO).

Four named compositions of three or four techniques each run every time (`NAMED`); then
five families of two draws in `make test` (a fixed seed per family: the same 10 every
run, one compiled step each, most of two or three axes above 1); JAXPAR_DRAWN=N draws N
per family instead, with a fresh seed unless JAXPAR_DRAWN_SEED is set, and
JAXPAR_DRAWN_LOG=FILE appends a line per example (hundreds: docs/train.md gives the
command and the last run)."""

import os
import time

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from jaxpar import reference
from jaxpar.testing import tolerance
from jaxpar.train import summary, verify
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.cache import TrainerCache
from tests.train.drawn import FAMILIES, Drawn, configurations

EXAMPLES = int(os.environ.get("JAXPAR_DRAWN", "2"))
SEED = int(os.environ["JAXPAR_DRAWN_SEED"]) if "JAXPAR_DRAWN_SEED" in os.environ else (
    None if "JAXPAR_DRAWN" in os.environ else 0)
OPTIM = OptimConfig(lr=1e-2, warmup=1, steps=3, clip=0.5)
LOG = os.environ.get("JAXPAR_DRAWN_LOG")     # a file: one line per example (seconds, case, errors)

_MODEL = dict(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=16, vocab=16, mlp="swiglu", rope_theta=1e4)
NAMED = {
    "dp2 pp2 tp2, zb-h1 (split backward), SP, recompute dots": Drawn(
        reference.ModelConfig(n_layers=4, **_MODEL),
        ParallelSpec(dp=2, pp=2, tp=2, schedule="zb-h1", microbatches=4, sequence_parallel=True, recompute="dots"),
        8, 8),
    "pp2 cp2 ep2, Ulysses, zigzag, MoE with the balance loss": Drawn(
        reference.ModelConfig(n_layers=4, **_MODEL, n_experts=4, top_k=2, aux_loss=0.01),
        ParallelSpec(pp=2, cp=2, ep=2, microbatches=2, attention="ulysses", layout="zigzag"), 8, 8),
    "dp2 tp2 cp2, ZeRO-3, ring, SP": Drawn(
        reference.ModelConfig(n_layers=2, **{**_MODEL, "mlp": "gelu"}),
        ParallelSpec(dp=2, tp=2, cp=2, microbatches=2, zero=3, sequence_parallel=True), 4, 8),
    "dp2 pp4, uneven stages 1/2/2/1, ZeRO-1, one KV head": Drawn(
        reference.ModelConfig(n_layers=6, **{**_MODEL, "n_kv_heads": 1}),
        ParallelSpec(dp=2, pp=4, microbatches=4, zero=1, layers_per_stage=(1, 2, 2, 1)), 8, 8),
    # draws whose collectives were off by the router bias' zero gradient, all-reduced or folded by XLA as the
    # layer count and ZeRO-3's gather had it (at 2 layers reduced, at 1 folded): the step now zeroes it
    "dp4, ZeRO-3, 5 microbatches, MoE with DeepSeek-V3's router bias": Drawn(
        reference.ModelConfig(vocab=7, d_model=24, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8, n_layers=1,
                              mlp="gelu", n_experts=5, top_k=3, causal=False, router="sigmoid", bias_rate=0.01),
        ParallelSpec(dp=4, schedule="zb-h2", microbatches=5, zero=3, layout="zigzag"), 20, 2),
}


def _parity(drawn, cache, dtype=jnp.float32):
    return verify.parity(drawn.spec, drawn.cfg, steps=3, batch_size=drawn.batch_size, seq_len=drawn.seq_len,
                         optim=OPTIM, dtype=dtype, trainers=cache)


def _check(drawn):
    start = time.perf_counter()
    cache = TrainerCache()          # parity's Trainer, then its compiled step looked at
    r = _parity(drawn, cache)
    trainer = cache(drawn.cfg, drawn.spec, OPTIM, batch_size=drawn.batch_size, seq_len=drawn.seq_len,
                  devices=jax.devices()[:drawn.spec.devices])          # parity's, from the cache
    c = summary.collectives(trainer, trainer.compiled)
    assert summary.matches(c), (str(drawn), {k: c[k] for k in ("sends", "expected_sends", "stages",
                                                               "expected_stages", "reductions",
                                                               "expected_reductions", "zero", "expected_zero")})
    if max(r.errors.values()) > tolerance(jnp.float32)[0]:
        # Judged at the same weights each step, float32 rounding still decides one thing
        # discretely: top-k routing, for a token whose experts are nearly tied, picks another
        # expert when its router logits are summed in another order. Then the proof is the
        # same 3 steps in float64, to 1e-12.
        assert drawn.cfg.n_experts, (str(drawn), r.errors)
        with jax.enable_x64(True):
            r64 = _parity(drawn, cache, jnp.float64)
        assert max(r64.errors.values()) <= tolerance(jnp.float64)[0], (str(drawn), r64.errors)
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{time.perf_counter() - start:6.1f} s  {drawn}  {r.errors}\n")


@pytest.mark.parametrize("name", list(NAMED))
def test_named_compositions_train_like_the_unsharded_model(name):
    _check(NAMED[name])


def _test(family):
    # no shrinking: each example compiles a training step, and the drawn case is printed whole
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=False, database=None,
              phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(configurations(family))
    def test(drawn):
        _check(drawn)
    return test if SEED is None else seed(SEED + FAMILIES.index(family))(test)


@pytest.mark.parametrize("family", FAMILIES)
def test_drawn_configurations_train_like_the_unsharded_model(family):
    _test(family)()
