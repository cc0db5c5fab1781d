"""The composed model trained on many meshes equals the unsharded model, step by step."""

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.train import model, nnx_model, verify
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec, parse
from jaxpar.train.step import Trainer


@pytest.mark.parametrize("name", list(verify.MESHES))
def test_ten_steps_equal_the_unsharded_model(name):
    """Each step at the same weights, and the run's losses and norms (`verify.parity`;
    `jaxpar verify train` runs 20 steps; docs/train.md has the figures of 20)."""
    spec, cfg, batch = verify.MESHES[name]
    r = verify.parity(spec, cfg, steps=10, batch_size=batch)
    assert r.passed, r.errors
    assert set(r.errors) >= {"losses", "grad norms", "step loss", "gradients", "updates"}
    norms = verify.reference_run(cfg, verify.OPTIM, 10, batch, 16)[1]
    assert (norms > verify.OPTIM.clip).sum() >= 5          # the global-norm clip is exercised


def test_parity_in_float64(x64):
    spec = ParallelSpec(dp=2, pp=2, tp=2, cp=1, microbatches=2, sequence_parallel=True, zero=1)
    r = verify.parity(spec, verify.DENSE, steps=4, dtype=jnp.float64)
    assert max(r.errors.values()) <= 1e-12, r.errors


def test_the_loss_falls_towards_the_corpus_entropy():
    losses = verify.reference_run(verify.DENSE, verify.OPTIM, 20, 8, 16)[0]
    assert losses[-1] < 0.5 * losses[0]
    corpus = Corpus(vocab=verify.DENSE.vocab)
    assert corpus.entropy_rate() < losses[-1] < np.log(verify.DENSE.vocab)


def test_zero1_shards_the_optimizer_state_over_dp():
    spec = ParallelSpec(dp=4, tp=2, zero=1)
    t = Trainer(verify.DENSE, spec, verify.OPTIM, batch_size=8, seq_len=16)
    plain = Trainer(verify.DENSE, dataclasses.replace(spec, zero=0), verify.OPTIM, batch_size=8, seq_len=16)
    state, ref = t.init(), plain.init()
    mu, mu_ref = state.opt[0].mu, ref.opt[0].mu
    for a, b, p in zip(jax.tree.leaves(mu), jax.tree.leaves(mu_ref), jax.tree.leaves(state.params)):
        chex.assert_equal(a.shape, b.shape)                     # the same global shapes
        local, local_ref = a.addressable_shards[0].data.shape, b.addressable_shards[0].data.shape
        assert np.prod(local) * 4 == np.prod(local_ref), (local, local_ref)   # a dp-th of it per device
        assert p.addressable_shards[0].data.shape == local_ref  # the weights stay whole over dp
    memory = lambda tr: tr.compiled.memory_analysis().argument_size_in_bytes
    assert memory(t) < memory(plain)


