"""ep_moe against reference.moe (dropless) and against the same drop rule written densely
(capacity): output, input gradient, router gradient and every expert's gradient, for ep in
{1, 2, 4, 8} with dp filling the devices; the collectives of both programs against the
formula, bytes independent of the experts' width; dispatch and combine exact on rank-coded
tokens; float64; exercise 7; the lecture's experiment."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.expert import dispatch, formulas
from jaxpar.expert.verify import imbalance_experiment, moe_inputs, reference_capacity, run_moe
from jaxpar.testing import assert_close, max_abs_diff, tolerance


def cfg_for(E=8, k=2, mlp="gelu", F=32):
    return reference.ModelConfig(n_layers=1, d_model=16, d_ff=F, n_experts=E, top_k=k, mlp=mlp)


# (dp, ep, E, k, mlp, capacity_factor, drop)
CASES = [
    (8, 1, 8, 2, "gelu", None, "position"),
    (4, 2, 8, 2, "swiglu", None, "position"),
    (2, 4, 8, 1, "gelu", None, "position"),
    (1, 8, 8, 8, "gelu", None, "position"),
    (1, 8, 16, 2, "swiglu", None, "position"),
    (2, 4, 8, 2, "gelu", 1.25, "position"),
    (2, 4, 8, 2, "gelu", 1.0, "probability"),
    (1, 8, 8, 2, "swiglu", 0.5, "position"),
    (4, 2, 4, 2, "gelu", 1.5, "probability"),
]
# C, slots per expert per device, by hand: every case has t = 2*dp*ep*8 / (dp*ep) = 16 tokens
# per device; dropless C = t; else ceil(cf * t * k / E): 1.25*16*2/8 = 5, 1.0*16*2/8 = 4,
# 0.5*16*2/8 = 2, 1.5*16*2/4 = 12
HAND_CAPACITY = {None: 16, 1.25: 5, 1.0: 4, 0.5: 2, 1.5: 12}


@functools.cache
def _run(dp, ep, E, k, mlp, cf, drop):
    return run_moe(cfg_for(E, k, mlp), mesh_lib.make_mesh(dp=dp, ep=ep), batch_size=2 * dp * ep, seq_len=8,
                   capacity_factor=cf, drop=drop, skew=1.5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ep_moe_matches_reference_and_formula(case):
    run = _run(*case)
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward and run.backward == run.formula_backward
    ep, cf = case[1], case[5]
    assert run.stats.capacity == run.capacity == HAND_CAPACITY[cf]
    assert run.forward.get("all-to-all", (0, 0))[0] == (2 if ep > 1 else 0)
    assert run.backward.get("all-to-all", (0, 0))[0] == (2 if ep > 1 else 0)
    if cf is None:
        assert run.stats.drop_rate == 0.0 and run.stats.dropped_per_expert.sum() == 0     # dropless: nothing drops
    else:
        assert run.stats.drop_rate > 0          # the skewed router overflows some expert
    total = run.stats.tokens_per_expert.sum() + run.stats.dropped_per_expert.sum()
    assert total == 2 * case[0] * ep * 8 * case[3]              # every (token, slot) counted once


@pytest.mark.parametrize("tokens,k,E,cf,C", [
    (16, 2, 8, 1.25, 5), (16, 2, 8, 1.0, 4), (16, 2, 8, 0.5, 2), (16, 2, 4, 1.5, 12), (16, 2, 8, None, 16),
    (6, 1, 4, 1.25, 2),          # 1.875 rounds up
    (12, 2, 8, 1.25, 4),         # 3.75 rounds up
    (16, 2, 8, 10.0, 16),        # 40 slots asked, clamped to t: a token picks an expert once
    (16, 1, 64, 0.5, 1),         # 0.125 rounds up to the least, 1
])
def test_capacity_by_hand(tokens, k, E, cf, C):
    """ceil(cf * t * k / E), clamped to [1, t]; dropless t. The library's and the reference's."""
    assert reference_capacity(tokens, k, E, cf) == C
    assert formulas.capacity(tokens, k, E, cf) == C


def test_float64_agrees_near_1e_12(x64):
    run = run_moe(cfg_for(), mesh_lib.make_mesh(dp=2, ep=4), batch_size=8, capacity_factor=1.25, dtype=jnp.float64,
                  skew=1.5)
    assert run.out[0].dtype == jnp.float64
    assert max_abs_diff(run.out, run.ref) < 1e-12
    assert run.stats.capacity == run.capacity == 3         # t = 8 tokens per device: ceil(1.25*8*2/8)


def test_all_to_all_bytes_do_not_change_when_the_ffn_width_doubles():
    a = _run(2, 4, 8, 2, "gelu", 1.25, "position")
    b = run_moe(cfg_for(F=64), mesh_lib.make_mesh(dp=2, ep=4), batch_size=16, capacity_factor=1.25, skew=1.5)
    assert a.forward["all-to-all"] == b.forward["all-to-all"]
    assert a.backward["all-to-all"] == b.backward["all-to-all"]
    assert a.backward["all-reduce"][1] < b.backward["all-reduce"][1]   # the weight gradients do grow


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dispatch_and_combine_are_exact_on_rank_coded_tokens(ep):
    """Token i of device r is the row 1000*r + i; experts chosen as (r + i) % E, k=1,
    gate 1. Every device must receive exactly the rows routed to its experts, at the
    positions of the drop rule, and get each of its own rows back unchanged."""
    E, t, D, C = 2 * ep, 6, 3, 6
    m = mesh_lib.make_mesh(ep=ep, devices=jax.devices()[:ep])

    def shard(x):
        r = jax.lax.axis_index("ep")
        tokens = jnp.arange(t)
        experts = ((r + tokens) % E)[:, None]
        buf, slot, keep = dispatch.pack(x, experts, jnp.ones((t, 1)), n_experts=E, capacity=C, drop="position")
        recv = dispatch.exchange(buf.reshape(ep, 2, C, D), "ep")
        back = dispatch.exchange(recv, "ep")
        return recv[None], dispatch.unpack(back.reshape(E * C, D), slot, keep, jnp.ones((t, 1)))

    x = (1000 * jnp.arange(ep)[:, None] + jnp.arange(t)[None, :]).astype(jnp.float32).reshape(ep * t, 1)
    x = jnp.broadcast_to(x, (ep * t, D))
    recv, y = jax.jit(jax.shard_map(shard, mesh=m, in_specs=P("ep"), out_specs=(P("ep"), P("ep"))))(x)
    np.testing.assert_array_equal(y, x)                                 # combine(dispatch(x)) == x exactly
    recv = np.asarray(recv)                                             # [dest, src, local expert, C, D]
    for dest in range(ep):
        for src in range(ep):
            for j in range(2):
                e = 2 * dest + j
                want = [1000 * src + i for i in range(t) if (src + i) % E == e]
                got = recv[dest, src, j, :, 0]
                np.testing.assert_array_equal(got[:len(want)], want)     # in token order
                np.testing.assert_array_equal(got[len(want):], 0)         # empty slots are zero


def test_exercise_7_dispatch_bytes():
    ex = formulas.exercise_7()
    assert ex["dispatch"] / 1e6 == pytest.approx(462.4, abs=0.1)        # about 462 MB
    assert ex["forward"] / 1e9 == pytest.approx(0.92, abs=0.01)
    assert ex["forward_backward"] / 1e9 == pytest.approx(1.85, abs=0.01)


def test_the_lectures_imbalance_experiment():
    rows = imbalance_experiment()
    dropless = rows[0]
    assert dropless["drop_rate"] == 0.0 and dropless["imbalance"] > 1.5      # the skew loads rank 0
    rates = [r["drop_rate"] for r in rows]
    assert rates == sorted(rates)                      # less capacity, more drops
    assert all(sum(r["tokens_per_rank"]) + r["drop_rate"] * 16 * 64 * 2 == pytest.approx(16 * 64 * 2) for r in rows)


def sigmoid_moe(p: dict, x, *, bias, top_k: int):
    """DeepSeek-V3's routed MoE written densely from its definition: scores s = sigmoid(x W);
    expert e is chosen for a token when fewer than k experts have a higher s + b; the
    gates are the chosen s over their sum (b only chooses); every expert runs on every
    token and the outputs are mixed by the gates. x [t, D]."""
    s = jax.nn.sigmoid(x @ p["router"])                                       # [t, E]
    c = s + bias
    chosen = jnp.sum(c[:, None, :] > c[:, :, None], axis=-1) < top_k         # [t, E]: rank < k
    gates = jnp.where(chosen, s, 0.0)
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    out = jnp.zeros_like(x)
    for e in range(s.shape[-1]):
        out = out + gates[:, e:e + 1] * reference.mlp({"w_up": p["w_up"][e], "w_down": p["w_down"][e]}, x)
    return out


def test_sigmoid_router_with_selection_bias_matches_its_dense_reference():
    """The sharded layer (dp2 x ep4, dropless) with DeepSeek-V3's router against
    sigmoid_moe: output, input gradient, router gradient and every expert's."""
    cfg = cfg_for()
    m = mesh_lib.make_mesh(dp=2, ep=4)
    rng = np.random.default_rng(3)
    p = {"router": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32),
         "w_up": jnp.asarray(rng.standard_normal((8, 16, 32)) / 4, jnp.float32),
         "w_down": jnp.asarray(rng.standard_normal((8, 32, 16)) / 6, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8), jnp.float32)
    sharded = jax.jit(lambda p, x: dispatch.ep_moe(p, x, mesh=m, cfg=cfg, scoring="sigmoid", bias=bias))
    dense = lambda p, x: sigmoid_moe(p, x.reshape(32, 16), bias=bias, top_k=2).reshape(8, 4, 16)
    y, vjp, stats = jax.vjp(sharded, p, x, has_aux=True)
    y_ref, vjp_ref = jax.vjp(dense, p, x)
    assert_close((y, vjp(dy)), (y_ref, vjp_ref(dy)))
    assert float(jnp.max(jnp.abs(vjp(dy)[0]["router"]))) > 0          # the router does get a gradient
    assert stats.drop_rate == 0.0
    # the bias changes the choice of some tokens (so the test sees it used for choosing)
    scores = jax.nn.sigmoid(x.reshape(32, 16) @ p["router"])
    top = lambda c: np.sort(np.argsort(-np.asarray(c), axis=-1)[:, :2], axis=-1)
    assert (top(scores) != top(scores + bias)).any()


