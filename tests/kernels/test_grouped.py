"""kernels.grouped, the grouped-matmul Pallas kernel of the MoE's experts: against a float64
numpy oracle (forward, dh, dw), and, through the MoE layer (expert.dispatch with
kernel="pallas"), against reference.moe: output, input gradient, router gradient and every
expert's gradient, in float32 and float64, and for drawn cases.

On CPU (make test) the kernels run in Pallas' interpreter: the same kernel bodies, tile by
tile. On a GPU (JAXPAR_TEST_PLATFORM=gpu pytest tests/kernels) they compile through Triton
and are held to float32's tolerance under the precision policy and to the bfloat16 rule
in bfloat16, and the trainer's MoE through the kernel follows the XLA grouped layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.expert import dispatch
from jaxpar.expert import verify as expert_verify
from jaxpar.expert.verify import moe_inputs
from jaxpar.kernels import grouped, triton_ir
from jaxpar.testing import assert_close, max_abs_diff, precision_policy, tolerance
from jaxpar.train import ParallelSpec, Trainer, recipe
from tests.kernels import needs_devices, training, triton_modules

GPU = jax.default_backend() == "gpu"
R = grouped.TILE_ROWS
needs_gpu = pytest.mark.skipif(not GPU, reason="the grouped kernel compiles through Triton on an NVIDIA GPU; this "
                                              f"run's backend is {jax.default_backend()} (it ran interpreted)")


def test_tiles_by_hand():
    """Runs of 130, 0, 5 and 256 rows: 2, 0, 1 and 2 tiles from tiles 0, 2, 2, 3; of the
    bound's 7 tiles ((391 + 4 * 127) // 128) the last two are empty, labelled E - 1."""
    t = grouped.tiles(jnp.array([130, 0, 5, 256]), 7)
    np.testing.assert_array_equal(t.expert, [0, 0, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(t.first, [0, 2, 2, 3])
    np.testing.assert_array_equal(t.count, [2, 0, 1, 2])


def _problem(sizes, K, N, dtype, seed=0):
    """(h [M, K] with zero rows outside the runs, w [E, K, N], dy [M, N], Tiles)."""
    sizes = np.asarray(sizes)
    E = len(sizes)
    n_tiles = (int(sizes.sum()) + E * (R - 1)) // R
    t = grouped.tiles(jnp.asarray(sizes), n_tiles)
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n_tiles * R, K))
    inside = np.zeros(n_tiles * R, bool)
    for e, (first, n) in enumerate(zip(np.asarray(t.first), sizes)):
        inside[first * R: first * R + n] = True
    h[~inside] = 0.0
    w = rng.standard_normal((E, K, N)) / np.sqrt(K)
    dy = rng.standard_normal((n_tiles * R, N)) * inside[:, None]
    return (jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(dy, dtype)), t


def _oracle(h, w, dy, t):
    """(y, dh, dw) in float64 numpy, row by row from the definition."""
    h, w, dy = (np.asarray(a, np.float64) for a in (h, w, dy))
    expert = np.repeat(np.asarray(t.expert), R)
    used = np.arange(h.shape[0]) < int(np.sum(t.count)) * R
    y, dh, dw = np.zeros((h.shape[0], w.shape[2])), np.zeros_like(h), np.zeros_like(w)
    for e in range(w.shape[0]):
        rows = used & (expert == e)
        y[rows], dh[rows], dw[e] = h[rows] @ w[e], dy[rows] @ w[e].T, h[rows].T @ dy[rows]
    return y, dh, dw


def _kernel(h, w, dy, t):
    y, vjp = jax.vjp(lambda h, w: grouped.grouped_matmul(h, w, t, interpret=not GPU), h, w)
    return (y, *vjp(dy))


def _within(got, want, rtol):
    """Each result within rtol of its largest entry: a matmul's error is relative to the
    size of what it sums (here up to hundreds of rows, in another order than the
    oracle's), not to each entry, which cancellation can make small."""
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= rtol * np.max(np.abs(b)), (np.max(np.abs(a - b)), np.max(np.abs(b)))


