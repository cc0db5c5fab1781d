"""Megatron TP and SP blocks against reference.block (output, input gradient, every
parameter gradient), the collectives of their compiled forward and backward against
tensor.tp_block_collectives, the row-split counterexample, vocab-parallel embedding and
cross-entropy, and the errors for shapes that do not split."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from jaxpar import comms, reference, tensor, tensor_vocab
from jaxpar import mesh as mesh_lib
from jaxpar.tensor_checks import block_inputs, run_block
from jaxpar.testing import assert_close, max_abs_diff

B, T = 8, 8   # B divisible by dp up to 8, T by tp up to 8


def cfg_for(kv: int, mlp: str) -> reference.ModelConfig:
    return reference.ModelConfig(n_layers=1, n_heads=8, n_kv_heads=kv, mlp=mlp)


# (dp, tp, sequence_parallel, n_kv_heads, mlp): every tp in {1, 2, 4, 8}, TP and SP, GeLU
# and SwiGLU, MHA, GQA with KV heads split (K % tp == 0) and replicated (tp > K).
CASES = [
    (1, 8, False, 8, "gelu"),
    (1, 8, True, 2, "swiglu"),    # tp > K: replicated KV heads
    (2, 4, False, 8, "gelu"),
    (2, 4, True, 8, "gelu"),
    (2, 4, False, 2, "swiglu"),   # tp > K on a dp x tp mesh
    (4, 2, True, 4, "swiglu"),
    (8, 1, False, 8, "gelu"),
]


@functools.cache
def _run(dp, tp, sp, kv, mlp):
    """One compiled step per case, shared by the tests below (compiling dominates)."""
    return run_block(cfg_for(kv, mlp), mesh_lib.make_mesh(dp=dp, tp=tp), sequence_parallel=sp, batch=B, seq=T)


@pytest.mark.parametrize("dp,tp,sp,kv,mlp", CASES, ids=lambda v: str(v))
def test_block_matches_reference_and_formula(dp, tp, sp, kv, mlp):
    run = _run(dp, tp, sp, kv, mlp)
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward
    if dp > 1 and kv % tp:
        # documented in tp_block_collectives: XLA chooses how to group the dp all-reduce
        # of the wk/wv slices; the bytes are the contract.
        assert {k: b for k, (_, b) in run.backward.items()} == {k: b for k, (_, b) in run.formula_backward.items()}
    else:
        assert run.backward == run.formula_backward


def test_block_lecture_formula_counts():
    """Lecture 3.4: 2 all-reduces of b*s*h forward, 2 backward (TP); SP: the same bytes as
    all-gathers + reduce-scatters, and no all-reduce but the norm gains' (2*h elements)."""
    cfg = cfg_for(8, "gelu")
    act = B // 2 * T * cfg.d_model * 4     # b = local batch on dp=2
    tp_run, sp_run = _run(2, 4, False, 8, "gelu"), _run(2, 4, True, 8, "gelu")
    assert tp_run.forward == {"all-reduce": (2, 2 * act)}
    dp_grads = tensor.block_param_bytes(cfg, jnp.float32, 4)
    assert tp_run.backward == {"all-reduce": (3, 2 * act + dp_grads)}    # 2 TP + 1 dp all-reduce
    assert sp_run.forward == {"all-gather": (2, 2 * act), "reduce-scatter": (2, 2 * act)}
    assert sp_run.backward == {"all-gather": (2, 2 * act), "reduce-scatter": (2, 2 * act),
                               "all-reduce": (2, 2 * cfg.d_model * 4 + dp_grads)}


def test_block_float64(x64):
    cfg = cfg_for(2, "swiglu")
    run = run_block(cfg, mesh_lib.make_mesh(dp=2, tp=4), sequence_parallel=True, batch=B, seq=T,
                    dtype=jnp.float64, collectives=False)
    assert run.out[0].dtype == jnp.float64
    assert_close(run.out, run.ref)       # float64: rtol = atol = 1e-12