@pytest.mark.parametrize("dp, ep, grouped", [(2, 1, None), (2, 1, False), (1, 2, None), (2, 2, None)])
def test_bfloat16_on_meshes_with_an_axis_of_one_device(dp, ep, grouped):
    """bf16 weights and tokens, output and every gradient against reference.moe in float32
    on the same (bf16-rounded) inputs, each within the bf16 rule of its largest entry.
    Every mesh axis is manual in ep_moe's shard_map: with an axis of one device left
    automatic, XLA:CPU (jax 0.10.2) aborted the process compiling the bf16 gradient's
    all-reduce, whose reducer then carried a sharding annotation."""
    cfg = reference.ModelConfig(n_layers=1, d_model=32, d_ff=64, n_experts=8, top_k=2)
    p, x, dy = moe_inputs(cfg, 2 * dp * ep, 5, skew=1.0, dtype=jnp.bfloat16)
    mesh = mesh_lib.make_mesh(dp=dp, ep=ep, devices=jax.devices()[:dp * ep])
    y, vjp = jax.vjp(jax.jit(lambda p, x: dispatch.ep_moe(p, x, mesh=mesh, cfg=cfg, grouped=grouped)[0]), p, x)
    wide = jax.tree.map(lambda a: a.astype(jnp.float32), (p, x, dy))
    y_ref, vjp_ref = jax.vjp(lambda p, x: reference.moe(p, x, top_k=2), *wide[:2])
    rtol = tolerance(jnp.bfloat16)[0]
    for got, want in zip(jax.tree.leaves((y, vjp(dy))), jax.tree.leaves((y_ref, vjp_ref(wide[2])))):
        assert got.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        assert err <= rtol * float(jnp.max(jnp.abs(want))), err