# (sizes per expert, K, N): empty experts, all rows on one expert, one row, partial and whole
# tiles, the widths' tiles 16 to 128
CASES = [([130, 0, 5, 256], 32, 48), ([384], 16, 16), ([1, 0, 0, 0, 0, 0, 0, 0], 64, 128),
         ([0, 0, 300], 256, 80), ([128, 128, 127, 129, 1, 255], 48, 32)]


@pytest.mark.parametrize("sizes, K, N", CASES, ids=str)
def test_the_kernel_equals_the_definition(sizes, K, N):
    (h, w, dy), t = _problem(sizes, K, N, jnp.float32, seed=K + N)
    with precision_policy():
        got = _kernel(h, w, dy, t)
    _within(got, _oracle(h, w, dy, t), tolerance(jnp.float32)[0])


def test_float64_agrees_near_1e_12(x64):
    (h, w, dy), t = _problem([130, 0, 5, 256], 32, 48, jnp.float64)
    got = _kernel(h, w, dy, t)
    assert got[0].dtype == got[2].dtype == jnp.float64
    assert max_abs_diff(got, _oracle(h, w, dy, t)) < 1e-12


def _layer(cfg, *, kernel, scoring="softmax", dtype=jnp.float32, batch_size=2, seq_len=64, skew=1.5, seed=0):
    """(y, grads of params and x) of one MoE layer on one device (no shard_map), and of the reference."""
    p, x, dy = moe_inputs(cfg, batch_size, seq_len, skew=skew, dtype=dtype, seed=seed)
    options = dispatch.MoEOptions.of(cfg, scoring=scoring, kernel=kernel)
    ours = lambda p, x: dispatch.ep_moe_shard(p, x.reshape(-1, cfg.d_model), axis=None, options=options)[0]
    ref = lambda p, x: reference.moe(p, x, top_k=cfg.top_k, mlp=cfg.mlp, scoring=scoring).reshape(-1, cfg.d_model)
    dy = dy.reshape(-1, cfg.d_model)
    y, vjp = jax.vjp(jax.jit(ours), p, x)
    y_ref, vjp_ref = jax.vjp(ref, p, x)
    return (y, vjp(dy)), (y_ref, vjp_ref(dy))


def _cfg(E=8, k=2, mlp="swiglu", D=32, F=48):
    return reference.ModelConfig(n_layers=1, d_model=D, d_ff=F, n_experts=E, top_k=k, mlp=mlp)


@pytest.mark.parametrize("E, k, mlp, scoring", [(8, 2, "swiglu", "softmax"), (4, 1, "gelu", "softmax"),
                                                (6, 3, "swiglu", "sigmoid"), (2, 2, "gelu", "softmax")], ids=str)
def test_the_moe_layer_through_the_kernel_equals_the_reference(E, k, mlp, scoring):
    """Output and the gradients of x, the router and every expert weight."""
    with precision_policy():
        out, ref = _layer(_cfg(E, k, mlp), kernel="pallas", scoring=scoring)
    assert_close(out, ref)
    assert float(jnp.max(jnp.abs(out[1][0]["w_down"]))) > 0


def test_the_moe_layer_in_float64_agrees_near_1e_12(x64):
    out, ref = _layer(_cfg(), kernel="pallas", dtype=jnp.float64)
    assert out[0].dtype == jnp.float64
    assert max_abs_diff(out, ref) < 1e-12


