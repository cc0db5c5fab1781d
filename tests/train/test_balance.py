"""MoE load balancing in training: the balance loss and DeepSeek-V3's bias, on many
meshes, equal the unsharded model computing the same terms (jaxpar/reference/)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import comms, reference
from jaxpar.errors import ConfigError
from jaxpar.expert import formulas, router
from jaxpar.pipeline import direct
from jaxpar.train import recipe, verify
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer
from jaxpar.train.unsharded import reference_trainer

MOE = reference.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32, rope_theta=10000.0, n_experts=4, top_k=2)
AUX = dataclasses.replace(MOE, aux_loss=0.1, n_layers=4)                       # Switch/GShard, softmax
BIAS = dataclasses.replace(MOE, router="sigmoid", bias_rate=0.01)             # DeepSeek-V3, no loss
BOTH = dataclasses.replace(BIAS, aux_loss=0.1)                                 # DeepSeek-V3 with its sequence loss
OPTIM = OptimConfig(lr=1e-2, warmup=2, steps=20, clip=0.5)
STEPS, BATCH, SEQ = 3, 8, 16

# every axis, TP with and without SP, ring (contiguous, zigzag) and Ulysses, ZeRO-1,
# recompute, and the schedules 1F1B, interleaved and ZB-H1 (its W passes)
MESHES = {
    "dp2 pp2 tp2 1f1b": (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2), BOTH),
    "pp2 cp2 tp2 sp zigzag recompute": (ParallelSpec(pp=2, cp=2, tp=2, microbatches=2, sequence_parallel=True,
                                                     layout="zigzag", recompute="full"), BOTH),
    "dp2 cp2 ep2 ulysses zero1": (ParallelSpec(dp=2, cp=2, ep=2, attention="ulysses", zero=1), BOTH),
    "pp2 interleaved tp2": (ParallelSpec(pp=2, tp=2, schedule="interleaved", microbatches=4), AUX),
    "pp2 ep2 tp2 sp zb-h1": (ParallelSpec(pp=2, ep=2, tp=2, sequence_parallel=True, schedule="zb-h1",
                                          microbatches=2), BIAS),
    # SP over one tp device splits nothing: left off (it failed to trace with balancing on)
    "ep2 sp at tp1": (ParallelSpec(ep=2, sequence_parallel=True), BOTH),
}


def trained(cache, spec, cfg, steps=STEPS) -> tuple[dict, Trainer]:
    """(the params after `steps` steps on `spec`, the trainer): verify.parity's step, from
    `cache`."""
    trainer = cache(cfg, spec, OPTIM, batch_size=BATCH, seq_len=SEQ, devices=jax.devices()[:spec.devices])
    corpus, state = Corpus(vocab=cfg.vocab), trainer.init(jax.random.key(0))
    for i in range(steps):
        state, _ = trainer.step(state, corpus.batch(i, batch_size=BATCH, seq_len=SEQ))
    return jax.device_get(trainer.canonical(state)[0]), trainer


@pytest.mark.parametrize("name", list(MESHES))
def test_balancing_on_a_mesh_equals_the_unsharded_model(name, trainer_cache):
    """Each step at the same weights (the loss with its balance term, the gradients, the
    update, the router bias moved by the same load) and the run's losses and norms
    (`verify.parity`), to the float32 rule."""
    spec, cfg = MESHES[name]
    r = verify.parity(spec, cfg, steps=STEPS, batch_size=BATCH, seq_len=SEQ, optim=OPTIM, trainers=trainer_cache)
    assert r.passed, r.errors
    params, trainer = trained(trainer_cache, spec, cfg)
    if cfg.bias_rate:   # the bias moved, by whole steps of bias_rate
        bias = params["blocks"]["router_bias"]
        assert np.abs(bias).max() > 0
        np.testing.assert_allclose(bias / cfg.bias_rate, np.round(bias / cfg.bias_rate), atol=1e-4)
    if spec.cp > 1 and spec.tp == 1 and cfg.aux_loss:
        _check_the_cp_all_reduce(trainer, cfg)


def test_balancing_in_float64_equals_the_unsharded_model(x64):
    r = verify.parity(ParallelSpec(cp=2, tp=2, sequence_parallel=True), BOTH, steps=STEPS, batch_size=BATCH,
                      seq_len=SEQ, optim=OPTIM, dtype=jnp.float64)
    assert r.passed and r.tolerance[0] == 1e-12, r.errors


def _check_the_cp_all_reduce(trainer, cfg):
    """Inside the layers only the balance loss's all-reduce over cp runs (no tp here):
    per layer per F, formulas.balance_collectives."""
    spec, plan = trainer.spec, trainer.local.plan
    ops = comms.resolve(comms.collective_ops_from_hlo(trainer.compiled.as_text()), plan.runs())
    rows = BATCH // (spec.dp * spec.ep * spec.microbatches)
    f = formulas.balance_collectives(cfg=cfg, batch_size=rows, seq_len=SEQ, dtype=jnp.float32, cp=spec.cp)
    if spec.pp == 1:    # the one-stage program: every layer's in one value_and_grad (XLA may merge them)
        mine = [o for o in ops if o.kind == "all-reduce" and o.group_size == spec.cp and direct.SCOPE in o.scope]
        assert sum(o.bytes * o.executions for o in mine) == cfg.n_layers * spec.microbatches * f["all-reduce"][1]
    else:
        mine = [o for o in ops if o.kind == "all-reduce" and o.group_size == spec.cp and "/while/" in o.scope
                and o.conditional]
        assert len(mine) == 1 and mine[0].bytes == f["all-reduce"][1]
    assert formulas.balance_collectives(cfg=cfg, batch_size=rows, seq_len=SEQ, dtype=jnp.float32, cp=spec.cp,
                                        backward=True) == {}


# ---- the terms, by hand -----------------------------------------------------------------------

def test_the_balance_loss_is_1_balanced_and_grows_unbalanced():
    E, k = 4, 1
    chosen = lambda experts: jax.nn.one_hot(jnp.asarray(experts)[None], E)            # [1, T, E]
    uniform = jnp.full((1, 4, E), 0.25)
    assert float(reference.balance_loss(uniform, chosen([0, 1, 2, 3]), top_k=k)[0]) == pytest.approx(1.0)
    # confident routers (P = f): E * sum f^2 = 1 balanced, 2 on two experts, E collapsed
    for experts, want in (([0, 1, 2, 3], 1.0), ([0, 0, 1, 1], 2.0), ([0, 0, 0, 0], 4.0)):
        c = chosen(experts)
        assert float(reference.balance_loss(c, c, top_k=k)[0]) == pytest.approx(want)
    hot = jnp.tile(jnp.asarray([0.7, 0.1, 0.1, 0.1]), (1, 4, 1))                     # all on expert 0
    assert float(reference.balance_loss(hot, chosen([0, 0, 0, 0]), top_k=k)[0]) == pytest.approx(4 * 0.7)
    # sigmoid scores are normalised first: equal scores are balanced, whatever their size
    assert float(reference.balance_loss(jnp.full((1, 4, E), 0.9), chosen([0, 1, 2, 3]), top_k=k,
                                        scoring="sigmoid")[0]) == pytest.approx(1.0)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_the_router_halves_equal_the_reference_per_sequence(scoring):
    w = jax.random.normal(jax.random.key(0), (16, 8)) / 4
    x = jax.random.normal(jax.random.key(1), (3, 10, 16))                             # 3 sequences of 10
    _, chosen, scores = reference.router_choice(w, x, top_k=2, scoring=scoring)
    want = reference.balance_loss(scores, chosen, top_k=2, scoring=scoring)
    r = router.route(w, x.reshape(30, 16), top_k=2, scoring=scoring)
    counts, prob_sums = router.sequence_sums(r, sequences=3, scoring=scoring)
    halves = [router.sequence_sums(router.route(w, x[:, h].reshape(15, 16), top_k=2, scoring=scoring), sequences=3,
                                   scoring=scoring) for h in (slice(0, 5), slice(5, 10))]   # split as over cp=2
    np.testing.assert_allclose(router.sequence_balance_loss(counts, prob_sums, tokens=10, top_k=2), want, rtol=1e-6)
    summed = [a + b for a, b in zip(*halves)]
    np.testing.assert_allclose(router.sequence_balance_loss(*summed, tokens=10, top_k=2), want, rtol=1e-6)


def test_the_loss_adds_alpha_times_the_balance_loss_summed_over_layers():
    cfg = dataclasses.replace(AUX, n_layers=2)

    @jax.jit
    def terms(params, tokens):
        cross_entropy = reference.cross_entropy(reference.forward(params, tokens[:, :-1], cfg), tokens[:, 1:])
        return cross_entropy, *reference.loss_and_balance(params, tokens, cfg)
    tokens = jnp.asarray(Corpus(vocab=cfg.vocab).batch(0, batch_size=4, seq_len=8))
    cross_entropy, total, balance = terms(reference.init_params(jax.random.key(0), cfg), tokens)
    assert balance["aux"].shape == (2, 4) and balance["load"].shape == (2, cfg.n_experts)
    assert float(total - cross_entropy) == pytest.approx(0.1 * float(balance["aux"].mean(axis=1).sum()), rel=1e-5)
    assert 1 < float(balance["aux"].min()) < cfg.n_experts
    np.testing.assert_array_equal(balance["load"].sum(axis=1), 4 * 8 * cfg.top_k)   # every token-slot counted once


def test_the_bias_moves_toward_the_underloaded_experts():
    load = jnp.asarray([[6.0, 2.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])                 # per layer; means 2 and 1
    np.testing.assert_allclose(router.update_bias(jnp.zeros((2, 4)), load, rate=0.5),
                               [[-0.5, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    # a bias that sends every token to expert 0: after one step of the trainer's rule
    # expert 0's bias falls by bias_rate, and the underloaded experts' rise by it
    cfg = BIAS
    params = reference.init_params(jax.random.key(0), cfg)
    params["blocks"]["router_bias"] = params["blocks"]["router_bias"].at[:, 0].set(2.0)
    tokens = jnp.asarray(Corpus(vocab=cfg.vocab).batch(0, batch_size=BATCH, seq_len=SEQ))
    tx, step = reference_trainer(cfg, OPTIM)
    new = step(params, tx.init(params), tokens)[0]["blocks"]["router_bias"]
    # the load the rule read: expert 0 took every token's first slot
    hot = jax.jit(lambda p, t: reference.loss_and_balance(p, t, cfg)[1]["load"])(params, tokens)
    np.testing.assert_array_equal(hot[:, 0], BATCH * SEQ)
    under = hot < hot.mean(axis=1, keepdims=True)
    assert under.sum() >= 2
    np.testing.assert_allclose(new[:, 0], 2.0 - cfg.bias_rate)
    np.testing.assert_allclose(new[under], cfg.bias_rate)


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(aux_loss=-0.1), r"aux_loss=-0.1: give a finite number >= 0"),
    (dict(aux_loss=float("nan")), "aux_loss=nan"),
    (dict(aux_loss=True), "aux_loss=True"),
    (dict(bias_rate=float("inf"), router="sigmoid"), "bias_rate=inf"),
    (dict(bias_rate=0.001), r"bias_rate=0.001 with router='softmax'.*Fix: router='sigmoid'"),
    (dict(router="topk"), "router='topk'"),
    (dict(router="sigmoid", moe_renormalize=False), "moe_renormalize=False.*Fix: moe_renormalize=True"),
    (dict(n_experts=0, aux_loss=0.01), r"^aux_loss=0.01 on a dense model \(n_experts=0\).*Fix: .*n_experts=8"),
    (dict(n_experts=0, router="sigmoid", bias_rate=1e-3), "dense model"),
])
def test_bad_balancing_configs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(MOE, **kwargs)


def test_bad_balancing_requests_are_refused():
    with pytest.raises(ConfigError, match="selection bias .* goes with the sigmoid router"):
        reference.router_choice(jnp.zeros((16, 4)), jnp.zeros((2, 16)), top_k=2, bias=jnp.zeros(4))
    with pytest.raises(ConfigError, match="aux_loss=0.1.*batch_size="):
        recipe.compose(AUX, ParallelSpec(), seq_len=SEQ)
    with pytest.raises(ConfigError, match="seq_len=15 is not divisible by cp=2"):
        formulas.balance_collectives(cfg=AUX, batch_size=2, seq_len=15, dtype=jnp.float32, cp=2)
    with pytest.raises(ConfigError, match="layers=0"):
        formulas.balance_reduction(cfg=AUX, layers=0, dtype=jnp.float32)


def test_the_formulas_by_hand():
    f32 = jnp.float32
    assert formulas.balance_collectives(cfg=AUX, batch_size=2, seq_len=16, dtype=f32, cp=2) == {
        "all-reduce": (1, 2 * 2 * 4 * 4)}                                             # [2, 2E] float32
    assert formulas.balance_collectives(cfg=BIAS, batch_size=2, seq_len=16, dtype=f32, cp=2) == {}
    assert formulas.balance_collectives(cfg=AUX, batch_size=2, seq_len=16, dtype=f32, cp=1) == {}
    assert formulas.balance_reduction(cfg=BIAS, layers=2, dtype=f32, dp=2, tp=2) == {4: 2 * 5 * 4}
    assert formulas.balance_reduction(cfg=BIAS, layers=2, dtype=jnp.float64, cp=2) == {2: 2 * 5 * 8}
    assert formulas.balance_reduction(cfg=MOE, layers=2, dtype=f32, dp=2) == {}
