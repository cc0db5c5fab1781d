"""kernels.flash, the fused Pallas kernel of one attention block, against the blockwise
XLA ops it replaces (context.blockwise) and against reference.attention through ring
attention and the whole-sequence entry point.

On CPU (make test) the kernels run in Pallas' interpreter: the same kernel bodies, tile
by tile, in float32 against float32 at float32's tolerance. On a GPU
(JAXPAR_TEST_PLATFORM=gpu pytest tests/kernels) they compile through Triton and are held
to float32's tolerance under the precision policy and to the bfloat16 rule in bfloat16,
and the ring's compiled program to holding no [Tc, Tc] score matrix. The kernel computes
in float32 by design, so there is no float64 case: choose_block refuses float64."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context import blockwise, ring
from jaxpar.context import verify as context_verify
from jaxpar.errors import ConfigError
from jaxpar.kernels import attention as kernel
from jaxpar.kernels import flash
from jaxpar.testing import assert_close, precision_policy, tolerance
from jaxpar.train import ParallelSpec, Trainer, recipe
from tests.kernels import needs_devices, training, triton_modules

GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not GPU, reason="the Pallas kernel compiles through Triton on an NVIDIA GPU; this "
                                              f"run's backend is {jax.default_backend()} (it ran interpreted)")


def _grouped(key, *, B=1, K=2, G=2, tq=64, tk=64, H=16, dtype=jnp.float32):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, K, G, tq, H), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, K, tk, H), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, K, tk, H), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, K, G, tq, H), jnp.float32).astype(dtype)
    return q, k, v, do


@pytest.mark.parametrize("causal, tq, tk", [(True, 64, 64), (False, 32, 128), (False, 128, 64), (True, 256, 256)])
def test_the_block_kernels_equal_the_blockwise_ops(causal, tq, tk):
    """(o, lse) of one block, and its (dq, dk, dv) from *merged* statistics (the lse of
    this block merged with another's, delta of the merged output, as a ring hands them),
    against context.blockwise's attend and attend_backward."""
    q, k, v, do = _grouped(jax.random.key(tq + tk + causal), tq=tq, tk=tk)
    scale = q.shape[-1] ** -0.5
    mask = blockwise.causal_mask(tq, tk) if causal else None
    with precision_policy():
        o, lse = blockwise.attend(q, k, v, scale=scale, mask=mask)
        other = blockwise.attend(q, 0.5 * k[:, :, ::-1], v[:, :, ::-1], scale=scale)     # a second block of keys
        merged, merged_lse = blockwise.merge(o, lse, *other)
        delta = jnp.sum(do * merged, axis=-1)
        want = blockwise.attend_backward(q, k, v, do, merged_lse, delta, scale=scale, mask=mask)
        got_o, got_lse = flash.block_forward(q, k, v, scale=scale, causal=causal, interpret=not GPU)
        got = flash.block_backward(q, k, v, do, merged_lse, delta, scale=scale, causal=causal, interpret=not GPU)
    assert_close((got_o, got_lse), (o, lse))
    assert_close(got, want)


@functools.lru_cache(maxsize=None)
def _ring_program(cp: int, layout: str, kernel_name: str):
    mesh = mesh_lib.make_mesh(cp=cp, devices=jax.devices()[:cp])
    fn = functools.partial(ring.ring_attention, mesh=mesh, causal=True, layout=layout, kernel=kernel_name)
    return jax.jit(lambda q, k, v, do: _out_and_grads(fn, q, k, v, do))


def _out_and_grads(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do.astype(o.dtype)))


def _qkv(key, *, B=1, T=64, N=4, K=2, H=16, dtype=jnp.float32):
    kq, kk, kv, kd = jax.random.split(key, 4)
    shapes = ((B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H))
    return tuple(jax.random.normal(k_, s, jnp.float32).astype(dtype) for k_, s in zip((kq, kk, kv, kd), shapes))


@pytest.mark.parametrize("cp, layout", [(1, "contiguous"), pytest.param(2, "contiguous", marks=needs_devices(2)),
                                        pytest.param(2, "zigzag", marks=needs_devices(2))])