@st.composite
def layer_cases(draw):
    E = draw(st.sampled_from([2, 4, 5, 8]))
    return dict(cfg=_cfg(E, draw(st.sampled_from([n for n in (1, 2, E) if n <= E])),
                         draw(st.sampled_from(["gelu", "swiglu"])), D=draw(st.sampled_from([16, 48])),
                         F=draw(st.sampled_from([16, 80]))),
                scoring=draw(st.sampled_from(["softmax", "sigmoid"])), seq_len=draw(st.sampled_from([1, 24, 72])),
                skew=draw(st.sampled_from([0.0, 3.0])), seed=draw(st.integers(0, 50)))


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layer_cases())
def test_the_moe_layer_through_the_kernel_for_drawn_cases(case):
    with precision_policy():
        out, ref = _layer(kernel="pallas", **case)
    assert_close(out, ref)


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=needs_devices(2)), pytest.param(4, marks=needs_devices(4))])
def test_ep_moe_with_the_kernel_over_dp(dp):
    """Through ep_moe's shard_map (dp > 1: each device its tokens, the experts' gradients
    summed over dp), against the reference, and its compiled collectives against
    formulas.ep_moe_collectives: one all-reduce of every weight's gradient, nothing more."""
    cfg = _cfg(4, 2, "gelu")
    mesh = mesh_lib.make_mesh(dp=dp, ep=1, devices=jax.devices()[:dp])
    with precision_policy():
        run = expert_verify.run_moe(cfg, mesh, batch_size=2 * dp, seq_len=32, skew=1.0, kernel="pallas")
    assert run.compared[2], run.compared
    assert run.collectives_match, (run.forward, run.backward, run.formula_forward, run.formula_backward)


TRITON = triton_ir.TRITON_CALL


