"""Ring attention against reference.attention and jax.nn.dot_product_attention: output, dQ,
dK, dV for cp in {1, 2, 4, 8} with dp filling the devices, both layouts, causal or not,
grouped-query; the collectives of each compiled program against formulas.ring_collectives;
the custom backward against autodiff of the forward; float64; huge logits; the relayout
on rank-coded tokens; compiled memory without a T x T score matrix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar.collectives import ring_shift
from jaxpar.context import blockwise, ring, zigzag
from jaxpar.context.verify import AttentionCase, attention_inputs, run_attention
from jaxpar.testing import assert_close, max_abs_diff, tolerance, value_and_grads

# (dp, cp, layout, causal, n_kv_heads, relayout)
CASES = [
    (8, 1, "contiguous", True, 8, True),
    (4, 2, "zigzag", True, 2, True),
    (4, 2, "contiguous", False, 8, False),
    (2, 4, "contiguous", True, 2, True),
    (2, 4, "zigzag", True, 4, False),
    (2, 4, "zigzag", False, 2, True),
    (1, 8, "zigzag", True, 1, True),
    (1, 8, "contiguous", True, 8, False),
]


@functools.cache
def _run(dp, cp, layout, causal, kv, relayout):
    return run_attention("ring", mesh_lib.make_mesh(dp=dp, cp=cp),
                         AttentionCase(causal=causal, layout=layout, relayout=relayout, batch_size=8, seq_len=32,
                                       n_kv_heads=kv))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ring_matches_reference_and_formula(case):
    run = _run(*case)
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward
    assert run.backward == run.formula_backward
    dp, cp = case[:2]
    # exactly cp - 1 K/V permutes forward (plus the 6 of the relayout), cp-1 + cp backward
    extra = 6 if case[2] == "zigzag" and case[5] and cp > 1 else 0
    assert run.forward.get("collective-permute", (0, 0))[0] == (cp - 1 + extra if cp > 1 else 0)
    assert run.backward.get("collective-permute", (0, 0))[0] == (2 * cp - 1 + extra if cp > 1 else 0)
    assert set(run.forward) <= {"collective-permute"}


@pytest.mark.parametrize("dp, cp, layout, chunk", [(2, 4, "zigzag", 1), (2, 4, "zigzag", 4), (2, 4, "contiguous", 3),
                                                   (1, 8, "contiguous", 2), (8, 1, "contiguous", 5)])
def test_keys_in_chunks_and_the_halved_diagonal_change_nothing(dp, cp, layout, chunk):
    """Blocks of 6 (cp 8) to 48 (cp 1) local tokens cut into chunks of 1..5 keys, the
    diagonal halved down to them: chunks that divide, that do not (3 of 6 for 4), odd."""
    run = run_attention("ring", mesh_lib.make_mesh(dp=dp, cp=cp),
                        AttentionCase(layout=layout, batch_size=2 * dp, seq_len=48, chunk=chunk))
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward and run.backward == run.formula_backward


@pytest.mark.parametrize("causal", [True, False])
def test_ring_matches_jax_dot_product_attention(causal):
    m = mesh_lib.make_mesh(dp=2, cp=4)
    q, k, v, do = attention_inputs(4, 32, 8, 2, 4)
    got = value_and_grads(lambda q, k, v: ring.ring_attention(q, k, v, mesh=m, causal=causal, layout="zigzag"),
                          q, k, v, ct=do)
    want = value_and_grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal), q, k, v, ct=do)
    assert_close(got, want)


@pytest.mark.parametrize("cp, layout", [(2, "contiguous"), (4, "zigzag"), (8, "zigzag")])
def test_custom_backward_equals_autodiff_of_the_forward(cp, layout):
    m = mesh_lib.make_mesh(dp=8 // cp, cp=cp)
    q, k, v, do = attention_inputs(8 // cp, 32, 4, 2, 4, seed=cp)
    grads = []
    for custom in (True, False):
        fn = jax.jit(lambda q, k, v: ring.ring_attention(q, k, v, mesh=m, layout=layout, custom_backward=custom))
        grads.append(jax.jit(lambda q, k, v, do: jax.vjp(fn, q, k, v)[1](do))(q, k, v, do))
    assert_close(grads[0], grads[1])


@pytest.mark.parametrize("dp, cp, layout", [(2, 4, "zigzag"), (1, 8, "contiguous")])
def test_float64_agrees_near_1e_13(x64, dp, cp, layout):
    run = run_attention("ring", mesh_lib.make_mesh(dp=dp, cp=cp),
                        AttentionCase(layout=layout, batch_size=2 * dp, dtype=jnp.float64))
    assert run.out[0].dtype == jnp.float64
    assert max_abs_diff(run.out, run.ref) < 1e-13
    assert_close(run.out, run.ref)


def rounding_bounds(q, k, v, do, *, lse_roundings: int) -> tuple[np.ndarray, ...]:
    """How far ONE float32 evaluation of causal attention (o, dq, dk, dv) may lie from the
    exact values, elementwise and to first order, from the roundings that large logits
    amplify (the rest of the arithmetic is held to the float32 rule). A = max over
    visible pairs of sum_h |q_h k_h| / sqrt(H), the logits' scale; u = 2^-24.

    * Each weight P_ij is off by a factor 1 + e_ij: the logit's own rounding, |e| <=
      ds = (H + 1) u A (H in the dot product, one in the scale), differs between entries
      of a row and cancels where the row is one-hot, |dP_ij| <= 2 ds P_ij (1 - P_ij); the
      row's log-sum-exp, rounded at magnitude A `lse_roundings` times (once per block of
      keys and per merge of the online softmax; none for a softmax normalised at once),
      adds dl = lse_roundings u A common to the row, which does not cancel where P is
      recomputed as exp(s - lse) (FlashAttention's backward). That is the conditioning:
      logits near 1e4 carry absolute errors near 1e-2, logits near 1 near 1e-7. Then
        o_i = sum_j P_ij v_j:     |do_i| <= (ds + dl) sum_j P_ij |v_j - o_i|
        dv_j = sum_i P_ij dO_i:   sum_i |dP_ij| |dO_i|
        dS_ij = P_ij (dP_ij - D_i), dP_ij = dO_i.v_j, D_i = dO_i.o_i:
                                  |dP_ij| c_ij + P_ij (2 ds + dl) sum_l P_il c_il,
      c_ij = sum_h |dO_ih||v_jh - o_ih| >= |dP_ij - D_i|;
    * dP_ij - D_i, about 0 where a row is one-hot, is formed from products of size
      |dO_i|.(|v_j| + |o_i|) (v ~ 100 here), rounded (H + 1) u each;
    and dq_i = sum_j dS_ij k_j / sqrt(H), dk_j = sum_i dS_ij q_i / sqrt(H) (over the query
    heads of a KV head) carry the bound on dS through |k| and |q|. Computed in float64."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    B, T, N, H = q.shape
    K, u = k.shape[2], 2.0 ** -24
    k, v = np.repeat(k, N // K, axis=2), np.repeat(v, N // K, axis=2)
    mask = np.tril(np.ones((T, T), bool))
    s = np.where(mask, np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H), -np.inf)
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)                                                  # [B, N, T, S]
    A = np.einsum("btnh,bsnh->bnts", abs(q), abs(k))[:, :, mask].max() / np.sqrt(H)
    ds, dl = (H + 1) * u * A, lse_roundings * u * A
    dP = P * (2 * ds * (1 - P) + dl)                                               # bound on |dP|
    o = np.einsum("bnts,bsnh->bnth", P, v)
    dev = abs(np.moveaxis(v, 1, 2)[:, :, None] - o[:, :, :, None])               # |v_s - o_t| [B, N, T, S, H]
    ado = np.moveaxis(abs(do), 1, 2)                                               # [B, N, T, H]
    c = np.einsum("bnth,bntsh->bnts", ado, dev)
    size = np.einsum("bnth,bnsh->bnts", ado, np.moveaxis(abs(v), 1, 2)) + np.sum(ado * abs(o), -1)[..., None]
    dS = dP * c + P * (2 * ds + dl) * np.sum(P * c, -1, keepdims=True) + (H + 1) * u * P * size
    per_kv = lambda a: a.reshape(B, T, K, N // K, H).sum(3)
    return (np.moveaxis((ds + dl) * np.einsum("bnts,bntsh->bnth", P, dev), 1, 2),
            np.einsum("bnts,bsnh->btnh", dS, abs(k)) / np.sqrt(H),
            per_kv(np.einsum("bnts,btnh->bsnh", dS, abs(q))) / np.sqrt(H),
            per_kv(np.einsum("bnts,btnh->bsnh", dP, abs(do))))


def test_logits_of_1e4_give_no_nan_and_match_the_reference():
    """q, k, v ~ N(0, 100^2): logits near 1e4, softmax rows one-hot but for near ties.
    Output and every gradient within the sum of the ring's and the reference's
    rounding_bounds, plus the float32 rule. The ring rounds a row's log-sum-exp at most
    2 (cp + DIAGONAL_DEPTH) times: once per block of keys (cp ring steps, and the
    diagonal block halved DIAGONAL_DEPTH times) and once per merge; the reference's
    softmax normalises at once."""
    cp = 4
    run = run_attention("ring", mesh_lib.make_mesh(dp=2, cp=cp), AttentionCase(layout="zigzag", scale=100.0))
    leaves = jax.tree.leaves(run.out)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in leaves)
    q, k, v, do = attention_inputs(4, 32, 8, 2, 4, scale=100.0)
    assert np.max(np.abs(np.einsum("btnh,bsnh->bnts", np.asarray(q)[:, :, :2], np.asarray(k)))) / 2 > 1e4
    rtol, atol = tolerance(jnp.float32)
    ring_bounds = rounding_bounds(q, k, v, do, lse_roundings=2 * (cp + blockwise.DIAGONAL_DEPTH))
    for name, got, want, a, b in zip(("o", "dq", "dk", "dv"), jax.tree.leaves(run.out), jax.tree.leaves(run.ref),
                                     ring_bounds, rounding_bounds(q, k, v, do, lse_roundings=0)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        excess = np.abs(got - want) - (a + b + rtol * np.abs(want) + atol)
        assert excess.max() <= 0, (name, np.abs(got - want).max(), excess.max())


def test_heads_split_over_tp_as_well():
    run = run_attention("ring", mesh_lib.make_mesh(cp=4, tp=2), AttentionCase(layout="zigzag", batch_size=2,
                                                                             n_kv_heads=2))
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward and run.backward == run.formula_backward


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_relayout_moves_rank_coded_tokens_exactly(cp):
    m = mesh_lib.make_mesh(dp=8 // cp, cp=cp)
    T = 4 * cp
    x = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None], (8 // cp, T, 3))
    pspec = P("dp", "cp")
    there = jax.jit(jax.shard_map(lambda a: ring.relayout_shard(a, axis="cp", layout="zigzag", seq_dim=1),
                                  mesh=m, in_specs=pspec, out_specs=pspec))
    back = jax.jit(jax.shard_map(lambda a: ring.relayout_shard(a, axis="cp", layout="zigzag", inverse=True, seq_dim=1),
                                 mesh=m, in_specs=pspec, out_specs=pspec))
    y = there(x)
    np.testing.assert_array_equal(y, zigzag.to_layout(x, cp, "zigzag"))
    np.testing.assert_array_equal(back(y), x)


def test_compiled_memory_never_holds_a_t_by_t_score_matrix():
    """Forward + backward at T=1024 over cp=4: the compiled temp memory per device is below
    one T x T score matrix of the local batch and heads (the dense program needs several)."""
    B, T, N, K, H = 1, 1024, 2, 2, 8
    m = mesh_lib.make_mesh(dp=2, cp=4)
    q, k, v, do = attention_inputs(2 * B, T, N, K, H)
    step = lambda f: jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
    ring_temp = step(lambda q, k, v: ring.ring_attention(q, k, v, mesh=m, layout="zigzag")).lower(
        q, k, v, do).compile().memory_analysis().temp_size_in_bytes
    scores = B * N * T * T * 4     # one f32 score matrix of this device's batch rows and heads
    assert ring_temp < scores / 2, (ring_temp, scores)


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_ring_shift_by_all_to_all_moves_exactly_what_ppermute_moves(cp):
    m = mesh_lib.make_mesh(dp=8 // cp, cp=cp)
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)         # rank-coded rows
    outs = {}
    for hop in ("ppermute", "all_to_all"):
        f = jax.shard_map(lambda a, hop=hop: ring_shift(a, "cp", cp, hop=hop), mesh=m, in_specs=P(("dp", "cp")),
                          out_specs=P(("dp", "cp")))
        outs[hop] = np.asarray(jax.jit(f)(x))
    expected = np.asarray(x).reshape(8 // cp, cp, 3)[:, (np.arange(cp) - 1) % cp].reshape(8, 3)
    np.testing.assert_array_equal(outs["ppermute"], expected)
    np.testing.assert_array_equal(outs["all_to_all"], expected)
