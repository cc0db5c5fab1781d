"""bf16 mixed precision: Trainer(compute_dtype=jnp.bfloat16) keeps float32 master weights and
AdamW state, runs the layers in bf16 (the attention's softmax and the loss in float32), and
trains as the unsharded model with the same casts does (reference.loss(compute_dtype=)).

The bounds and why they are what they are: jaxpar.train.verify.MIXED_BOUNDS."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.memory.states import PRECISIONS
from jaxpar.train import ParallelSpec
from jaxpar.train.step import Trainer
from jaxpar.testing import tolerance
from jaxpar.train.verify import DENSE, MIXED_BOUNDS, OPTIM, mixed_errors, mixed_within, reference_run

STEPS = 4
# a pp=1 mesh with dp, a pp=2 mesh (2 microbatches), sequence parallelism
MESHES = {
    "dp2 tp2": ParallelSpec(dp=2, tp=2),
    "dp2 pp2 tp2": ParallelSpec(dp=2, pp=2, tp=2, microbatches=2),
    "tp2 sp": ParallelSpec(tp=2, sequence_parallel=True),
}


def _trainer(cache, spec: ParallelSpec, compute_dtype=jnp.bfloat16) -> Trainer:
    return cache(DENSE, spec, OPTIM, batch_size=8, seq_len=16, devices=jax.devices()[:spec.devices],
                   compute_dtype=compute_dtype)


@pytest.fixture(scope="module", params=list(MESHES))
def run(request, trainer_cache):
    """(trainer, its errors and the float32-vs-bf16 scale, `mixed_errors`) of STEPS bf16 steps."""
    trainer = _trainer(trainer_cache, MESHES[request.param])
    return trainer, *mixed_errors(trainer, STEPS)


def test_bf16_training_equals_the_unsharded_model_with_the_same_casts(run):
    _, errors, scale = run
    for name, bound in MIXED_BOUNDS.items():
        assert errors[name] <= bound, (name, errors, scale)
    assert errors["updates"] <= tolerance(jnp.float32)[0], errors      # AdamW in float32, on the same gradients
    # at the same weights (the first step) the loss is the bf16 model's, not the float32
    # one's: nearer the first than half the distance between the two
    assert errors["first step"] <= scale["first step"] / 2, (errors, scale)
    assert mixed_within(errors, scale)


def test_the_unsharded_bf16_loss_falls():
    """What the runs above are held to within 2^-8 falls, step after step."""
    losses = reference_run(DENSE, OPTIM, STEPS, 8, 16, "float32", "bfloat16")[0]
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0), losses


def test_the_state_is_float32(run):
    """Master weights and both AdamW moments float32; the step and AdamW's counts int32."""
    trainer = run[0]
    state, _ = trainer.step(trainer.init(), np.zeros((trainer.batch_size, trainer.seq_len + 1), np.int32))
    floats = [a.dtype for a in jax.tree.leaves((state.params, state.opt)) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert floats and set(floats) == {jnp.dtype(jnp.float32)}
    assert jax.tree.map(lambda a: a.dtype, state) == jax.tree.map(lambda a: a.dtype, trainer.abstract_state())


def _dot_operand_types(lowered_text: str) -> list[str]:
    """The operand types of every dot_general in a lowered (StableHLO) program, e.g. 'bf16'."""
    sigs = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", lowered_text)
    assert sigs, "no dot_general in the program"
    return [t.rstrip(">").split("x")[-1] for pair in sigs for t in pair]      # tensor<4x16xbf16> -> bf16


def test_the_layers_run_in_bf16(run):
    """Every matmul of the step (forward and backward, all layers, the LM head) takes bf16
    operands in the program JAX hands XLA. XLA:CPU then widens bf16 dots to float32 (it has
    no bf16 matmul), so on CPU the compiled program's dots read float32 copies of bf16
    values; what stays bf16 there is the data: the weights' copy, the activations."""
    trainer = run[0]
    assert set(_dot_operand_types(trainer.lower().as_text())) == {"bf16"}
    assert "bf16[" in trainer.compiled.as_text()


# the primitives that move data between devices (pvary, axis_index and the like move nothing)
COMMUNICATING = {"psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_to_all", "all_gather",
                 "all_gather_invariant", "reduce_scatter", "psum_scatter"}


def _collectives(trainer: Trainer):
    """(primitive, mesh axes, operand dtypes) of every collective in the step's jaxpr."""
    tokens = jax.ShapeDtypeStruct((trainer.batch_size, trainer.seq_len + 1), jnp.int32)

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            if axes is not None and eqn.primitive.name in COMMUNICATING:
                yield eqn.primitive.name, tuple(axes) if isinstance(axes, (tuple, list)) else (axes,), \
                    {str(v.aval.dtype) for v in eqn.invars}
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)
    return list(walk(trainer._step.trace(trainer.abstract_state(), tokens).jaxpr.jaxpr))


def test_gradients_are_reduced_in_float32_activations_travel_in_bf16(run):
    """Every collective over a batch axis (the gradient reduction, the loss) moves float32:
    the gradients leave bf16 before it. Inside the layers the tp all-reduces of activations
    (f and g) and, over pp, the stage-to-stage sends move bf16; the cross-entropy's max and
    sums over tp are float32."""
    trainer = run[0]
    found = _collectives(trainer)
    batch = set(trainer.local.request.batch_axes)
    over_batch = [c for c in found if batch & set(c[1])]
    assert over_batch or not batch
    assert all(dtypes == {"float32"} for _, _, dtypes in over_batch), over_batch
    assert any(axes == ("tp",) and dtypes == {"bfloat16"} for _, axes, dtypes in found)
    assert any(name == "pmax" and axes == ("tp",) and dtypes == {"float32"} for name, axes, dtypes in found)
    sends = [dtypes for name, axes, dtypes in found if name == "ppermute" and axes == ("pp",)]
    assert bool(sends) == (trainer.spec.pp > 1) and all(dtypes == {"bfloat16"} for dtypes in sends)