def test_the_nnx_model_holds_the_reference_params_and_their_partitioning():
    """The NNX state is the reference's params, array for array, through nnx.split and
    nnx.merge; each Param's PartitionSpec is Megatron's layout with the layers over pp and
    the experts over ep, written out (MOE: K=2 heads split over tp=2)."""
    cfg = verify.MOE
    params = reference.init_params(jax.random.key(3), cfg)
    graphdef, state = nnx.split(nnx_model.LanguageModel(cfg, params=params))
    flat = {tuple(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}
    want = {("embed",): params["embed"], ("final_norm",): params["final_norm"], ("unembed",): params["unembed"]} | {
        ("blocks", k): a for k, a in params["blocks"].items()}
    assert set(flat) == set(want)
    for path, a in want.items():
        np.testing.assert_array_equal(flat[path][...], a)
    merged = nnx.merge(graphdef, state)
    chex.assert_trees_all_equal(merged.params(), params)
    pspecs = nnx.get_partition_spec(state)
    tp_cols, tp_rows = P("pp", None, "tp", None), P("pp", "tp", None, None)
    expected = {"embed": P("tp", None), "final_norm": P(None), "unembed": P(None, "tp"),
                "blocks": {"attn_norm": P("pp", None), "mlp_norm": P("pp", None),
                           "wq": tp_cols, "wk": tp_cols, "wv": tp_cols, "wo": tp_rows,   # [L, D, N|K, H], [L, N, H, D]
                           "router": P("pp", None, None),                                # [L, D, E] replicated
                           "w_up": P("pp", "ep", None, "tp"), "w_gate": P("pp", "ep", None, "tp"),  # [L, E, D, F]
                           "w_down": P("pp", "ep", "tp", None)}}                          # [L, E, F, D]
    got = {k: v.get_value() for k, v in pspecs.items() if k != "blocks"} | {
        "blocks": {k: v.get_value() for k, v in pspecs["blocks"].items()}}
    assert got == expected
    assert got == model.weight_pspecs(cfg, 2)          # the NNX view's metadata is the trainer's layout


def test_the_trainer_reads_its_specs_from_the_models_partition_names():
    """model.stage_pspecs: partition_names split by stage, the layers' pp dimension dropped, axes
    of one device left out (MOE on ep2 x tp2: K=2 heads split; tp1: nothing over tp)."""
    cfg = verify.MOE
    layer, first, last = model.stage_pspecs(cfg, ParallelSpec(ep=2, tp=2))
    assert layer == {"attn_norm": P(None), "mlp_norm": P(None), "wq": P(None, "tp", None), "wk": P(None, "tp", None),
                     "wv": P(None, "tp", None), "wo": P("tp", None, None), "router": P(None, None),
                     "w_up": P("ep", None, "tp"), "w_gate": P("ep", None, "tp"), "w_down": P("ep", "tp", None)}
    assert first == {"embed": P("tp", None)} and last == {"final_norm": P(None), "unembed": P(None, "tp")}
    layer, first, _ = model.stage_pspecs(cfg, ParallelSpec(pp=2, ep=2))
    assert layer["w_down"] == P("ep", None, None) and layer["wq"] == P(None, None, None)
    assert first == {"embed": P(None, None)}
    pspecs = model.weight_pspecs(cfg, 2)
    assert model.join(model.split(pspecs)) == pspecs


def test_batches_are_a_function_of_the_step():
    c = Corpus(vocab=32, seed=1)
    np.testing.assert_array_equal(c.batch(5, batch_size=4, seq_len=8), Corpus(vocab=32, seed=1).batch(
        5, batch_size=4, seq_len=8))
    assert not np.array_equal(c.batch(5, batch_size=4, seq_len=8), c.batch(6, batch_size=4, seq_len=8))
    b = c.batch(0, batch_size=64, seq_len=32)
    succ = c.table[0]
    assert all(b[r, t + 1] in succ[b[r, t]] for r in range(64) for t in range(32))


# ---- bad input ------------------------------------------------------------------------------

def test_every_violated_constraint_is_listed():
    cfg = dataclasses.replace(verify.DENSE, n_layers=6, n_heads=6, n_kv_heads=3, vocab=30)
    spec = ParallelSpec(dp=2, pp=4, tp=4, ep=2, microbatches=3, cp=2, layout="zigzag")
    with pytest.raises(ConfigError) as e:
        Trainer(cfg, spec, verify.OPTIM, batch_size=10, seq_len=6)
    text = str(e.value)
    for piece in ("n_layers=6", "n_heads=6", "vocab=30", "n_kv_heads=3", "ep=2 but the model is dense",
                  "batch_size=10", "seq_len=6", "devices", "problems"):
        assert piece in text, (piece, text)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dp=0), "dp=0"), (dict(tp=2.0), "tp=2.0"), (dict(zero=4), "zero=4"), (dict(schedule="nope"), "schedule"),
    (dict(attention="flash"), "attention"), (dict(layout="spiral"), "layout"), (dict(recompute=1), "recompute"),
    (dict(recompute="all"), "recompute='all'"), (dict(recompute="DOTS"), "recompute"),
    (dict(microbatches=True), "microbatches"), (dict(dp=1 << 20), "dp="),
])
def test_bad_specs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelSpec(**kwargs)


@pytest.mark.parametrize("text", ["", "dp=2,,", "xp=2", "dp=two", "dp=2,dp=2", "dp:2"])
def test_bad_mesh_strings_are_refused(text):
    with pytest.raises(ConfigError, match="--mesh"):
        parse(text)


def test_bad_batches_are_refused():
    t = Trainer(verify.DENSE, ParallelSpec(), verify.OPTIM, batch_size=2, seq_len=4, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="int"):
        t.put(np.zeros((2, 5), np.float32))
    with pytest.raises(ConfigError, match="batch_size=2"):
        t.put(np.zeros((3, 5), np.int32))
    with pytest.raises(ConfigError, match="vocab"):
        t.put(np.full((2, 5), 99, np.int32))
    with pytest.raises(ConfigError):
        OptimConfig(warmup=30, steps=20)
    with pytest.raises(ConfigError, match="devices='cpu' is not a list of devices"):
        Trainer(verify.DENSE, ParallelSpec(), verify.OPTIM, batch_size=2, seq_len=4, devices="cpu")
    with pytest.raises(ConfigError, match="aux_loss=1e.300 is not finite in float32"):
        ParallelSpec().check(dataclasses.replace(verify.MOE, aux_loss=1e300), batch_size=2, seq_len=4)