def _forward_and_backward(t: grouped.Tiles):
    def step(h, w):
        y, vjp = jax.vjp(lambda h, w: grouped.grouped_matmul(h, w, t), h, w)
        return y, vjp(y)
    return step


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_the_kernels_lower_to_triton_at_the_benchmarks_moe(dtype):
    """Forward, dh and dW at the GPU benchmark's MoE (t*k = 32768 rows, d_model 1024, d_ff
    2816), lowered for CUDA from this machine: three Triton kernels, Pallas' checks of
    their tiles (powers of two, in bounds) passed, each module passes MLIR's verifier (as
    XLA:GPU requires before compiling it); each grid is what the kernel's docstring says,
    column blocks first: one program per (column block, row tile) and per (dW's N block,
    K block, expert)."""
    n_tiles = (32768 + 8 * (R - 1)) // R
    step = _forward_and_backward(grouped.tiles(jnp.full((8,), 4096), n_tiles))
    h, w = jax.ShapeDtypeStruct((n_tiles * R, 1024), dtype), jax.ShapeDtypeStruct((8, 1024, 2816), dtype)
    assert triton_modules(step, h, w) == ["jaxpar_grouped_matmul"] * 2 + ["jaxpar_grouped_weight_grad"]
    text = jax.jit(step).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3
    for grid in ((2816 // 128, n_tiles, 1), (1024 // 128, n_tiles, 1), (2816 // 128, 1024 // 128, 8)):
        assert "grid_x = %d : i32, grid_y = %d : i32, grid_z = %d : i32" % grid in text, grid


@pytest.mark.parametrize("sizes, K, N", CASES, ids=str)
def test_the_kernels_triton_modules_verify_at_every_tile_width(sizes, K, N):
    """At the oracle's cases (widths whose tiles are 16 to 128), the three Triton modules
    pass MLIR's verifier: what the interpreter runs on CPU is also what a GPU can compile."""
    E, n_tiles = len(sizes), (sum(sizes) + len(sizes) * (R - 1)) // R
    step = _forward_and_backward(grouped.tiles(jnp.asarray(sizes), n_tiles))
    h, w = jax.ShapeDtypeStruct((n_tiles * R, K), jnp.bfloat16), jax.ShapeDtypeStruct((E, K, N), jnp.bfloat16)
    assert len(triton_modules(step, h, w)) == 3


@needs_devices(2)
def test_inside_shard_map_the_kernel_is_typed_as_an_einsum():
    """Traced (not run: the interpreter cannot hold varying types) inside a shard_map that
    checks them: tokens split over dp, w replicated. The gradient of w comes back
    replicated, summed over dp by one psum, as XLA's einsum's would be."""
    mesh = mesh_lib.make_mesh(dp=2, devices=jax.devices()[:2])
    (h, w, _), t = _problem([130, 0, 5, 256], 32, 48, jnp.float32)

    def loss(h, w):
        return jnp.sum(grouped.grouped_matmul(h, w, t, interpret=False) ** 2)
    grad = jax.shard_map(jax.grad(loss, argnums=1), mesh=mesh, in_specs=(P(mesh_lib.DP), P()), out_specs=P())
    text = str(jax.make_jaxpr(grad)(jnp.concatenate([h, h]), w))
    assert text.count("pallas_call") == 3 and text.count("psum") == 1


@pytest.mark.parametrize("options, ep, D, F, says", [
    (dict(kernel="pallas", capacity_factor=1.25), 1, 32, 48, "dropless"),
    (dict(kernel="pallas"), 2, 32, 48, "ep = 1"),
    (dict(kernel="pallas"), 1, 24, 48, "K .*=24.*multiple of 16"),
    (dict(kernel="pallas"), 1, 32, 40, "N .*=40.*multiple of 16"),
    (dict(kernel="triton"), 1, 32, 48, "'xla', 'pallas'")])
def test_a_kernel_that_cannot_run_is_refused_with_the_reason(options, ep, D, F, says):
    with pytest.raises(ConfigError, match=says):
        dispatch.check_kernel(dispatch.MoEOptions(top_k=2, **options), ep, d_model=D, d_ff=F)


def test_ep_moe_refuses_the_kernel_before_computing():
    cfg = _cfg(4, 2, "gelu", D=24)
    p, x, _ = moe_inputs(cfg, 2, 8)
    mesh = mesh_lib.make_mesh(ep=1, devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="d_model|K .*=24"):
        dispatch.ep_moe(p, x, mesh=mesh, cfg=cfg, kernel="pallas")


@pytest.mark.parametrize("requested, spec, platform, auto, expected", [
    ("auto", ParallelSpec(), "gpu", False, "xla"), ("auto", ParallelSpec(), "gpu", True, "pallas"),
    ("auto", ParallelSpec(ep=2), "gpu", True, "xla"), ("auto", ParallelSpec(), "cpu", True, "xla"),
    ("pallas", ParallelSpec(tp=2), "gpu", False, "pallas"), ("xla", ParallelSpec(), "gpu", True, "xla"),
    ("auto", ParallelSpec(tp=4), "gpu", True, "xla")])     # d_ff 96 / 4 = 24: no tile
def test_what_the_trainer_runs_for_its_experts(monkeypatch, requested, spec, platform, auto, expected):
    monkeypatch.setattr(grouped, "PALLAS_AUTO", auto)
    cfg = reference.ModelConfig(d_model=64, d_ff=96, n_experts=4, top_k=2)
    assert recipe.choose_expert_kernel(requested, cfg, spec, platform=platform) == expected


@pytest.mark.parametrize("cfg, spec, platform, says", [
    (reference.ModelConfig(d_model=64, d_ff=96, n_experts=4), ParallelSpec(), "cpu", "interpreter"),
    (reference.ModelConfig(d_model=64, d_ff=96, n_experts=4), ParallelSpec(ep=2), "gpu", r"ep = 1"),
    (reference.ModelConfig(d_model=64, d_ff=96, n_experts=4), ParallelSpec(tp=4), "gpu", "N .*=24"),
    (reference.ModelConfig(d_model=64, d_ff=96), ParallelSpec(), "gpu", "dense model")])
def test_the_trainer_refuses_the_kernel_where_it_cannot_run(cfg, spec, platform, says):
    with pytest.raises(ConfigError, match=says):
        recipe.choose_expert_kernel("pallas", cfg, spec, platform=platform)




@needs_gpu
def test_bfloat16_on_a_gpu_follows_the_float32_definition():
    """bf16 inputs, float32 accumulation: each result within the bf16 rule of the float64
    definition of the same (bf16-rounded) inputs."""
    (h, w, dy), t = _problem([2000, 0, 700, 1200, 129], 1024, 2816, jnp.bfloat16)
    _within(_kernel(h, w, dy, t), _oracle(h, w, dy, t), tolerance(jnp.bfloat16)[0])


@needs_gpu
def test_the_trainer_through_the_kernel_on_a_gpu_follows_the_xla_experts():
    """Three bf16 training steps of a small MoE with expert_kernel="pallas" and "xla",
    same init and batches: the losses agree within the bf16 rule."""
    cfg = reference.ModelConfig(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=256,
                                n_experts=8, top_k=2)
    tokens = jax.random.randint(jax.random.key(0), (8, 257), 0, cfg.vocab)
    runs = {name: training.losses(cfg, tokens, expert_kernel=name) for name in ("pallas", "xla")}
    assert [trainer.expert_matmuls for _, trainer in runs.values()] == ["pallas", "xla"]
    np.testing.assert_allclose(runs["pallas"][0], runs["xla"][0], rtol=tolerance(jnp.bfloat16)[0])


@st.composite
def compositions(draw):
    """Specs at ep = 1 (where the trainer's MoE runs grouped), every other axis drawn."""
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2])) if pp == 1 else 1
    dp = draw(st.sampled_from([1, 2]))
    return ParallelSpec(dp=dp, pp=pp, tp=tp, cp=cp, microbatches=2 * pp,
                        sequence_parallel=tp > 1 and draw(st.booleans()), zero=draw(st.sampled_from([0, 1, 3])),
                        recompute=draw(st.sampled_from(["none", "dots", "full"])))


