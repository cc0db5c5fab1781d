"""Megatron TP and SP blocks against reference.block (output, input gradient, every
parameter gradient), the collectives of their compiled forward and backward against
tensor.tp_block_collectives, the row-split counterexample, vocab-parallel embedding,
cross-entropy and LM head, the whole model end to end against reference.loss, the tour's
checks, and the errors for inputs that do not fit."""

import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import reference, tensor
from jaxpar import mesh as mesh_lib
from jaxpar.tensor import verify
from jaxpar.tensor.verify import block_inputs, lm_head_inputs, reference_lm_loss_and_grads, run_block
from jaxpar.testing import assert_close, fwd_bwd, max_abs_diff, value_and_grads
from tests.processes import child_env

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
    return run_block(cfg_for(kv, mlp), mesh_lib.make_mesh(dp=dp, tp=tp), sequence_parallel=sp, batch_size=B, seq_len=T)


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
    dp_grads = tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=4)
    assert tp_run.backward == {"all-reduce": (3, 2 * act + dp_grads)}    # 2 TP + 1 dp all-reduce
    assert sp_run.forward == {"all-gather": (2, 2 * act), "reduce-scatter": (2, 2 * act)}
    assert sp_run.backward == {"all-gather": (2, 2 * act), "reduce-scatter": (2, 2 * act),
                               "all-reduce": (2, 2 * cfg.d_model * 4 + dp_grads)}


# float64 (rtol = atol = 1e-12) for every tp in {1, 2, 4, 8}; small shapes, no HLO read.
F64_CASES = [(8, 1, False, 8, "gelu"), (4, 2, False, 4, "swiglu"), (2, 4, True, 2, "swiglu"),
             (1, 8, False, 8, "gelu")]


@pytest.mark.parametrize("dp,tp,sp,kv,mlp", F64_CASES, ids=lambda v: str(v))
def test_block_float64(x64, dp, tp, sp, kv, mlp):
    run = run_block(cfg_for(kv, mlp), mesh_lib.make_mesh(dp=dp, tp=tp), sequence_parallel=sp, batch_size=dp,
                    seq_len=8, dtype=jnp.float64, collectives=False)
    assert run.out[0].dtype == jnp.float64
    assert_close(run.out, run.ref)


def test_single_device_mesh():
    cfg = cfg_for(4, "gelu")
    m = mesh_lib.make_mesh(tp=1, devices=jax.devices()[:1])
    run = run_block(cfg, m, sequence_parallel=True, batch_size=2, seq_len=T)
    assert_close(run.out, run.ref)
    assert run.forward == run.backward == {}


# Megatron's layout written out for dp=2 x tp=4 and cfg_for (D=32, N=8 heads of H=4,
# F=64), B = T = 8: {name: (PartitionSpec, shape of one device's shard)}.
_SPLIT_HEADS = (P(None, "tp", None), (32, 2, 4))          # [D, N/4, H]: column-parallel
MEGATRON_DP2_TP4 = {
    "attn_norm": (P(), (32,)), "mlp_norm": (P(), (32,)),
    "wq": _SPLIT_HEADS, "wk": _SPLIT_HEADS, "wv": _SPLIT_HEADS,
    "wo": (P("tp", None, None), (2, 4, 32)),              # [N/4, H, D]: row-parallel
    "w_up": (P(None, "tp"), (32, 16)), "w_gate": (P(None, "tp"), (32, 16)),   # [D, F/4]
    "w_down": (P("tp", None), (16, 32)),                  # [F/4, D]
}