def test_a_donated_or_foreign_state_is_refused_before_the_step():
    """The step donates its state: passing it again was a segfault in XLA's runtime; None,
    {} or another trainer's layout a TypeError from the compiled call."""
    t = Trainer(verify.DENSE, ParallelSpec(dp=2), verify.OPTIM, batch_size=2, seq_len=4, devices=jax.devices()[:2])
    tokens = np.zeros((2, 5), np.int32)
    for bad in (None, {}, t.init().params):
        with pytest.raises(ConfigError, match="is not this trainer's TrainState"):
            t.step(bad, tokens)
    state = t.init()
    new, _ = t.step(state, tokens)
    with pytest.raises(ConfigError, match="the state was donated to the previous step; pass the state that step "
                                          "returned"):
        t.step(state, tokens)
    assert int(t.step(new, tokens)[0].step) == 2


def test_options_with_nothing_to_do_on_the_mesh_are_named():
    """Accepted (each runs as the spec without it) and said in the run's summary."""
    assert ParallelSpec(dp=2, tp=2, sequence_parallel=True, zero=1).ignored() == []
    found = ParallelSpec(sequence_parallel=True, layout="zigzag", attention="ulysses", schedule="interleaved",
                         zero=1).ignored()
    assert [line.split(" with ")[0] for line in found] == [
        "sequence_parallel=True", "attention='ulysses' and layout='zigzag'", "schedule='interleaved'", "zero=1"]
    assert "sp" not in ParallelSpec(sequence_parallel=True).describe()


# spec, cfg, the tokens' pspec, the rows each device holds of a batch of 8
SPLIT_BY_ROWS = {
    "dp2 tp2": (ParallelSpec(dp=2, tp=2), verify.DENSE, P("dp"), 4),
    "dp2 ep2 tp2": (*verify.MESHES["dp2 ep2 tp2"][:2], P(("dp", "ep")), 2),
    "dp2 cp2 tp2 zigzag": (ParallelSpec(dp=2, cp=2, tp=2, layout="zigzag"), verify.DENSE, P("dp"), 4),
    "pp2 tp2 cp2 (no batch axis)": (*verify.MESHES["pp2 tp2 cp2"][:2], P(), 8),
}
# a collective's result types in the compiled program's text
_COLLECTIVE = re.compile(r"= ([^=]*?) (?:all-gather|all-to-all|collective-permute|all-reduce|reduce-scatter)"
                         r"(?:-start)?\(")


@pytest.mark.parametrize("name", list(SPLIT_BY_ROWS))
def test_the_batch_enters_the_step_split_by_rows(name):
    """tokens int[B, T+1] split by rows over the batch axes (dp, ep), each sequence whole
    (cp cuts it inside the step): `put` gives each device only its rows, the compiled step
    takes them so, and none of its collectives moves token ids (the batch is not gathered
    to be split again)."""
    spec, cfg, pspec, rows = SPLIT_BY_ROWS[name]
    seq = 16
    t = Trainer(cfg, spec, verify.OPTIM, batch_size=8, seq_len=seq, devices=jax.devices()[:spec.devices])
    assert t.token_sharding == NamedSharding(t.mesh, pspec)
    tokens = t.put(Corpus(vocab=cfg.vocab).batch(0, batch_size=8, seq_len=seq))
    assert tokens.sharding == t.token_sharding
    assert {shard.data.shape for shard in tokens.addressable_shards} == {(rows, seq + 1)}
    assert t.compiled.input_shardings[0][1].is_equivalent_to(t.token_sharding, 2)
    moved = [tuple(int(d) for d in dims.split(",")) for result in _COLLECTIVE.findall(t.compiled.as_text())
             for dims in re.findall(r"s32\[([\d,]+)\]", result)]
    assert not [s for s in moved if len(s) == 2 and s[1] in (seq, seq + 1)], moved


@pytest.mark.parametrize("kw, match", [
    (dict(lr=0), "lr=0: must be > 0; give 0 < lr"), (dict(lr=float("inf")), "lr=inf: must be finite"),
    (dict(b1=1.0), "b1=1.0: give 0 <= b < 1"), (dict(b2=-0.1), "b2=-0.1: must be >= 0"),
    (dict(clip=float("nan")), "clip=nan is not a real number"), (dict(weight_decay=True), "weight_decay=True"),
    (dict(lr=1e300), "lr=1e.300 is not finite in float32"), (dict(eps=1e39), "eps=1e.39 is not finite in float32"),
])
def test_optimizer_settings_outside_their_range_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        OptimConfig(**kw)


