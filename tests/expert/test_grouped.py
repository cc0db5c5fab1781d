"""The grouped dropless path (expert/grouped.py) against reference.moe: output, input
gradient, router gradient and every expert's gradient, for GeLU and SwiGLU, E 2-16, top-k
1, 2, k < E and k = E, softmax and sigmoid routers (with the selection bias), one device
and dp = 2; float64 near 1e-12; drawn cases (hypothesis); the block slots by hand; when it is
chosen (`MoEOptions.grouped`); and that it does the routed work, not the padded buffer's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.expert import dispatch, grouped
from jaxpar.expert.router import expert_load, route
from jaxpar.expert.verify import moe_inputs
from jaxpar.testing import assert_close, max_abs_diff


def cfg_for(E=8, k=2, mlp="gelu", D=16, F=24):
    return reference.ModelConfig(n_layers=1, d_model=D, d_ff=F, n_experts=E, top_k=k, mlp=mlp)


def grouped_and_reference(cfg, *, scoring="softmax", bias=None, dp=1, batch_size=4, seq_len=8, skew=1.5,
                          dtype=jnp.float32, seed=0):
    """((y, grads) of ep_moe with grouped=True, the same of reference.moe, MoEStats, x)."""
    p, x, dy = moe_inputs(cfg, batch_size, seq_len, skew=skew, dtype=dtype, seed=seed)
    m = mesh_lib.make_mesh(dp=dp, ep=1, devices=jax.devices()[:dp])
    if bias is not None:
        bias = jnp.asarray(np.random.default_rng(seed).standard_normal(cfg.n_experts), dtype) * bias
    ours = jax.jit(lambda p, x: dispatch.ep_moe(p, x, mesh=m, cfg=cfg, scoring=scoring, bias=bias, grouped=True))
    ref_p = {} if bias is None else {"router_bias": bias}
    ref = lambda p, x: reference.moe(p | ref_p, x, top_k=cfg.top_k, mlp=cfg.mlp, scoring=scoring)
    y, vjp, stats = jax.vjp(ours, p, x, has_aux=True)
    y_ref, vjp_ref = jax.vjp(ref, p, x)
    return (y, vjp(dy)), (y_ref, vjp_ref(dy)), stats, (p, x, bias)


# (E, k, mlp, scoring, bias scale, dp)
CASES = [
    (8, 2, "gelu", "softmax", None, 1),
    (8, 2, "swiglu", "softmax", None, 2),
    (4, 1, "gelu", "softmax", None, 1),
    (4, 3, "swiglu", "softmax", None, 1),
    (2, 2, "gelu", "softmax", None, 2),          # k = E: every expert takes every token
    (16, 2, "swiglu", "softmax", None, 1),
    (8, 2, "gelu", "sigmoid", None, 1),
    (8, 2, "swiglu", "sigmoid", 1.0, 2),         # DeepSeek-V3's router with its selection bias
    (6, 1, "gelu", "sigmoid", 2.0, 1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_grouped_matches_the_reference(case):
    E, k, mlp, scoring, bias, dp = case
    out, ref, stats, (p, x, b) = grouped_and_reference(cfg_for(E, k, mlp), scoring=scoring, bias=bias, dp=dp)
    assert_close(out, ref)
    if k > 1:                       # (renormalised top-1 gates are the constant 1: no router gradient)
        assert float(jnp.max(jnp.abs(out[1][0]["router"]))) > 0
    r = route(p["router"], x.reshape(-1, x.shape[-1]), top_k=k, scoring=scoring, bias=b)
    np.testing.assert_array_equal(stats.tokens_per_expert, expert_load(r.experts, E))
    assert stats.dropped_per_expert.sum() == 0 and stats.drop_rate == 0.0
    assert stats.capacity == x.shape[0] * x.shape[1] // dp                 # dropless: C = t, as the padded path


def test_float64_agrees_near_1e_12(x64):
    out, ref, _, _ = grouped_and_reference(cfg_for(8, 2, "swiglu"), dtype=jnp.float64, dp=2)
    assert out[0].dtype == jnp.float64
    assert max_abs_diff(out, ref) < 1e-12


@st.composite
def cases(draw):
    E = draw(st.sampled_from([8, 4, 2, 5, 16]))
    k = draw(st.sampled_from([n for n in (2, 1, 3, E) if n <= E]))
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    return dict(cfg=cfg_for(E, k, draw(st.sampled_from(["gelu", "swiglu"])), D=draw(st.sampled_from([8, 16])),
                            F=draw(st.sampled_from([8, 24]))),
                scoring=scoring, bias=draw(st.sampled_from([None, 1.0])) if scoring == "sigmoid" else None,
                dp=draw(st.sampled_from([1, 2])), batch_size=2, seq_len=draw(st.sampled_from([1, 3, 8])),
                skew=draw(st.sampled_from([0.0, 1.0, 3.0])), seed=draw(st.integers(0, 50)))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_grouped_matches_the_reference_for_drawn_cases(case):
    out, ref, stats, _ = grouped_and_reference(**case)
    assert_close(out, ref)
    assert stats.drop_rate == 0.0
    assert stats.tokens_per_expert.sum() == 2 * case["seq_len"] * case["cfg"].top_k


@pytest.mark.parametrize("experts, slot, block_expert", [
    # flat (token-major) 0 2 2 0 0 1 2 0: sizes 4, 1, 3 -> runs of 4, 2, 4 rows from 0, 4, 6
    ([[0, 2], [2, 0], [0, 1], [2, 0]], [[0, 6], [7, 1], [2, 4], [8, 3]], [0, 0, 1, 2, 2]),
    # sizes 4, 2, 2 -> runs of 4, 2, 2: four blocks filled, the fifth (rows 8, 9) empty
    ([[0, 1], [0, 2], [0, 1], [0, 2]], [[0, 4], [1, 6], [2, 5], [3, 7]], [0, 0, 1, 2, 2]),
])
def test_block_slots_by_hand(experts, slot, block_expert):
    """t=4, k=2, E=3, blocks of 2 rows: each expert's rows one run in token order, rounded
    up to whole blocks; (t*k + E*(b-1)) // b = 5 blocks, the bound."""
    got_slot, got_blocks, sizes = grouped.block_slots(jnp.array(experts, jnp.int32), 3, 2)
    np.testing.assert_array_equal(got_slot, slot)
    np.testing.assert_array_equal(got_blocks, block_expert)
    np.testing.assert_array_equal(sizes, np.bincount(np.ravel(experts), minlength=3))