@pytest.mark.parametrize("case,expected", [
    # K=2 < tp=4: each KV head replicated over 2 devices, wk and wv whole; TP: x, y[B/dp, T, D]
    ((2, 4, False, 2, "swiglu"), {"wk": (P(), (32, 2, 4)), "wv": (P(), (32, 2, 4)),
                                  "y": (P("dp", None, None), (4, 8, 32))}),
    # K=8: split like the query heads; no w_gate (GeLU); SP: x, y[B/dp, T/tp, D]
    ((2, 4, True, 8, "gelu"), {"w_gate": None, "y": (P("dp", "tp", None), (4, 2, 32))}),
])
def test_shardings_of_outputs_and_grads(case, expected):
    """The output and every gradient come back in Megatron's layout: each array's
    PartitionSpec and the shape of one device's shard, written out by hand."""
    run = _run(*case)
    y, (grads, dx) = run.out
    m = y.sharding.mesh
    want = {k: v for k, v in (MEGATRON_DP2_TP4 | expected).items() if v is not None}
    want["dx"] = want["y"]                               # x is laid out as the block's output
    got = grads | {"y": y, "dx": dx}
    assert set(got) == set(want)
    for k, (spec, local) in want.items():
        assert got[k].sharding.is_equivalent_to(NamedSharding(m, spec), got[k].ndim), (k, got[k].sharding)
        assert {s.data.shape for s in got[k].addressable_shards} == {local}, k


def test_param_bytes_per_device_are_one_tth():
    cfg = cfg_for(8, "swiglu")
    p, _, _ = block_inputs(cfg, 2, T)
    full = tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=1)
    assert full == sum(a.nbytes for a in p.values())
    norms = 2 * cfg.d_model * 4
    for t in (2, 4, 8):
        m = mesh_lib.make_mesh(dp=8 // t, tp=t)
        pspecs = tensor.TPSpecs.megatron(n_kv_heads=8, tp=t).params(p)
        placed = {k: jax.device_put(a, NamedSharding(m, pspecs[k])) for k, a in p.items()}
        per_device = sum(a.addressable_shards[0].data.nbytes for a in placed.values())
        assert per_device == tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=t) == (full - norms) // t + norms


def test_the_layouts_name_tp_once_and_leave_it_out_on_one_device():
    """TPSpecs.named keeps every tp name (KV heads replicated when tp > K); megatron drops
    tp on one device; VocabSpecs splits the embedding's rows and the head's columns."""
    assert tensor.TPSpecs.named(n_kv_heads=2, tp=1) == tensor.TPSpecs()
    assert tensor.TPSpecs.named(n_kv_heads=2, tp=4).wk_dkh == P() == tensor.TPSpecs.named(n_kv_heads=2, tp=4).wv_dkh
    one = tensor.TPSpecs.megatron(n_kv_heads=2, tp=1, sequence_parallel=True, data_axis="dp")
    assert (one.wq_dnh, one.w_down_fd, one.attn_norm_d, one.act_btd) == (P(None, None, None), P(None, None), P(),
                                                                         P("dp", None, None))
    assert tensor.TPSpecs.megatron(n_kv_heads=2, tp=2, sequence_parallel=True).act_btd == P(None, "tp", None)
    assert tensor.VocabSpecs.megatron(tp=4) == tensor.VocabSpecs(embed_vd=P("tp", None), final_norm_d=P(),
                                                                 unembed_dv=P(None, "tp"))
    assert tensor.VocabSpecs.megatron(tp=1) == tensor.VocabSpecs(embed_vd=P(None, None), unembed_dv=P(None, None))
    assert tensor.without_axis(tensor.VocabSpecs(embed_vd=P(("tp", "dp"), None)), "tp").embed_vd == P("dp", None)


def test_counterexample_row_split_gelu_is_wrong():
    m = mesh_lib.make_mesh(dp=2, tp=4)
    kx, ka = jax.random.split(jax.random.key(1))
    x, a = jax.random.normal(kx, (16, 64)), jax.random.normal(ka, (64, 256)) / 8
    wrong, right = tensor.row_split_gelu(x, a, mesh=m)
    expected = jax.nn.gelu(x @ a, approximate=False)
    assert_close(right, expected)                      # all-reduce first, then GeLU: right
    assert max_abs_diff(wrong, expected) > 0.5         # lecture: 0.82 for its setup


