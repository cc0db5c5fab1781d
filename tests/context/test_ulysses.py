"""Ulysses and 2-D (Ulysses x ring) attention against reference.attention: output, dQ, dK,
dV on several meshes, grouped-query with KV heads split and repeated, causal or not, the
4 all-to-alls of each program (and the ring's permutes) against the formulas, float64."""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context import zigzag
from jaxpar.context import ulysses
from jaxpar.context.verify import AttentionCase, attention_inputs, run_attention
from jaxpar.testing import assert_close, max_abs_diff, value_and_grads

# (dp, cp, n_kv_heads, causal): K split over cp (K % cp == 0) or repeated (cp % K == 0)
ULYSSES = [
    (8, 1, 2, True),
    (4, 2, 2, True),
    (2, 4, 8, False),
    (2, 4, 2, True),     # repeated: each KV head twice
    (1, 8, 8, True),
    (1, 8, 1, False),    # MQA: one KV head repeated 8 times
]


@functools.cache
def _ulysses(dp, cp, kv, causal):
    return run_attention("ulysses", mesh_lib.make_mesh(dp=dp, cp=cp),
                         AttentionCase(causal=causal, batch_size=2 * dp, n_kv_heads=kv))


@pytest.mark.parametrize("case", ULYSSES, ids=str)
def test_ulysses_matches_reference_and_formula(case):
    run = _ulysses(*case)
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward and run.backward == run.formula_backward
    cp = case[1]
    assert run.forward.get("all-to-all", (0, 0))[0] == (4 if cp > 1 else 0)
    assert run.backward.get("all-to-all", (0, 0))[0] == (4 if cp > 1 else 0)


# (mesh sizes, layout, n_kv_heads, relayout)
HYBRID = [
    (dict(dp=2, cp=2, ucp=2), "zigzag", 2, True),
    (dict(cp=2, ucp=4), "zigzag", 8, False),
    (dict(cp=4, ucp=2), "contiguous", 2, True),
    (dict(cp=4, ucp=2), "zigzag", 1, True),
    (dict(cp=1, ucp=8), "contiguous", 8, True),
    (dict(cp=8, ucp=1), "zigzag", 2, True),
]


@pytest.mark.parametrize("sizes, layout, kv, relayout", HYBRID, ids=str)
def test_hybrid_matches_reference_and_formula(sizes, layout, kv, relayout):
    dp = sizes.get("dp", 1)
    run = run_attention("hybrid", mesh_lib.make_mesh(**sizes),
                        AttentionCase(layout=layout, relayout=relayout, batch_size=2 * dp, n_kv_heads=kv))
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward and run.backward == run.formula_backward


def test_ulysses_matches_jax_dot_product_attention():
    m = mesh_lib.make_mesh(dp=2, cp=4)
    q, k, v, do = attention_inputs(4, 16, 8, 4, 4)
    got = value_and_grads(lambda q, k, v: ulysses.ulysses_attention(q, k, v, mesh=m), q, k, v, ct=do)
    want = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v, ct=do)
    assert_close(got, want)


@pytest.mark.parametrize("method, sizes", [("ulysses", dict(dp=2, cp=4)), ("hybrid", dict(dp=2, cp=2, ucp=2))])
def test_float64_agrees_near_1e_13(x64, method, sizes):
    run = run_attention(method, mesh_lib.make_mesh(**sizes), AttentionCase(layout="zigzag", batch_size=4,
                                                                            dtype=jnp.float64))
    assert max_abs_diff(run.out, run.ref) < 1e-13
    assert_close(run.out, run.ref)


@pytest.mark.parametrize("cp, kv", [(2, 1), (4, 2), (8, 8)])
def test_ulysses_on_a_zigzag_sequence_masks_by_true_position(cp, kv):
    """The tokens held in zigzag order (as the composed model holds them under
    layout="zigzag"): the gathered sequence is in that order, and the causal mask must
    follow the tokens' positions, not their places. Output and dQ, dK, dV against the
    reference in natural order, moved into the layout."""
    m = mesh_lib.make_mesh(dp=8 // cp, cp=cp)
    q, k, v, do = attention_inputs(8 // cp, 4 * cp, 8, kv, 4)
    zz = lambda a: zigzag.to_layout(a, cp, "zigzag", axis=1)
    out, grads = value_and_grads(lambda q, k, v: ulysses.ulysses_attention(q, k, v, mesh=m, layout="zigzag"),
                                 zz(q), zz(k), zz(v), ct=zz(do))
    want, want_grads = value_and_grads(lambda q, k, v: reference.attention(q, k, v, causal=True), q, k, v, ct=do)
    assert_close(out, zz(want))
    assert_close(grads, tuple(zz(g) for g in want_grads))
    plain = jax.jit(lambda q, k, v: ulysses.ulysses_attention(q, k, v, mesh=m))(zz(q), zz(k), zz(v))
    assert max_abs_diff(plain, zz(want)) > 1e-3          # without the layout the mask is wrong
