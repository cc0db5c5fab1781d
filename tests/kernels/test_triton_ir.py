"""kernels.triton_ir: the Triton modules Pallas emits for CUDA, read and verified on CPU."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration
from jax.experimental import pallas as pl

from jaxpar.kernels import flash, grouped, triton_ir


def _loop_kernel(n_ref, x_ref, o_ref, *, bound):
    """Sums x's rows n_ref[0] times over; the loop's bound as `bound` builds it."""
    steps = bound(n_ref[0])
    o_ref[...] = jax.lax.fori_loop(0, steps, lambda i, acc: acc + x_ref[...], jnp.zeros_like(x_ref[...]))


def _call(bound):
    def run(n, x):
        return pl.pallas_call(functools.partial(_loop_kernel, bound=bound), name="loop",
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), **flash.params(False))(n, x)
    return run


ARGS = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((16, 16), jnp.float32))


def test_a_module_mlir_rejects_is_named(monkeypatch):
    """A Triton module that fails MLIR's verifier (here: its function's terminator removed
    after Pallas built it) fails `modules` with the kernel's name and MLIR's reason, as
    XLA:GPU would refuse to compile it. (The grouped kernel met a real one: jax 0.10's
    Triton lowering of jnp.where(pred, 4, 0) gives a loop an i1 bound; kernels.grouped
    says so where it multiplies instead.)"""
    build = registration.lowering.lower_jaxpr_to_triton_module

    def broken(*a, **k):
        result = build(*a, **k)
        func = result.module.body.operations[0]
        func.regions[0].blocks[0].operations[len(func.regions[0].blocks[0].operations) - 1].erase()
        return result
    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", broken)
    with pytest.raises(AssertionError, match="(?s)loop: .*no terminator"):
        triton_ir.modules(_call(lambda n: (n > 0).astype(jnp.int32) * 4), *ARGS)


def test_a_module_that_verifies_is_read_with_its_launch():
    [module] = triton_ir.modules(_call(lambda n: (n > 0).astype(jnp.int32) * 4), *ARGS)
    assert module.name == "loop" and (module.num_warps, module.num_stages) == (4, 2)
    assert "tt.func public @loop" in module.asm and "scf.for" in module.asm


def test_each_kernels_launch_is_read_from_the_program():
    """The grouped kernels launch 8 warps over 3 stages; the attention blocks 4 over 2."""
    t = grouped.tiles(jnp.array([200, 56]), 3)
    h, w = jax.ShapeDtypeStruct((3 * grouped.TILE_ROWS, 32), jnp.bfloat16), jax.ShapeDtypeStruct((2, 32, 64),
                                                                                                   jnp.bfloat16)
    found = triton_ir.modules(lambda h, w: jax.grad(lambda h, w: grouped.grouped_matmul(h, w, t).sum(),
                                                    argnums=(0, 1))(h, w), h, w)
    assert {(m.name, m.num_warps, m.num_stages) for m in found} == {("jaxpar_grouped_matmul", 8, 3),
                                                                    ("jaxpar_grouped_weight_grad", 8, 3)}
    q, k = jax.ShapeDtypeStruct((1, 1, 2, 64, 32), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1, 64, 32), jnp.bfloat16)
    [forward] = triton_ir.modules(lambda q, k: flash.block_forward(q, k, k, scale=0.2, causal=True), q, k)
    assert (forward.name, forward.num_warps, forward.num_stages) == ("jaxpar_block_forward", 4, 2)


def test_left_at_their_default_the_kernels_run_where_they_are():
    """interpret=None picks by backend: on CPU the interpreter (what interpret=True runs,
    to the bit), on a GPU Triton; no 'only interpret mode' error for a caller who did not
    choose."""
    t = grouped.tiles(jnp.array([100, 28]), 2)
    h, w = jnp.ones((2 * grouped.TILE_ROWS, 32)), jnp.ones((2, 32, 16))
    q, k = jnp.ones((1, 1, 2, 16, 16)), jnp.ones((1, 1, 16, 16))
    if not flash.interpret_here():
        pytest.skip("on a GPU the default compiles through Triton: the kernels' GPU tests cover it")
    assert (grouped.grouped_matmul(h, w, t) == grouped.grouped_matmul(h, w, t, interpret=True)).all()
    for a, b in zip(flash.block_forward(q, k, k, scale=0.25, causal=True),
                    flash.block_forward(q, k, k, scale=0.25, causal=True, interpret=True)):
        assert (a == b).all()