def test_grouped_runs_where_it_applies():
    """None: grouped exactly when dropless with every expert local (ep = 1), which is what
    the trainer's `MoEOptions.of(cfg)` asks for."""
    options = dispatch.MoEOptions.of(cfg_for())
    assert options.grouped is None
    assert dispatch.runs_grouped(options, 1) and not dispatch.runs_grouped(options, 2)
    assert not dispatch.runs_grouped(dispatch.MoEOptions.of(cfg_for(), capacity_factor=1.25), 1)
    assert not dispatch.runs_grouped(dispatch.MoEOptions.of(cfg_for(), grouped=False), 1)


def test_grouped_does_the_routed_work_not_the_padded_buffers():
    """E=8, top-2, t=64: the padded buffer runs E*t = 512 rows through each matmul, the
    grouped path at most t*k + E*(b-1) = 128 + 8*7 = 184 (b = 128/16 = 8): under half."""
    cfg = cfg_for(8, 2, D=32, F=64)
    p, x, _ = moe_inputs(cfg, 8, 8)
    m = mesh_lib.make_mesh(ep=1, devices=jax.devices()[:1])

    def flops(g):
        step = jax.jit(lambda p, x: dispatch.ep_moe(p, x, mesh=m, cfg=cfg, grouped=g)[0])
        return step.lower(p, x).compile().cost_analysis()["flops"]
    matmuls = lambda rows: 2 * rows * cfg.d_model * cfg.d_ff * 2        # w_up and w_down
    assert matmuls(184) < flops(True) < flops(False) / 2
    assert flops(False) > matmuls(512)