@needs_devices(8)
@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(compositions())
def test_the_trainers_step_with_the_kernel_lowers_for_a_gpu(monkeypatch, spec):
    """The whole training step with expert_kernel="pallas", in bf16, lowered for CUDA from
    this machine (cross-platform lowering: Pallas emits the Triton kernels, nothing runs)
    inside the trainer's shard_map, which checks varying types: the kernel's operands and
    gradients are typed as an einsum's in every drawn composition; the layer loop's body
    holds at least the 2 Triton kernels of an MoE layer's forward (GeLU's two matmuls) and
    the 4 of its backward (dh and dW of each), and each passes MLIR's verifier."""
    monkeypatch.setattr(recipe, "choose_expert_kernel", lambda *a, **k: "pallas")
    cfg = reference.ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64, vocab=64, n_layers=2,
                                n_experts=4, top_k=2)
    trainer = Trainer(cfg, spec, batch_size=4 * spec.dp, seq_len=16, devices=jax.devices()[:spec.devices],
                      compute_dtype=jnp.bfloat16)
    assert trainer.expert_matmuls == "pallas"
    names = triton_modules(trainer._step, *trainer.abstract_inputs())
    assert names.count("jaxpar_grouped_matmul") >= 4 and names.count("jaxpar_grouped_weight_grad") >= 2, names


@pytest.mark.parametrize("shapes, says", [
    (((256, 32), (4, 32, 48), 2), None),
    (((200, 32), (4, 32, 48), 2), "200 rows.*multiple of 128"),
    (((256, 32), (4, 24, 48), 2), "w's K h's"),
    (((256, 32), (4, 32, 40), 2), "N .*=40"),
    (((256, 32), (4, 32, 48), 3), "n_tiles=2"),
    (((256,), (4, 32, 48), 2), "rank 2"),
    (((256, 32), (4, 32, 48), 2, jnp.bfloat16), "one dtype")])
def test_the_kernel_refuses_operands_it_cannot_take(shapes, says):
    (hs, ws, n_tiles), dtype = shapes[:3], (shapes[3] if len(shapes) > 3 else jnp.float32)
    h, w = jnp.zeros(hs, jnp.float32), jnp.zeros(ws, dtype)
    t = grouped.tiles(jnp.array([100, 0, 20, 10]), n_tiles)
    if says is None:
        assert grouped.grouped_matmul(h, w, t, interpret=True).shape == (256, 48)
        return
    with pytest.raises(ConfigError, match=says):
        grouped.grouped_matmul(h, w, t, interpret=True)