def test_the_optimizer_takes_the_zeros_its_docstring_gives():
    """clip=0 (no clipping), no weight decay, b1=0 (no momentum), decay to 0."""
    optim = OptimConfig(clip=0, weight_decay=0.0, b1=0, final_ratio=0)
    assert (optim.clip, optim.weight_decay, optim.b1, optim.final_ratio) == (0, 0.0, 0, 0)


@settings(max_examples=60, deadline=None)
@given(dp=st.sampled_from([1, 2, 3, 4]), pp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2, 3, 4, 8]),
       cp=st.sampled_from([1, 2, 4]), m=st.integers(1, 8), layers=st.integers(1, 12), heads=st.sampled_from([2, 4, 6, 8]),
       batch=st.integers(1, 48), seq=st.integers(1, 64), sp=st.booleans())
def test_problems_are_exactly_the_divisibility_rules(dp, pp, tp, cp, m, layers, heads, batch, seq, sp):
    # vocab 40 fails tp = 3 and d_ff 36 tp = 8 (48 would fail neither): the two rules are told apart
    cfg = reference.ModelConfig(n_layers=layers, n_heads=heads, n_kv_heads=2, head_dim=4, d_model=16, d_ff=36,
                                vocab=40)
    spec = ParallelSpec(dp=dp, pp=pp, tp=tp, cp=cp, microbatches=m, sequence_parallel=sp, schedule="gpipe")
    got = spec.problems(cfg, batch_size=batch, seq_len=seq)
    # each rule, and how its message begins (the value that breaks it)
    rules = {"n_layers=": layers % pp, "n_heads=": heads % tp, "vocab=": 40 % tp, "d_ff=": 36 % tp,
             "n_kv_heads=": 2 % tp and tp % 2, "batch_size=": batch % (dp * m),
             "seq_len=": seq % (cp * (tp if sp else 1))}
    named = [[r for r in rules if msg.startswith(r)] for msg in got]
    assert all(len(n) == 1 for n in named), got
    assert sorted(n[0] for n in named) == sorted(r for r, broken in rules.items() if broken), got


SCHEDULES = [OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5), OptimConfig(), OptimConfig(lr=0.7, warmup=0, steps=9),
             OptimConfig(lr=1e-3, warmup=5, steps=5, final_ratio=0.25)]


def _optax_schedule(cfg):
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup,
                                              decay_steps=max(cfg.steps, cfg.warmup + 1),
                                              end_value=cfg.lr * cfg.final_ratio)


@pytest.mark.parametrize("cfg", SCHEDULES, ids=str)
def test_the_learning_rate_is_optaxs_bit_for_bit_in_float32(cfg):
    counts = jnp.arange(cfg.steps + 10, dtype=jnp.int32)
    ours, theirs = jax.jit(jax.vmap(cfg.schedule()))(counts), jax.jit(jax.vmap(_optax_schedule(cfg)))(counts)
    assert ours.dtype == theirs.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("cfg", SCHEDULES, ids=str)
def test_the_learning_rate_is_float64_under_x64(x64, cfg):
    """optax's warm-up is float32 even under x64; ours is the same rule in float64."""
    counts = np.arange(cfg.steps + 10)
    ours = np.asarray(jax.jit(jax.vmap(cfg.schedule()))(jnp.asarray(counts, jnp.int32)))
    assert ours.dtype == np.float64
    warm = cfg.lr * np.minimum(counts, cfg.warmup) / max(cfg.warmup, 1)
    decay = max(cfg.steps, cfg.warmup + 1) - cfg.warmup
    cosine = 0.5 * (1 + np.cos(np.pi * np.minimum(counts - cfg.warmup, decay) / decay))
    decayed = cfg.lr * ((1 - cfg.final_ratio) * cosine + cfg.final_ratio)
    np.testing.assert_allclose(ours, np.where(counts < cfg.warmup, warm, decayed), rtol=1e-14, atol=1e-18)


def test_recompute_speaks_the_glossary_and_reads_the_bools_it_replaced():
    """"none", "full", "dots" (the words of the memory model and the command line); True and
    False, the words before them, read as "full" and "none"."""
    assert ParallelSpec(recompute=True) == ParallelSpec(recompute="full")          # a retired word, on purpose
    assert ParallelSpec(recompute=False).recompute == ParallelSpec().recompute == "none"   # a retired word, on purpose
    assert ParallelSpec(recompute="dots", pp=2).describe() == "pp2 1f1b recompute dots"