# (dp, tp) with the vocabulary split: at tp = 1 the public functions run the reference's
# arithmetic (nothing to split), so the parity there is test_vocab_shard_functions_at_tp_1's,
# on the per-shard code path
VOCAB_MESHES = [(4, 2), (1, 8), (2, 4)]


def _logits(batch, vocab, dtype=jnp.float32, seed=2):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(3 * rng.standard_normal((batch, T, vocab)), dtype),
            jnp.asarray(rng.integers(0, vocab, (batch, T)), jnp.int32))


@pytest.mark.parametrize("dp,tp", VOCAB_MESHES)
def test_vocab_parallel_cross_entropy(dp, tp):
    m = mesh_lib.make_mesh(dp=dp, tp=tp)
    logits, targets = _logits(8, 64)
    (loss, (dlogits,)), stats = fwd_bwd(lambda l: tensor.vocab_parallel_cross_entropy(l, targets, mesh=m),
                                        logits, ct=jnp.float32(1.0))
    assert_close((loss, dlogits), jax.jit(jax.value_and_grad(lambda l: reference.cross_entropy(l, targets)))(logits))
    # Only [B/dp, T] statistics cross the wire (no all-gather: the logits are never gathered).
    assert stats == tuple(tensor.cross_entropy_collectives(
        cfg=reference.ModelConfig(vocab=64), batch_size=8, seq_len=T, dtype=jnp.float32, tp=tp, dp=dp,
        backward=b) for b in (False, True))


def test_vocab_parallel_cross_entropy_float64(x64):
    m = mesh_lib.make_mesh(dp=2, tp=4)
    logits, targets = _logits(4, 64, jnp.float64, seed=4)
    ours = jax.jit(jax.value_and_grad(lambda l: tensor.vocab_parallel_cross_entropy(l, targets, mesh=m)))
    assert_close(ours(logits), jax.jit(jax.value_and_grad(lambda l: reference.cross_entropy(l, targets)))(logits))


@pytest.mark.parametrize("dp,tp,dtype", [(*m, jnp.float32) for m in VOCAB_MESHES]
                         + [(2, 4, jnp.float64)], ids=str)
def test_vocab_parallel_lm_loss(dp, tp, dtype):
    """LM head + loss: loss and the gradients of x, final_norm, unembed vs the unsharded
    rms_norm -> @ unembed -> cross_entropy; the forward's and the backward's collectives
    exactly lm_loss_collectives."""
    with jax.enable_x64(dtype == jnp.float64):
        m = mesh_lib.make_mesh(dp=dp, tp=tp)
        cfg = reference.ModelConfig(vocab=64)
        x, gain, unembed, targets = lm_head_inputs(8, T, cfg.d_model, 64, dtype)
        out, stats = fwd_bwd(lambda *a: tensor.vocab_parallel_lm_loss(*a, targets, mesh=m, cfg=cfg),
                             x, gain, unembed, ct=jnp.ones((), dtype))
        assert out[0].dtype == dtype
        assert_close(out, reference_lm_loss_and_grads(x, gain, unembed, targets))
        assert stats == tuple(tensor.lm_loss_collectives(
            cfg=cfg, batch_size=8, seq_len=T, dtype=dtype, tp=tp, dp=dp, backward=b) for b in (False, True))


def test_tp_loss_end_to_end_matches_reference_loss():
    """vocab_parallel_embedding -> tp_block x 2 layers -> vocab_parallel_lm_loss equals
    reference.loss, with the gradient of every parameter (embed, all blocks, final_norm,
    unembed): the vocab-parallel story end to end, on dp=2 x tp=4."""
    cfg = reference.ModelConfig(n_layers=2, n_kv_heads=2, mlp="swiglu")
    m = mesh_lib.make_mesh(dp=2, tp=4)
    params = reference.init_params(jax.random.key(7), cfg)
    params["final_norm"] = 1 + 0.1 * jax.random.normal(jax.random.key(8), (cfg.d_model,))
    tokens = jax.random.randint(jax.random.key(9), (4, T + 1), 0, cfg.vocab)
    ours = jax.jit(jax.value_and_grad(lambda p: tensor.tp_loss(p, tokens, mesh=m, cfg=cfg)))(params)
    assert_close(ours, jax.jit(jax.value_and_grad(lambda p: reference.loss(p, tokens, cfg)))(params))


