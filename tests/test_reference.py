"""jaxpar.reference against JAX's own attention, small cases by hand, and a numpy twin.

The numpy twin (`np_*` below) is written independently of jaxpar/reference/, in float64, so
the block, forward and loss are checked against something that shares no code with them.
"""

import dataclasses
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from jaxpar import reference as ref
from jaxpar.errors import ConfigError
from jaxpar.testing import assert_close


# ---------------------------------------------------------------- numpy twin (float64)

def np_softmax(z, axis=-1):
    z = z - z.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)


def np_gelu(z):
    return 0.5 * z * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


def np_silu(z):
    return z / (1 + np.exp(-z))


def np_rms_norm(x, g, eps):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * g


def np_attention(q, k, v, causal):
    """Loop over batch and heads; GQA by index arithmetic, mask by comparison."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            s = q[b, :, n] @ k[b, :, kv].T / math.sqrt(H)           # [T, S]
            if causal:
                s = np.where(np.arange(T)[:, None] + S - T >= np.arange(S), s, -np.inf)
            out[b, :, n] = np_softmax(s) @ v[b, :, kv]
    return out


def np_mlp(p, x, mlp):
    up = x @ p["w_up"]
    hidden = np_gelu(up) if mlp == "gelu" else np_silu(x @ p["w_gate"]) * up
    return hidden @ p["w_down"]


def np_moe(p, x, top_k, mlp, renormalize=True):
    """Per token: softmax router, keep the top-k experts, weighted sum of their MLPs."""
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    for t, xt in enumerate(flat):
        probs = np_softmax(xt @ p["router"])
        chosen = np.argsort(-probs)[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if renormalize else 1.0)
        for w, e in zip(weights, chosen):
            expert = {n: p[n][e] for n in ("w_up", "w_gate", "w_down") if n in p}
            out[t] += w * np_mlp(expert, xt, mlp)
    return out.reshape(x.shape)


def np_block(p, x, cfg):
    h_in = np_rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q = np.einsum("btd,dnh->btnh", h_in, p["wq"])
    k = np.einsum("btd,dkh->btkh", h_in, p["wk"])
    v = np.einsum("btd,dkh->btkh", h_in, p["wv"])
    h = x + np.einsum("btnh,nhd->btd", np_attention(q, k, v, cfg.causal), p["wo"])
    z = np_rms_norm(h, p["mlp_norm"], cfg.norm_eps)
    if cfg.n_experts:
        return h + np_moe(p, z, cfg.top_k, cfg.mlp, cfg.moe_renormalize)
    return h + np_mlp(p, z, cfg.mlp)


def np_forward(params, tokens, cfg):
    x = params["embed"][tokens]
    for i in range(cfg.n_layers):
        x = np_block({n: a[i] for n, a in params["blocks"].items()}, x, cfg)
    return np_rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]


def np_loss(params, tokens, cfg):
    logits = np_forward(params, tokens[:, :-1], cfg)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    targets = tokens[:, 1:]
    return -np.mean(np.take_along_axis(logp, targets[..., None], -1))


def to_np(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


# Inputs and parameters come from numpy: each new shape drawn with jax.random compiles a
# threefry program (about a second on a small CPU), which would dominate these tests.
def randn(seed, *shape, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def np_params(cfg, seed, dtype=jnp.float32):
    """Parameters with the layout of reference.init_params (its docstring), drawn by numpy."""
    D, F, N, K, H, L, V, E = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              cfg.n_layers, cfg.vocab, cfg.n_experts)
    rng = np.random.default_rng(seed)
    ex = (E,) if E else ()

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape) / math.sqrt(shape[-2] if len(shape) > 1 else 1), dtype)

    blocks = {"attn_norm": jnp.asarray(1 + 0.1 * rng.standard_normal((L, D)), dtype),
              "wq": w(L, D, N, H) / math.sqrt(D / N), "wk": w(L, D, K, H) / math.sqrt(D / K),
              "wv": w(L, D, K, H) / math.sqrt(D / K), "wo": w(L, N, H, D) / math.sqrt(N),
              "mlp_norm": jnp.asarray(1 + 0.1 * rng.standard_normal((L, D)), dtype),
              "w_up": w(L, *ex, D, F), "w_down": w(L, *ex, F, D)}
    if cfg.mlp == "swiglu":
        blocks["w_gate"] = w(L, *ex, D, F)
    if E:
        blocks["router"] = w(L, D, E)
    return {"embed": w(V, D), "blocks": blocks,
            "final_norm": jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype), "unembed": w(D, V)}


attention = jax.jit(ref.attention, static_argnames="causal")
jax_attention = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")
# One compiled program per config instead of one per jnp operation (the config is hashable).
block = jax.jit(ref.block, static_argnums=2)
forward = jax.jit(ref.forward, static_argnums=2)
loss = jax.jit(ref.loss, static_argnums=2)


# ---------------------------------------------------------------- attention

def _qkv(seed, B, T, S, N, K, H, dtype):
    return randn(seed, B, T, N, H, dtype=dtype), randn(seed + 1, B, S, K, H, dtype=dtype), \
        randn(seed + 2, B, S, K, H, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("N, K", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_attention_matches_jax_nn_float32(causal, N, K):
    q, k, v = _qkv(1, 2, 8, 8, N, K, 8, jnp.float32)
    got = attention(q, k, v, causal=causal)
    assert got.shape == (2, 8, N, 8) and got.dtype == jnp.float32
    assert_close(got, jax_attention(q, k, v, is_causal=causal))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("N, K", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
def test_attention_matches_jax_nn_and_numpy_float64(x64, causal, N, K):
    q, k, v = _qkv(2, 2, 8, 8, N, K, 8, jnp.float64)
    got = attention(q, k, v, causal=causal)
    assert got.dtype == jnp.float64
    # jax.nn's XLA attention takes its softmax in float32 whatever the input dtype, so it
    # agrees to float32 accuracy only; the float64 bound is checked against numpy.
    assert_close(got, jax_attention(q, k, v, is_causal=causal).astype(jnp.float32).astype(jnp.float64),
                 scale=1e7)
    assert_close(got, np_attention(*to_np((q, k, v)), causal))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_with_fewer_queries_than_keys_matches_numpy(x64, causal):
    # Queries are the last T positions: query t sees keys s <= t + (S - T).
    q, k, v = _qkv(3, 1, 3, 7, 4, 2, 4, jnp.float64)
    assert_close(attention(q, k, v, causal=causal), np_attention(*to_np((q, k, v)), causal))


def test_attention_one_query_two_keys_by_hand():
    # H = 2, so scores are q.k / sqrt(2): [1/sqrt2, 0].
    q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = jnp.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = jnp.array([[1.0, 2.0], [3.0, 4.0]]).reshape(1, 2, 1, 2)
    a = math.exp(1 / math.sqrt(2))
    w1, w2 = a / (a + 1), 1 / (a + 1)
    want = np.array([w1 * 1 + w2 * 3, w1 * 2 + w2 * 4]).reshape(1, 1, 1, 2)
    for causal in (True, False):  # the one query is the last position: it sees both keys
        assert_close(ref.attention(q, k, v, causal=causal), jnp.asarray(want, jnp.float32))


def test_attention_lecture_exercise_6a_online_softmax_numbers():
    # One query, H = 1 (scale 1): scores [1, 2, 3] over values [10, 20, 30] -> 25.75.
    q = jnp.ones((1, 1, 1, 1))
    k = jnp.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1)
    v = jnp.array([10.0, 20.0, 30.0]).reshape(1, 3, 1, 1)
    out = float(ref.attention(q, k, v, causal=False)[0, 0, 0, 0])
    e = [math.exp(s) for s in (1, 2, 3)]
    assert out == pytest.approx((10 * e[0] + 20 * e[1] + 30 * e[2]) / sum(e), rel=1e-6)
    assert round(out, 2) == 25.75


def test_causal_mask_by_hand():
    # Zero queries give uniform weights over the visible keys: row t = mean(v[:t+1]).
    v = jnp.array([1.0, 2.0, 4.0, 8.0]).reshape(1, 4, 1, 1)
    out = ref.attention(jnp.zeros((1, 4, 1, 1)), jnp.ones((1, 4, 1, 1)), v, causal=True)
    np.testing.assert_allclose(np.asarray(out).ravel(), [1.0, 1.5, 7 / 3, 15 / 4], rtol=1e-6)


def test_gqa_query_head_n_reads_kv_head_n_over_group():
    # N = 4 query heads, K = 2 KV heads: heads 0,1 read KV head 0; heads 2,3 read KV head 1.
    v = jnp.stack([jnp.full((3,), 1.0), jnp.full((3,), 5.0)], axis=-1).reshape(1, 3, 2, 1)
    out = ref.attention(jnp.zeros((1, 3, 4, 1)), jnp.zeros((1, 3, 2, 1)), v, causal=False)
    np.testing.assert_allclose(np.asarray(out)[0, :, :, 0], [[1, 1, 5, 5]] * 3)


def test_attention_rejects_heads_not_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="N=4 must be a multiple of KV heads K=3"):
        ref.attention(jnp.zeros((1, 2, 4, 2)), jnp.zeros((1, 2, 3, 2)), jnp.zeros((1, 2, 3, 2)))


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 6), K=st.integers(1, 2), group=st.integers(1, 3),
       H=st.integers(1, 5), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_matches_jax_nn_on_small_shapes(B, T, K, group, H, causal, seed):
    q, k, v = _qkv(seed, B, T, T, K * group, K, H, jnp.float32)
    assert_close(attention(q, k, v, causal=causal), jax_attention(q, k, v, is_causal=causal))


# ---------------------------------------------------------------- norm, MLP, MoE by hand

def test_rms_norm_by_hand():
    x = jnp.array([[3.0, 4.0], [1.0, -1.0]])
    g = jnp.array([1.0, 2.0])
    r = math.sqrt(12.5)  # sqrt((9 + 16) / 2)
    want = np.array([[3 / r, 8 / r], [1.0, -2.0]])
    np.testing.assert_allclose(ref.rms_norm(x, g, eps=0.0), want, rtol=1e-6)
    # eps enters under the square root: rms of [1, -1] with eps=3 is 2.
    np.testing.assert_allclose(ref.rms_norm(x[1], g, eps=3.0), [0.5, -1.0], rtol=1e-6)


def test_mlp_gelu_by_hand():
    x = jnp.array([[1.0, -2.0]])
    p = {"w_up": jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]]), "w_down": jnp.array([[1.0], [2.0], [3.0]])}
    up = [1.0, -2.0, 0.0]  # x @ w_up
    gelu = [u * 0.5 * (1 + math.erf(u / math.sqrt(2))) for u in up]  # exact (erf) GeLU
    want = gelu[0] * 1 + gelu[1] * 2 + gelu[2] * 3
    np.testing.assert_allclose(ref.mlp(p, x, mlp="gelu"), [[want]], rtol=1e-6)


def test_mlp_swiglu_by_hand():
    x = jnp.array([[1.0, 2.0]])
    p = {"w_up": jnp.array([[1.0, 0.0], [0.0, 1.0]]), "w_gate": jnp.array([[0.0, 1.0], [1.0, -1.0]]),
         "w_down": jnp.array([[1.0], [-1.0]])}
    up, gate = [1.0, 2.0], [2.0, -1.0]
    silu = [z / (1 + math.exp(-z)) for z in gate]
    want = silu[0] * up[0] * 1 - silu[1] * up[1]
    np.testing.assert_allclose(ref.mlp(p, x, mlp="swiglu"), [[want]], rtol=1e-6)


def test_mlp_rejects_an_unknown_form():
    p = {"w_up": jnp.ones((2, 2)), "w_down": jnp.ones((2, 2))}
    with pytest.raises(ValueError, match="relu"):
        ref.mlp(p, jnp.ones((1, 2)), mlp="relu")


def test_router_top_k_gates_by_hand():
    # x = [1, 0] picks the first router row: logits [0, 1, 3, 2] over E = 4 experts.
    router = jnp.array([[0.0, 1.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0]])
    x = jnp.array([[1.0, 0.0]])
    p = np.exp([0.0, 1.0, 3.0, 2.0]) / np.exp([0.0, 1.0, 3.0, 2.0]).sum()
    gates = np.asarray(ref.router_weights(router, x, top_k=2))[0]
    np.testing.assert_allclose(gates, [0, 0, p[2] / (p[2] + p[3]), p[3] / (p[2] + p[3])], rtol=1e-6)
    assert gates.sum() == pytest.approx(1.0, rel=1e-6)
    raw = np.asarray(ref.router_weights(router, x, top_k=2, renormalize=False))[0]
    np.testing.assert_allclose(raw, [0, 0, p[2], p[3]], rtol=1e-6)
    one = np.asarray(ref.router_weights(router, x, top_k=1))[0]
    np.testing.assert_allclose(one, [0, 0, 1, 0], rtol=1e-6)


def test_router_gates_zero_outside_top_k_and_sum_to_one():
    router = randn(4, 8, 6)
    x = randn(5, 3, 5, 8)
    gates = np.asarray(ref.router_weights(router, x, top_k=2))
    assert gates.shape == (3, 5, 6)
    assert ((gates > 0).sum(-1) == 2).all()
    np.testing.assert_allclose(gates.sum(-1), 1.0, rtol=1e-6)
    probs = np_softmax(np.asarray(x, np.float64) @ np.asarray(router, np.float64))
    top2 = np.sort(np.argsort(-probs, -1)[..., :2], -1)
    np.testing.assert_array_equal(np.sort(np.argsort(-gates, -1)[..., :2], -1), top2)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_dense_moe_equals_per_token_loop(x64, mlp, renormalize):
    cfg = ref.ModelConfig(n_experts=4, top_k=2, n_layers=1, mlp=mlp)
    p = ref.layer_params(np_params(cfg, 6, jnp.float64), 0)
    x = randn(7, 2, 3, cfg.d_model, dtype=jnp.float64)
    got = ref.moe(p, x, top_k=2, mlp=mlp, renormalize=renormalize)
    assert_close(got, np_moe(to_np(p), np.asarray(x), 2, mlp, renormalize))


# ---------------------------------------------------------------- block, forward, loss

CONFIGS = {
    "gelu-mha": ref.ModelConfig(),
    "swiglu-gqa": ref.ModelConfig(mlp="swiglu", n_kv_heads=2),
    "moe-noncausal": ref.ModelConfig(n_experts=4, top_k=2, causal=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_matches_numpy_composition(x64, name):
    cfg = CONFIGS[name]
    p = ref.layer_params(np_params(cfg, 8, jnp.float64), 1)
    x = randn(9, 2, 5, cfg.d_model, dtype=jnp.float64)
    assert_close(block(p, x, cfg), np_block(to_np(p), np.asarray(x), cfg))


@pytest.mark.parametrize("name", ["gelu-mha", "moe-noncausal"])
def test_forward_and_loss_match_numpy(x64, name):
    cfg = CONFIGS[name]
    params = np_params(cfg, 10, jnp.float64)
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, cfg.vocab, (2, 6)))
    logits = forward(params, tokens, cfg)
    assert logits.shape == (2, 6, cfg.vocab)
    assert_close(logits, np_forward(to_np(params), np.asarray(tokens), cfg))
    assert float(loss(params, tokens, cfg)) == pytest.approx(np_loss(to_np(params), np.asarray(tokens), cfg),
                                                                 rel=1e-12)


def test_loss_of_uniform_logits_is_log_vocab():
    cfg = ref.ModelConfig(n_layers=1)
    params = np_params(cfg, 12)
    params["unembed"] = jnp.zeros_like(params["unembed"])  # every logit 0
    tokens = jnp.asarray(np.random.default_rng(13).integers(0, cfg.vocab, (3, 7)))
    assert float(loss(params, tokens, cfg)) == pytest.approx(math.log(cfg.vocab), rel=1e-6)


def test_cross_entropy_by_hand():
    logits = jnp.array([[0.0, math.log(3.0)], [math.log(2.0), 0.0]])  # softmax: [1/4, 3/4], [2/3, 1/3]
    got = float(ref.cross_entropy(logits, jnp.array([1, 1])))
    assert got == pytest.approx(-(math.log(3 / 4) + math.log(1 / 3)) / 2, rel=1e-6)


def test_a_few_sgd_steps_reduce_the_loss():
    cfg = ref.ModelConfig(n_layers=1)
    params = np_params(cfg, 14)
    tokens = jnp.asarray(np.random.default_rng(15).integers(0, cfg.vocab, (4, 9)))
    value_and_grad = jax.jit(jax.value_and_grad(ref.loss), static_argnums=2)
    first, grads = value_and_grad(params, tokens, cfg)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    for _ in range(5):
        _, grads = value_and_grad(params, tokens, cfg)
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    assert float(value_and_grad(params, tokens, cfg)[0]) < 0.9 * float(first)


# ---------------------------------------------------------------- config and parameters

def test_model_config_is_frozen_and_keyword_only():
    cfg = ref.ModelConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 64
    with pytest.raises(TypeError):
        ref.ModelConfig(64)
    assert hash(cfg) == hash(ref.ModelConfig())  # usable as a static jit argument


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_heads=8, n_kv_heads=3), "n_heads=8 must be a multiple of n_kv_heads=3"),
    (dict(mlp="relu"), "mlp='relu'"),
    (dict(n_experts=4, top_k=5), "top_k=5 must be in 1..n_experts=4"),
    (dict(n_experts=4, top_k=0), "top_k=0"),
])
def test_model_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ref.ModelConfig(**kwargs)


@pytest.mark.parametrize("ids, match", [
    (64, r"tokens holds ids from 0 to 64, outside \[0, vocab=64\)"),
    (1000, r"ids from 0 to 1000, outside \[0, vocab=64\).*Fix"),
    (-5, r"ids from -5 to 1, outside \[0, vocab=64\)"),
])
def test_token_ids_outside_the_vocabulary_are_refused(ids, match):
    cfg = ref.ModelConfig(n_layers=1)
    params = jax.eval_shape(lambda k: ref.init_params(k, cfg), jax.random.key(0))   # refused before params are read
    tokens = np.array([[0, 1, 1], [1, 0, ids]], np.int32)
    for f in (ref.loss, ref.loss_and_balance, ref.forward):
        with pytest.raises(ConfigError, match=match):
            f(params, tokens, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_params_shapes(name):
    cfg = CONFIGS[name]
    params = jax.eval_shape(lambda k: ref.init_params(k, cfg), jax.random.key(0))  # shapes only
    L, D, F, N, K, H, V, E = 2, 32, 64, 8, cfg.n_kv_heads, 4, 64, cfg.n_experts
    ex = (E,) if E else ()
    want = {"embed": (V, D), "final_norm": (D,), "unembed": (D, V),
            "blocks": {"attn_norm": (L, D), "wq": (L, D, N, H), "wk": (L, D, K, H), "wv": (L, D, K, H),
                       "wo": (L, N, H, D), "mlp_norm": (L, D), "w_up": (L, *ex, D, F), "w_down": (L, *ex, F, D)}}
    if cfg.mlp == "swiglu":
        want["blocks"]["w_gate"] = (L, *ex, D, F)
    if E:
        want["blocks"]["router"] = (L, D, E)
    assert jax.tree.map(lambda a: a.shape, params) == want
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}


def test_init_params_values_norm_gains_one_weights_scaled_by_fan_in():
    # unsafe_rbg: the threefry default compiles for seconds per shape on CPU; the draw is the same code.
    cfg = ref.ModelConfig(d_model=64, d_ff=256, n_layers=1, vocab=16)
    params = ref.init_params(jax.random.key(0, impl="unsafe_rbg"), cfg)
    b = params["blocks"]
    assert (np.asarray(b["attn_norm"]) == 1).all() and (np.asarray(params["final_norm"]) == 1).all()
    for name, fan_in in [("wq", 64), ("w_up", 64), ("w_down", 256), ("unembed", 64)]:
        std = float(np.std(np.asarray(params.get(name, b.get(name)))))
        assert std == pytest.approx(1 / math.sqrt(fan_in), rel=0.15), name
    assert float(np.std(np.asarray(params["embed"]))) == pytest.approx(1.0, rel=0.15)