def test_the_float32_trainer_stays_float32(trainer_cache):
    trainer = _trainer(trainer_cache, MESHES["dp2 tp2"], None)
    assert trainer.compute_dtype is None
    assert set(_dot_operand_types(trainer.lower().as_text())) == {"f32"}
    assert _trainer(trainer_cache, MESHES["dp2 tp2"], jnp.float32).compute_dtype is None   # the same as dtype: no cast


def _shard_bytes(trainer: Trainer, tree, shardings) -> tuple[int, int]:
    """(bytes one device holds of tree's floating leaves, of its other leaves)."""
    floating = other = 0
    for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        n = int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
        floating, other = (floating + n, other) if jnp.issubdtype(a.dtype, jnp.floating) else (floating, other + n)
    return floating, other


@pytest.mark.parametrize("name", ["dp2 tp2", "dp2 pp2 tp2"])
def test_the_state_is_twelve_bytes_per_parameter(name, trainer_cache):
    """The compiled step's arguments are the state and the tokens: float32 master weights and
    AdamW's two moments, memory.states' mixed-precision optimizer bytes (12 per parameter of
    the device's shard), the step and AdamW's counts, the device's rows of the int32 tokens
    (split over dp, `Trainer.token_sharding`). The bf16 weight copy and the bf16 gradients
    are no argument: they live in the step's temporary memory."""
    trainer = _trainer(trainer_cache, MESHES[name])
    abstract = trainer.abstract_state()
    params, _ = _shard_bytes(trainer, abstract.params, trainer.shardings.params)
    state, scalars = _shard_bytes(trainer, abstract, trainer.shardings)
    per_param = PRECISIONS["mixed"][2]
    assert per_param == 12 and state == per_param * params // 4        # params: float32, 4 bytes each
    tokens = trainer.batch_size // trainer.spec.dp * (trainer.seq_len + 1) * 4
    assert scalars <= 16                                                # the step and AdamW's counts
    memory = trainer.compiled.memory_analysis()
    assert memory.argument_size_in_bytes == state + scalars + tokens
    # the same state as the float32 trainer's, and no more temporary memory (docs/train.md,
    # "Mixed precision", has the measured temp bytes of both)
    full = _trainer(trainer_cache, MESHES[name], None).compiled.memory_analysis()
    assert full.argument_size_in_bytes == memory.argument_size_in_bytes
    assert memory.temp_size_in_bytes <= full.temp_size_in_bytes


@pytest.mark.parametrize("bad", [jnp.float16, jnp.int32, "float8_e4m3fn", "f33", 3])
def test_bad_compute_dtypes_are_refused(bad, trainer_cache):
    with pytest.raises(ConfigError, match="compute_dtype="):
        _trainer(trainer_cache, MESHES["dp2 tp2"], bad)


def test_float64_compute_needs_x64(trainer_cache):
    if jax.config.jax_enable_x64:
        pytest.skip("x64 is on")
    with pytest.raises(ConfigError, match="compute_dtype=.*jax_enable_x64"):
        _trainer(trainer_cache, MESHES["dp2 tp2"], jnp.float64)


def test_the_reference_casts_only_when_asked():
    """reference.loss(compute_dtype=None) is the float32 loss bit for bit; with bf16 its
    gradients come back float32 and near the float32 ones (bf16's rounding, 2^-8)."""
    params = reference.init_params(jax.random.key(0), DENSE)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, DENSE.vocab, (4, 9)), jnp.int32)
    full, g_full = jax.jit(jax.value_and_grad(reference.loss), static_argnums=2)(params, tokens, DENSE)
    grad = jax.jit(jax.value_and_grad(reference.loss), static_argnums=(2, 3))
    for same in (None, jnp.float32):       # nothing to cast: the same bits
        loss, grads = grad(params, tokens, DENSE, same)
        assert float(loss) == float(full) and all(jax.tree.leaves(jax.tree.map(jnp.array_equal, grads, g_full)))
    mixed, g_mixed = grad(params, tokens, DENSE, jnp.bfloat16)
    assert mixed.dtype == jnp.float32 and {g.dtype for g in jax.tree.leaves(g_mixed)} == {jnp.dtype(jnp.float32)}
    assert 0 < abs(float(mixed) - float(full)) / float(full) < 2 ** -8
    for a, b in zip(jax.tree.leaves(g_mixed), jax.tree.leaves(g_full)):
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 5e-2


@pytest.mark.parametrize("spec", [ParallelSpec(microbatches=2), ParallelSpec(pp=2, microbatches=2)],
                         ids=["pp1 m2", "pp2 m2"])
def test_a_bf16_state_stays_bf16_step_after_step(spec):
    """Trainer(dtype=bfloat16): weights and AdamW moments in bf16. The microbatches' gradients
    add up in float32; the step hands the state back in the dtypes it took, so the next step
    runs (it raised TypeError at step 2 when the moments came back float32)."""
    trainer = Trainer(DENSE, spec, OPTIM, batch_size=4, seq_len=8, devices=jax.devices()[:spec.devices],
                      dtype=jnp.bfloat16)
    state = trainer.init()
    dtypes = jax.tree.map(lambda a: a.dtype, state)
    assert jnp.dtype(jnp.bfloat16) in jax.tree.leaves(dtypes)
    tokens = np.random.default_rng(0).integers(0, DENSE.vocab, (3, 4, 9))
    losses = []
    for batch in tokens:
        state, metrics = trainer.step(state, batch)
        assert jax.tree.map(lambda a: a.dtype, state) == dtypes
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)), losses