@pytest.mark.parametrize("dp,tp", VOCAB_MESHES)
def test_vocab_parallel_embedding(dp, tp):
    m = mesh_lib.make_mesh(dp=dp, tp=tp)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 64, (8, T)), jnp.int32)
    embed = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((8, T, 16)), jnp.float32)

    (y, (dembed,)), stats = fwd_bwd(lambda e: tensor.vocab_parallel_embedding(e, tokens, mesh=m), embed, ct=ct)
    assert_close((y, (dembed,)), value_and_grads(lambda e: e[tokens], embed, ct=ct))
    assert stats == tuple(tensor.embedding_collectives(
        cfg=reference.ModelConfig(vocab=64, d_model=16), batch_size=8, seq_len=T, dtype=jnp.float32, tp=tp, dp=dp,
        backward=b) for b in (False, True))


def test_vocab_shard_functions_at_tp_1():
    """tp = 1, one shard holding the whole vocabulary: the per-shard functions (embedding,
    cross-entropy, LM head + loss) under shard_map on dp=8 x tp=1 against the reference,
    value and gradients. The public functions at tp = 1 split nothing and run the
    reference's arithmetic; what they claim there is their collectives: the formulas'
    (the dp mean of the loss, nothing over tp)."""
    m = mesh_lib.make_mesh(dp=8, tp=1)
    cfg = reference.ModelConfig(vocab=64, d_model=16)
    logits, targets = _logits(8, 64)
    x, gain, unembed, lm_targets = lm_head_inputs(8, T, cfg.d_model, 64)
    rng = np.random.default_rng(3)
    embed = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((8, T, 16)), jnp.float32)
    mean = lambda loss: jax.lax.pmean(loss, "dp")
    ce = jax.shard_map(lambda l, t: mean(tensor.cross_entropy_shard(l, t)), mesh=m,
                       in_specs=(P("dp", None, "tp"), P("dp")), out_specs=P())
    assert_close(jax.jit(jax.value_and_grad(ce))(logits, targets),
                 jax.jit(jax.value_and_grad(lambda l: reference.cross_entropy(l, targets)))(logits))
    lm = jax.shard_map(lambda x, g, w, t: mean(tensor.lm_head_loss_shard(x, g, w, t, eps=cfg.norm_eps)), mesh=m,
                       in_specs=(P("dp"), P(), P(None, "tp"), P("dp")), out_specs=P())
    assert_close(jax.jit(jax.value_and_grad(lm, argnums=(0, 1, 2)))(x, gain, unembed, lm_targets),
                 reference_lm_loss_and_grads(x, gain, unembed, lm_targets))
    emb = jax.shard_map(tensor.embedding_shard, mesh=m, in_specs=(P("tp", None), P("dp")), out_specs=P("dp"))
    assert_close(value_and_grads(lambda e: emb(e, targets), embed, ct=ct),
                 value_and_grads(lambda e: e[targets], embed, ct=ct))
    for public, formula, args, cotangent in (
            (lambda l: tensor.vocab_parallel_cross_entropy(l, targets, mesh=m), tensor.cross_entropy_collectives,
             (logits,), jnp.float32(1.0)),
            (lambda *a: tensor.vocab_parallel_lm_loss(*a, lm_targets, mesh=m, cfg=cfg), tensor.lm_loss_collectives,
             (x, gain, unembed), jnp.float32(1.0)),
            (lambda e: tensor.vocab_parallel_embedding(e, targets, mesh=m), tensor.embedding_collectives,
             (embed,), ct)):
        _, stats = fwd_bwd(public, *args, ct=cotangent)
        assert stats == tuple(formula(cfg=cfg, batch_size=8, seq_len=T, dtype=jnp.float32, tp=1, dp=8, backward=b)
                              for b in (False, True))


def _params(cfg):
    return reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0)


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