def test_ring_attention_with_the_kernel_equals_the_reference(cp, layout):
    """Ring attention whose every block is the Pallas kernel: output, dq, dk, dv against
    reference.attention in float32 (GQA, causal; cp = 2 merges blocks from two ranks,
    zigzag adds the half blocks)."""
    q, k, v, do = _qkv(jax.random.key(cp))
    with precision_policy():
        got = _ring_program(cp, layout, "pallas")(q, k, v, do)
        want = _out_and_grads(functools.partial(reference.attention, causal=True), q, k, v, do)
    assert_close(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_the_whole_sequence_through_the_kernel_equals_the_reference(causal):
    """kernels.attention(implementation="pallas"): the kernel over one block with its own
    lse, output and every input gradient against reference.attention."""
    q, k, v, do = _qkv(jax.random.key(7 + causal), T=128)
    fn = functools.partial(kernel.attention, causal=causal, implementation="pallas")
    with precision_policy():
        got = _out_and_grads(fn, q, k, v, do)
        want = _out_and_grads(functools.partial(reference.attention, causal=causal), q, k, v, do)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("causal, tq, tk, head_dim", [(True, 2048, 2048, 128), (False, 16, 256, 16),
                                                      (True, 64, 64, 64), (False, 128, 32, 256)])
def test_the_block_kernels_triton_modules_verify(dtype, causal, tq, tk, head_dim):
    """The block's forward, dK/dV and dQ lowered for CUDA from this machine, at the
    benchmark's T = 2048 with heads of 128 and at the edges of what `flash.fits` takes
    (tiles of 16, head_dim 16 and 256): each Triton module passes MLIR's verifier."""
    q = jax.ShapeDtypeStruct((1, 2, 2, tq, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 2, tk, head_dim), dtype)

    def forward_and_backward(q, k, v):
        o, lse = flash.block_forward(q, k, v, scale=head_dim ** -0.5, causal=causal)
        return flash.block_backward(q, k, v, o.astype(q.dtype), lse, lse, scale=head_dim ** -0.5, causal=causal)
    assert triton_modules(forward_and_backward, q, k, k) == ["jaxpar_block_forward", "jaxpar_block_dkv",
                                                             "jaxpar_block_dq"]


def test_until_its_gpu_tests_pass_auto_keeps_the_xla_blocks(monkeypatch):
    monkeypatch.setattr(kernel, "PALLAS_AUTO", False)
    assert kernel.choose_block("auto", dtype=jnp.bfloat16, tq=1024, tk=1024, head_dim=128, platform="gpu") == "xla"
    assert kernel.choose_block("pallas", dtype=jnp.bfloat16, tq=1024, tk=1024, head_dim=128, platform="gpu") == "pallas"


@pytest.mark.parametrize("implementation, platform, dtype, tokens, head_dim, expected", [
    ("auto", "gpu", jnp.bfloat16, 1024, 128, "pallas"), ("auto", "gpu", jnp.float16, 32, 64, "pallas"),
    ("auto", "cpu", jnp.bfloat16, 1024, 128, "xla"), ("auto", "gpu", jnp.float32, 1024, 128, "xla"),
    ("auto", "gpu", jnp.bfloat16, 1024, 80, "xla"), ("auto", "gpu", jnp.bfloat16, 96, 64, "xla"),
    ("xla", "gpu", jnp.bfloat16, 1024, 128, "xla"), ("pallas", "cpu", jnp.float32, 64, 16, "pallas")])
def test_the_block_kernel_is_chosen_where_it_fits(monkeypatch, implementation, platform, dtype, tokens, head_dim,
                                                  expected):
    """The rule "auto" follows once PALLAS_AUTO is on (after the kernel's GPU tests pass)."""
    monkeypatch.setattr(kernel, "PALLAS_AUTO", True)
    assert kernel.choose_block(implementation, dtype=dtype, tq=tokens, tk=tokens, head_dim=head_dim,
                               platform=platform) == expected


@pytest.mark.parametrize("implementation, dtype, tokens, head_dim, says", [
    ("pallas", jnp.bfloat16, 1024, 80, "power of two"), ("pallas", jnp.bfloat16, 96, 64, "multiple of 64"),
    ("pallas", jnp.float64, 64, 64, "float32"), ("cudnn", jnp.bfloat16, 1024, 128, "merged lse"),
    ("flash", jnp.bfloat16, 1024, 128, "'auto', 'xla', 'cudnn', 'pallas'")])
def test_a_block_kernel_that_cannot_run_is_refused_with_the_reason(implementation, dtype, tokens, head_dim, says):
    with pytest.raises(ConfigError, match=says):
        kernel.choose_block(implementation, dtype=dtype, tq=tokens, tk=tokens, head_dim=head_dim, platform="gpu")


def test_ring_attention_refuses_a_kernel_that_does_not_fit_before_computing():
    q, k, v, _ = _qkv(jax.random.key(0), T=48, H=12)
    with pytest.raises(ConfigError, match="head_dim=12"):
        ring.ring_attention(q, k, v, mesh=mesh_lib.make_mesh(cp=1, devices=jax.devices()[:1]), kernel="pallas")


def _bf16_rule(got, want):
    rtol, _ = tolerance(jnp.bfloat16)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < rtol, f"{name}: |pallas - reference| / |reference| = {rel:.2e} > {rtol}"


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N, K, H", [(8, 2, 64), (4, 4, 128)])
def test_the_kernel_in_bfloat16_on_a_gpu_keeps_the_bfloat16_rule(causal, N, K, H):
    """The Triton-compiled kernel in bf16, through the ring's entry point (cp = 1) and the
    whole-sequence one, against the float32 reference on the same bf16-rounded inputs."""
    q, k, v, do = _qkv(jax.random.key(N + H + causal), B=2, T=1024, N=N, K=K, H=H, dtype=jnp.bfloat16)
    with precision_policy():
        want = _out_and_grads(functools.partial(reference.attention, causal=causal),
                              *(a.astype(jnp.float32) for a in (q, k, v)), do)
    one = mesh_lib.make_mesh(cp=1, devices=jax.devices()[:1])
    ring_fn = functools.partial(ring.ring_attention, mesh=one, causal=causal, kernel="pallas")
    _bf16_rule(jax.jit(lambda *a: _out_and_grads(ring_fn, *a))(q, k, v, do), want)
    whole = functools.partial(kernel.attention, causal=causal, implementation="pallas")
    _bf16_rule(jax.jit(lambda *a: _out_and_grads(whole, *a))(q, k, v, do), want)


@needs_gpu
def test_the_ring_with_the_kernel_holds_no_score_matrix_on_a_gpu():
    """At T = 8192 on one GPU the compiled forward + backward of ring attention through
    the kernel needs under 1/8 of one [B, N, T, T] bf16 score matrix."""
    B, T, N, K, H = 1, 8192, 8, 2, 64
    q, k, v, do = _qkv(jax.random.key(3), B=B, T=T, N=N, K=K, H=H, dtype=jnp.bfloat16)
    one = mesh_lib.make_mesh(cp=1, devices=jax.devices()[:1])
    fn = functools.partial(ring.ring_attention, mesh=one, kernel="pallas")
    compiled = jax.jit(lambda *a: _out_and_grads(fn, *a)).lower(q, k, v, do).compile()
    temp, scores = compiled.memory_analysis().temp_size_in_bytes, B * N * T * T * 2
    assert temp < scores / 8, f"temp {temp} bytes: a T x T buffer ({scores} bytes) is being held"


@needs_devices(4)
def test_the_ring_through_the_kernel_moves_what_the_formula_says():
    """The kernel changes what computes a block, not what travels: ring attention at
    dp 2 x cp 2 (zigzag) with Pallas blocks, its compiled forward and backward
    collectives against context.formulas, and its results against the reference."""
    mesh = mesh_lib.make_mesh(dp=2, cp=2, devices=jax.devices()[:4])
    case = context_verify.AttentionCase(layout="zigzag", kernel="pallas", seq_len=64, head_dim=16, n_heads=4)
    with precision_policy():
        run = context_verify.run_attention("ring", mesh, case)
    assert run.collectives_match, (run.forward, run.formula_forward, run.backward, run.formula_backward)
    assert run.compared[2], run.compared


@pytest.mark.parametrize("requested, spec, platform, expected", [
    ("auto", ParallelSpec(cp=2), "gpu", "pallas"), ("auto", ParallelSpec(cp=2, layout="zigzag"), "gpu", "pallas"),
    ("auto", ParallelSpec(cp=2), "cpu", "xla"), ("auto", ParallelSpec(), "gpu", "cudnn"),
    ("auto", ParallelSpec(cp=2, attention="ulysses"), "gpu", "cudnn"), ("pallas", ParallelSpec(), "gpu", "pallas"),
    ("xla", ParallelSpec(cp=2), "gpu", "xla")])
def test_the_trainer_takes_the_ring_blocks_kernel_at_cp_above_one(monkeypatch, requested, spec, platform, expected):
    """What the trainer's attention runs (recipe.choose_kernel): a ring's blocks at cp > 1,
    the whole sequence at cp = 1 and under Ulysses (bf16 layers, T = 4096, heads of 128);
    "auto" as it will choose once PALLAS_AUTO is on."""
    monkeypatch.setattr(kernel, "PALLAS_AUTO", True)
    cfg = reference.ModelConfig(d_model=1024, n_heads=8, n_kv_heads=4, head_dim=128)
    assert recipe.choose_kernel(requested, cfg, spec, seq_len=4096, dtype=jnp.bfloat16, platform=platform) == expected


@pytest.mark.parametrize("requested, spec, platform, says", [
    ("pallas", ParallelSpec(cp=2), "cpu", "interpreted"), ("pallas", ParallelSpec(), "cpu", "interpreted"),
    ("cudnn", ParallelSpec(cp=2), "gpu", "merged lse")])
def test_the_trainer_refuses_a_kernel_it_cannot_run_before_building(requested, spec, platform, says):
    cfg = reference.ModelConfig(d_model=1024, n_heads=8, n_kv_heads=4, head_dim=128)
    with pytest.raises(ConfigError, match=says):
        recipe.choose_kernel(requested, cfg, spec, seq_len=4096, dtype=jnp.bfloat16, platform=platform)


@needs_gpu
def test_the_trainer_through_the_kernel_on_a_gpu_follows_the_xla_attention():
    """Three bf16 training steps of a small model with attention_kernel="pallas" (the whole
    sequence through the kernel) and "xla", same init and batches: the losses agree
    within the bf16 rule."""
    cfg = reference.ModelConfig(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=256)
    tokens = jax.random.randint(jax.random.key(0), (4, 257), 0, cfg.vocab)
    runs = {name: training.losses(cfg, tokens, attention_kernel=name) for name in ("pallas", "xla")}
    assert [trainer.kernel for _, trainer in runs.values()] == ["pallas", "xla"]
    np.testing.assert_allclose(runs["pallas"][0], runs["xla"][0], rtol=tolerance(jnp.bfloat16)[0])


@needs_devices(4)
def test_the_trainers_step_with_ring_blocks_through_the_kernel_lowers_for_a_gpu(monkeypatch):
    """The whole bf16 training step at dp 2 x cp 2 (zigzag), every ring block through the
    Pallas kernel, lowered for CUDA from this machine (cross-platform lowering: Pallas
    emits the Triton kernels, nothing runs) inside the trainer's shard_map, which checks
    varying types: the block's forward, and dK/dV and dQ of its backward, as Triton kernels."""
    monkeypatch.setattr(recipe, "choose_kernel", lambda *a, **k: "pallas")
    cfg = reference.ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=64, n_layers=2)
    spec = ParallelSpec(dp=2, cp=2, layout="zigzag")
    trainer = Trainer(cfg, spec, batch_size=4, seq_len=128, devices=jax.devices()[:4], compute_dtype=jnp.bfloat16)
    names = triton_modules(trainer._step, *trainer.abstract_inputs())
    for name in ("jaxpar_block_forward", "jaxpar_block_dkv", "jaxpar_block_dq"):
        assert name in names, name


