"""The layers of a block, each on one device's whole arrays: RMSNorm, softmax attention
(grouped-query, causal), the rotary embedding, the attention layer with its projections,
and the GeLU or SwiGLU MLP. Shapes use the letters of the package docstring."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError


def statistics_dtype(dtype):
    """The dtype a softmax's max and sum, a logsumexp and the loss are computed in for
    inputs of `dtype`: at least float32 (bfloat16 -> float32; float32, float64 unchanged)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x, gain, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * gain, over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def attention_shapes(q, k, v, *, causal: bool) -> tuple[int, int, int, int, int, int]:
    """(B, T, N, H, S, K) of attention's q [B, T, N, H] and k, v [B, S, K, H], or a
    ConfigError naming what does not fit: ranks, float dtypes, empty axes, k and v of one
    shape with q's batch and head_dim, N a multiple of K, and, when causal, no more
    queries than keys (the first T - S queries would see no key)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        errors.array(name, a, ndim=4, kinds="f", shape_doc=f"{name}[batch, seq, heads, head_dim]")
    B, T, N, H = (int(d) for d in q.shape)
    S, K = int(k.shape[1]), int(k.shape[2])
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        raise ConfigError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have one "
                          f"shape [B={B}, S, K, H={H}], with q's batch and head_dim")
    if N % K:
        raise ConfigError(f"query heads N={N} must be a multiple of KV heads K={K}: each KV head serves N/K "
                          f"query heads. Fix: K in ({errors.divisors(N)})")
    if causal and T > S:
        raise ConfigError(f"causal attention of T={T} queries over S={S} keys: the queries are the last T "
                          f"positions, so the first {T - S} would see no key. Fix: at most S queries, or causal=False")
    return B, T, N, H, S, K


def attention(q, k, v, *, causal: bool = True):
    """Softmax attention. q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K
    (grouped-query attention: query head n reads KV head n // (N/K)). Returns [B, T, N, H].

    With causal=True, query t sees keys s <= t + (S - T) (queries are the last T positions).
    """
    B, T, N, H, S, K = attention_shapes(q, k, v, causal=causal)
    k = jnp.repeat(k, N // K, axis=2)
    v = jnp.repeat(v, N // K, axis=2)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k)
    stats = statistics_dtype(scores.dtype)
    if stats != scores.dtype:     # bf16 (mixed precision): the softmax's max and sum in float32, as MaxText's
        scores = scores.astype(stats)     # float32 logits; the products themselves stay bf16
    scores = scores / jnp.sqrt(jnp.asarray(H, scores.dtype))
    if causal:
        mask = jnp.arange(T)[:, None] + (S - T) >= jnp.arange(S)[None, :]
        scores = jnp.where(mask, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights.astype(v.dtype) if stats != v.dtype else weights, v)


def rope(x, positions, theta: float):
    """Rotary position embedding (Su et al.; Llama's half-split form): feature pairs
    (i, i + H/2) of x [B, T, n, H] turned by positions[t] * theta^(-2i/H). theta=0: x."""
    if not theta:
        return x
    H = x.shape[-1]
    freq = jnp.asarray(theta, jnp.float32) ** (-jnp.arange(0, H // 2, dtype=jnp.float32) * 2 / H)
    angle = jnp.asarray(positions, jnp.float32)[:, None] * freq                     # [T, H/2]
    cos, sin = (f(angle).astype(x.dtype)[None, :, None, :] for f in (jnp.cos, jnp.sin))
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention_layer(p: dict, x, *, causal: bool = True, rope_theta: float = 0.0):
    """Projections + attention + output projection (no norm, no residual). x: [B, T, D].
    Queries and keys are turned by the rotary embedding when rope_theta > 0."""
    positions = jnp.arange(x.shape[1])
    q = rope(jnp.einsum("btd,dnh->btnh", x, p["wq"]), positions, rope_theta)
    k = rope(jnp.einsum("btd,dkh->btkh", x, p["wk"]), positions, rope_theta)
    v = jnp.einsum("btd,dkh->btkh", x, p["wv"])
    o = attention(q, k, v, causal=causal)
    return jnp.einsum("btnh,nhd->btd", o, p["wo"])


def mlp(p: dict, x, *, mlp: str = "gelu"):
    """The MLP of form `mlp` (ModelConfig.mlp). GeLU: GeLU(x W_up) W_down. SwiGLU:
    (silu(x W_gate) * x W_up) W_down. x: [..., D]."""
    up = x @ p["w_up"]
    if mlp == "gelu":
        hidden = jax.nn.gelu(up, approximate=False)
    elif mlp == "swiglu":
        hidden = jax.nn.silu(x @ p["w_gate"]) * up
    else:
        raise ConfigError(f"mlp={mlp!r}: use 'gelu' or 'swiglu'")
    return hidden @ p["w_down"]