@pytest.mark.parametrize("change,match", [
    (dict(x_shape=(8, 8, 16)), r"x has shape \(8, 8, 16\); tp_block takes x\[B, T, D\] with D = cfg.d_model = 32.*Fix"),
    (dict(x_shape=(8, 32)), r"x has shape \(8, 32\); tp_block takes x\[B, T, D\].*Fix.*x\[None\]"),
    (dict(stacked=True), r"params\['attn_norm'\] has shape \(2, 32\).*stacked params\['blocks'\].*Fix: .*layer_params"),
    (dict(whole=True), r"the whole model.*Fix: .*layer_params"),
    (dict(mlp="swiglu"), r"do not fit cfg \(mlp='swiglu'.*missing \['w_gate'\].*Fix"),
    (dict(mlp="gelu", params_mlp="swiglu"), r"unexpected \['w_gate'\].*Fix"),
])
def test_bad_block_inputs_raise_before_compute(change, match):
    """x of the wrong width or rank, stacked or whole-model params, params of the other
    MLP kind: a ValueError naming the value, the constraint and a fix."""
    cfg = reference.ModelConfig(mlp=change.get("mlp", "gelu"))
    params_cfg = dataclasses.replace(cfg, mlp=change.get("params_mlp", "gelu"))
    full = reference.init_params(jax.random.key(0), params_cfg)
    params = full if change.get("whole") else full["blocks"] if change.get("stacked") else reference.layer_params(full, 0)
    x = jnp.zeros(change.get("x_shape", (8, 8, cfg.d_model)))
    with pytest.raises(ValueError, match=match):
        tensor.tp_block(params, x, mesh=mesh_lib.make_mesh(dp=2, tp=4), cfg=cfg)


def test_bad_vocab_raises():
    m = mesh_lib.make_mesh(tp=8)
    with pytest.raises(ValueError, match=r"batch B=3 is not divisible by dp=2.*Fix"):
        tensor.vocab_parallel_cross_entropy(jnp.zeros((3, 2, 64)), jnp.zeros((3, 2), int),
                                                  mesh=mesh_lib.make_mesh(dp=2, tp=4))
    with pytest.raises(ValueError, match=r"vocab V=60 is not divisible by tp=8.*Fix"):
        tensor.vocab_parallel_cross_entropy(jnp.zeros((1, 2, 60)), jnp.zeros((1, 2), int), mesh=m)
    with pytest.raises(ValueError, match=r"vocab V=60 is not divisible by tp=8"):
        tensor.vocab_parallel_embedding(jnp.zeros((60, 4)), jnp.zeros((1, 2), int), mesh=m)
    with pytest.raises(ValueError, match=r"x \(2, 3\), final_norm \(32,\), unembed \(32, 64\).*Fix"):
        tensor.vocab_parallel_lm_loss(jnp.zeros((2, 3)), jnp.ones(32), jnp.zeros((32, 64)),
                                            jnp.zeros((2, 3), int), mesh=m, cfg=reference.ModelConfig())


def test_tour_checks_of_tp_and_sp_are_ok():
    rows = verify.check_tp() + verify.check_sp()
    assert [r.name for r in rows if not r.passed] == [], rows
    assert "LM head" in rows[2].name and rows[2].collectives_match
    assert rows[0].collectives_match and rows[3].collectives_match and rows[0].tolerance == (2e-5, 2e-6)


@pytest.mark.parametrize("devices, mesh, note", [(6, "dp=3 tp=2", None), (3, "dp=1 tp=2", "1 of 3 devices unused")])
def test_verify_sp_on_other_device_counts(devices, mesh, note):
    """6 devices: dp=3 x tp=2, the batch of the check a multiple of dp (it once was a fixed
    4). 3 devices: tp=2 on 2 of them, and the row says the third is left out (it once ran
    tp=1 silently)."""
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "jaxpar", "verify", "sp", "--devices", str(devices)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert mesh in proc.stdout and (note is None or note in proc.stdout), proc.stdout