_Z = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
_Q, _K = _Z(1, 2, 2, 64, 16), _Z(1, 2, 64, 16)


@pytest.mark.parametrize("q, k, v, causal, says", [
    (_Z(1, 2, 64, 16), _K, _K, True, "expected rank 5"),
    (_Q, _Z(1, 2, 64, 32), _Z(1, 2, 64, 32), False, "one shape"),
    (_Q, _K, _Z(1, 2, 32, 16), False, "one shape"),
    (_Q, _Z(1, 1, 64, 16), _Z(1, 1, 64, 16), False, "one shape"),
    (_Q, _Z(1, 2, 128, 16), _Z(1, 2, 128, 16), True, "diagonal one"),
    (_Z(1, 2, 2, 64, 16, dtype=jnp.int32), _K, _K, False, "floating point"),
    (_Q, _Z(1, 2, 24, 16), _Z(1, 2, 24, 16), False, "24 keys per block"),
    (_Z(1, 2, 2, 64, 24), _Z(1, 2, 64, 24), _Z(1, 2, 64, 24), False, "head_dim=24"),
    (_Z(0, 2, 2, 64, 16), _Z(0, 2, 64, 16), _Z(0, 2, 64, 16), False, "empty axis"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_a_block_the_kernels_cannot_take_is_refused_before_tracing(q, k, v, causal, says):
    """block_forward and block_backward check their operands first: one ConfigError naming
    the constraint, never an error from inside pallas_call."""
    stats = _Z(*q.shape[:-1]) if len(q.shape) == 5 else _Z(1)
    with pytest.raises(ConfigError, match=says):
        jax.eval_shape(lambda q, k, v: flash.block_forward(q, k, v, scale=0.25, causal=causal), q, k, v)
    with pytest.raises(ConfigError, match=says):
        jax.eval_shape(lambda *a: flash.block_backward(*a, scale=0.25, causal=causal), q, k, v, q, stats, stats)


def test_the_backwards_statistics_must_be_the_blocks():
    with pytest.raises(ConfigError, match=r"lse has shape \(1, 2, 2, 32\); the block's lse is \[1, 2, 2, 64\]"):
        jax.eval_shape(lambda *a: flash.block_backward(*a, scale=0.25, causal=True), _Q, _K, _K, _Q,
                       _Z(1, 2, 2, 32), _Z(1, 2, 2, 64))