def test_single_device_mesh():
    cfg = cfg_for(4, "gelu")
    m = mesh_lib.make_mesh(tp=1, devices=jax.devices()[:1])
    run = run_block(cfg, m, sequence_parallel=True, batch=2, seq=T)
    assert_close(run.out, run.ref)
    assert run.forward == run.backward == {}


@pytest.mark.parametrize("case", [(2, 4, False, 2, "swiglu"), (2, 4, True, 8, "gelu")])
def test_shardings_of_outputs_and_grads(case):
    dp, tp, sp, kv, mlp = case
    run = _run(*case)
    y, (grads, dx) = run.out
    m = y.sharding.mesh
    specs = tensor.TPSpecs.megatron(n_kv_heads=kv, tp=tp, sequence_parallel=sp, data_axis="dp")
    assert y.sharding.is_equivalent_to(NamedSharding(m, specs.act_btd), 3)
    for k, spec in specs.params(grads).items():
        assert grads[k].sharding.is_equivalent_to(NamedSharding(m, spec), grads[k].ndim), k


def test_param_bytes_per_device_are_one_tth():
    cfg = cfg_for(8, "swiglu")
    p, _, _ = block_inputs(cfg, 2, T)
    full = tensor.block_param_bytes(cfg, jnp.float32, 1)
    assert full == sum(a.nbytes for a in p.values())
    norms = 2 * cfg.d_model * 4
    for t in (2, 4, 8):
        m = mesh_lib.make_mesh(dp=8 // t, tp=t)
        specs = tensor.TPSpecs.megatron(n_kv_heads=8, tp=t).params(p)
        placed = {k: jax.device_put(a, NamedSharding(m, specs[k])) for k, a in p.items()}
        per_device = sum(a.addressable_shards[0].data.nbytes for a in placed.values())
        assert per_device == tensor.block_param_bytes(cfg, jnp.float32, t) == (full - norms) // t + norms


def test_counterexample_row_split_gelu_is_wrong():
    m = mesh_lib.make_mesh(dp=2, tp=4)
    kx, ka = jax.random.split(jax.random.PRNGKey(1))
    x, a = jax.random.normal(kx, (16, 64)), jax.random.normal(ka, (64, 256)) / 8
    wrong, right = tensor.row_split_gelu(x, a, mesh=m)
    expected = jax.nn.gelu(x @ a, approximate=False)
    assert_close(right, expected)                      # all-reduce first, then GeLU: right
    assert max_abs_diff(wrong, expected) > 0.5         # lecture: 0.82 for its setup


VOCAB_MESHES = [(8, 1), (4, 2), (1, 8), (2, 4)]   # (dp, tp): size-1 axes included


def _fwd_bwd(fn, x):
    """The jitted forward of fn and its jitted backward alone (cotangent -> dL/dx),
    so that each program's collectives are read on their own."""
    _, vjp = jax.vjp(fn, x)
    return jax.jit(fn), jax.jit(lambda ct: vjp(ct)[0])


@pytest.mark.parametrize("dp,tp", VOCAB_MESHES)
def test_vocab_parallel_cross_entropy(dp, tp):
    m = mesh_lib.make_mesh(dp=dp, tp=tp)
    kl, kt = jax.random.split(jax.random.PRNGKey(2))
    logits = 3 * jax.random.normal(kl, (8, T, 64))
    targets = jax.random.randint(kt, (8, T), 0, 64)
    fwd, bwd = _fwd_bwd(lambda l: tensor_vocab.vocab_parallel_cross_entropy(l, targets, mesh=m), logits)
    assert_close((fwd(logits), bwd(1.0)),
                 jax.value_and_grad(lambda l: reference.cross_entropy(l, targets))(logits))
    # Only [B/dp, T] statistics cross the wire (no all-gather: the logits are never gathered).
    for backward, f, arg in ((False, fwd, logits), (True, bwd, 1.0)):
        assert comms.nonzero(comms.collective_stats(f, arg)) == tensor_vocab.vocab_collectives(
            batch=8, seq=T, d_model=0, vocab=64, dtype=jnp.float32, tp=tp, dp=dp, what="cross_entropy",
            backward=backward)


def test_vocab_parallel_cross_entropy_float64(x64):
    m = mesh_lib.make_mesh(dp=2, tp=4)
    logits = 3 * jax.random.normal(jax.random.PRNGKey(4), (4, T, 64), jnp.float64)
    targets = jax.random.randint(jax.random.PRNGKey(5), (4, T), 0, 64)
    ours = jax.value_and_grad(lambda l: tensor_vocab.vocab_parallel_cross_entropy(l, targets, mesh=m))(logits)
    assert_close(ours, jax.value_and_grad(lambda l: reference.cross_entropy(l, targets))(logits))


@pytest.mark.parametrize("dp,tp", VOCAB_MESHES)
def test_vocab_parallel_embedding(dp, tp):
    m = mesh_lib.make_mesh(dp=dp, tp=tp)
    kt, ke, kc = jax.random.split(jax.random.PRNGKey(3), 3)
    tokens = jax.random.randint(kt, (8, T), 0, 64)
    embed = jax.random.normal(ke, (64, 16))
    ct = jax.random.normal(kc, (8, T, 16))

    fwd, bwd = _fwd_bwd(lambda e: tensor_vocab.vocab_parallel_embedding(e, tokens, mesh=m), embed)
    y, vjp = jax.vjp(lambda e: e[tokens], embed)
    assert_close((fwd(embed), bwd(ct)), (y, vjp(ct)[0]))
    for backward, f, arg in ((False, fwd, embed), (True, bwd, ct)):
        assert comms.nonzero(comms.collective_stats(f, arg)) == tensor_vocab.vocab_collectives(
            batch=8, seq=T, d_model=16, vocab=64, dtype=jnp.float32, tp=tp, dp=dp, what="embedding",
            backward=backward)


def _params(cfg):
    return reference.layer_params(reference.init_params(jax.random.PRNGKey(0), cfg), 0)


@pytest.mark.parametrize("cfg_kw,tp,sp,seq,match", [
    (dict(n_heads=6, n_kv_heads=6, d_ff=64), 4, False, 8, r"n_heads=6 is not divisible by tp=4.*Fix"),
    (dict(n_heads=24, n_kv_heads=6, d_ff=64), 8, False, 8, r"n_kv_heads=6 and tp=8.*Fix"),
    (dict(n_heads=8, n_kv_heads=8, d_ff=60), 8, False, 8, r"d_ff=60 \(FFN width\) is not divisible by tp=8.*Fix"),
    (dict(n_heads=8, n_kv_heads=8, d_ff=64), 4, True, 6, r"sequence length T=6 is not divisible by tp=4.*Fix"),
])
def test_bad_input_raises(cfg_kw, tp, sp, seq, match):
    cfg = reference.ModelConfig(n_layers=1, **cfg_kw)
    m = mesh_lib.make_mesh(dp=8 // tp, tp=tp)
    x = jnp.zeros((8, seq, cfg.d_model))
    with pytest.raises(ValueError, match=match):
        tensor.tp_block(_params(cfg), x, mesh=m, cfg=cfg, sequence_parallel=sp)


def test_bad_vocab_raises():
    m = mesh_lib.make_mesh(tp=8)
    with pytest.raises(ValueError, match=r"batch B=3 is not divisible by dp=2.*Fix"):
        tensor_vocab.vocab_parallel_cross_entropy(jnp.zeros((3, 2, 64)), jnp.zeros((3, 2), int),
                                                  mesh=mesh_lib.make_mesh(dp=2, tp=4))
    with pytest.raises(ValueError, match=r"vocab V=60 is not divisible by tp=8.*Fix"):
        tensor_vocab.vocab_parallel_cross_entropy(jnp.zeros((1, 2, 60)), jnp.zeros((1, 2), int), mesh=m)
    with pytest.raises(ValueError, match=r"vocab V=60 is not divisible by tp=8"):
        tensor_vocab.vocab_parallel_embedding(jnp.zeros((60, 4)), jnp.zeros((1, 2), int), mesh=m)
