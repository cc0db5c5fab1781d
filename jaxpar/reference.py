"""The unsharded model every parallel version is tested against.

Plain, obviously-correct jnp: einsum attention with an explicit mask, GeLU and SwiGLU
MLPs, a top-k MoE computed densely over all experts, pre-norm blocks, next-token loss.
No sharding, no collectives, no cleverness: if a parallel version disagrees with this
file, the parallel version is wrong.

Dimension letters (STYLE.md): B batch, T sequence (queries), S sequence (keys),
D model, F feed-forward, N heads, K kv-heads, H head dim, E experts, V vocab, L layers.

Parameters are a plain pytree:
    embed f32[V, D]; final_norm f32[D]; unembed f32[D, V]
    blocks: dict of per-layer arrays stacked on a leading L axis:
        attn_norm [L, D]; wq [L, D, N, H]; wk, wv [L, D, K, H]; wo [L, N, H, D]
        mlp_norm [L, D]
        dense MLP:  w_up [L, D, F]; w_gate [L, D, F] (SwiGLU only); w_down [L, F, D]
        MoE:        router [L, D, E]; w_up [L, E, D, F]; w_gate [L, E, D, F] (SwiGLU only);
                    w_down [L, E, F, D]; router_bias [L, E] (DeepSeek-V3's selection bias,
                    only with router="sigmoid" and bias_rate > 0: not a weight, set by
                    the balancing rule, not by gradients)

Load balancing (MoE only). Each sequence is a routing group (GShard; DeepSeek-V3's
sequence-wise balance loss): for sequence b and layer l, f_e is the fraction of its
T*k token-slots sent to expert e, P_e the mean over its T tokens of the router's
probability of e (for the sigmoid router, the scores normalised to sum to 1 over the
experts), and aux[l, b] = E * sum_e f_e P_e: 1 when balanced, E when collapsed on one
expert. `loss` adds aux_loss * sum over layers of the mean over sequences. The load
load[l, e] is the number of token-slots of the whole batch sent to e; a trainer moves
router_bias by bias_rate * sign(mean load - load) after each step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError


MAX_SIZE = 1 << 24  # any width, head count or layer count above this is a typo, not a model
ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer. Defaults are small enough for fake CPU devices and
    divisible by every mesh size up to 8, so one config serves all the tests."""

    vocab: int = 64          # V: divisible by tp up to 8 for the vocab-parallel embedding
    d_model: int = 32        # D
    n_heads: int = 8         # N: tp up to 8 splits heads
    n_kv_heads: int = 8      # K: < n_heads gives grouped-query attention
    head_dim: int = 4        # H
    d_ff: int = 64           # F
    n_layers: int = 2        # L
    mlp: Literal["gelu", "swiglu"] = "gelu"   # the lecture's Z = GeLU(XA)B, or Llama's SwiGLU
    n_experts: int = 0       # E: 0 = dense MLP; > 0 = MoE in every block
    top_k: int = 2           # experts per token (MoE only)
    moe_renormalize: bool = True   # top-k gate weights renormalised to sum to 1 (Mixtral)
    causal: bool = True
    norm_eps: float = 1e-6
    rope_theta: float = 0.0  # rotary position embedding base (Llama: 10000); 0 = none
    # 0 and softmax leave the model as it was: no balancing term, no bias
    router: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3 (top-k of sigmoid + bias)
    aux_loss: float = 0.0    # alpha, the weight of the balance loss (Switch: 1e-2; DeepSeek-V3: 1e-4)
    bias_rate: float = 0.0   # gamma, the selection bias' step per update (DeepSeek-V3: 1e-3); sigmoid only

    def __post_init__(self):
        for name in ("vocab", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "n_layers", "top_k"):
            errors.whole(name, getattr(self, name), maximum=MAX_SIZE)
        errors.whole("n_experts", self.n_experts, minimum=0, maximum=MAX_SIZE,
                     fix="n_experts=0 is a dense MLP, n_experts >= 1 an MoE")
        errors.one_of("mlp", self.mlp, ("gelu", "swiglu"))
        errors.flag("moe_renormalize", self.moe_renormalize)
        errors.flag("causal", self.causal)
        errors.number("norm_eps", self.norm_eps, fix="norm_eps is the RMSNorm epsilon, e.g. norm_eps=1e-6")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or not (
                self.rope_theta == 0 or 1 < self.rope_theta < float("inf")):
            raise ConfigError(f"rope_theta={self.rope_theta!r}: give 0 (no rotary embedding) or a base > 1, "
                              "e.g. rope_theta=10000.0")
        if self.rope_theta and self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd: rotary embedding turns pairs of features. "
                              f"Fix: head_dim={self.head_dim + 1}, or rope_theta=0")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(each KV head serves n_heads/n_kv_heads query heads). Fix: n_kv_heads in "
                f"({errors.divisors(self.n_heads)})"
            )
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}: each token "
                              f"picks top_k distinct experts. Fix: top_k={min(2, self.n_experts)}")
        self._check_balancing()

    def _check_balancing(self):
        errors.one_of("router", self.router, ROUTERS)
        for name, example in (("aux_loss", "aux_loss=0.01 (Switch)"), ("bias_rate", "bias_rate=0.001 (DeepSeek-V3)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name}={value!r}: give a finite number >= 0 (0: off), e.g. {example}")
        asked = [f"{name}={getattr(self, name)!r}" for name, off in (("router", "softmax"), ("aux_loss", 0),
                                                                     ("bias_rate", 0)) if getattr(self, name) != off]
        if not self.n_experts and asked:
            raise ConfigError(f"{', '.join(asked)} on a dense model (n_experts=0): routing and load balancing need "
                              "experts. Fix: give the model experts, e.g. n_experts=8, or leave router='softmax', "
                              "aux_loss=0, bias_rate=0")
        if self.bias_rate and self.router != "sigmoid":
            raise ConfigError(f"bias_rate={self.bias_rate} with router={self.router!r}: the selection bias is "
                              "DeepSeek-V3's, added to sigmoid scores. Fix: router='sigmoid', or bias_rate=0")
        if self.router == "sigmoid" and not self.moe_renormalize:
            raise ConfigError("router='sigmoid' with moe_renormalize=False: DeepSeek-V3's gates are the chosen "
                              "sigmoid scores normalised to sum to 1. Fix: moe_renormalize=True, or "
                              "router='softmax'")

    @property
    def router_bias(self) -> bool:
        """Whether the blocks hold DeepSeek-V3's selection bias (updated at rate bias_rate)."""
        return self.bias_rate > 0


def init_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """Random parameters: weights ~ N(0, 1/fan_in), embedding ~ N(0, 1), norm gains 1."""
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig: build one with "
                          "reference.ModelConfig(...)")
    errors.array("key", key, shape_doc="a PRNG key, jax.random.key(0)", nonempty=False)
    if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ConfigError(f"dtype={dtype!r}: parameters are floating point; use jnp.float32, bfloat16 or float64")
    return _init_params(key, cfg, jnp.dtype(dtype))


# One jit and one random draw for the whole model: a separate jax.random call per weight
# compiles a separate threefry kernel per shape, which costs seconds on CPU.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _init_params(key: jax.Array, cfg: ModelConfig, dtype) -> dict:
    D, F, N, K, H, L, V, E = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads,
                              cfg.head_dim, cfg.n_layers, cfg.vocab, cfg.n_experts)
    expert = (E,) if E else ()
    weights = {  # name -> (shape, fan_in)
        "embed": ((V, D), 1),
        "unembed": ((D, V), D),
        "wq": ((L, D, N, H), D),
        "wk": ((L, D, K, H), D),
        "wv": ((L, D, K, H), D),
        "wo": ((L, N, H, D), N * H),
        "w_up": ((L, *expert, D, F), D),
        "w_down": ((L, *expert, F, D), F),
    }
    if cfg.mlp == "swiglu":
        weights["w_gate"] = ((L, *expert, D, F), D)
    if E:
        weights["router"] = ((L, D, E), D)
    sizes = [math.prod(shape) for shape, _ in weights.values()]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    drawn, offset = {}, 0
    for (name, (shape, fan_in)), size in zip(weights.items(), sizes):
        drawn[name] = (flat[offset:offset + size].reshape(shape) / math.sqrt(fan_in)).astype(dtype)
        offset += size
    blocks = {name: drawn[name] for name in weights if name not in ("embed", "unembed")}
    if cfg.router_bias:
        blocks["router_bias"] = jnp.zeros((L, E), dtype)
    blocks["attn_norm"] = jnp.ones((L, D), dtype)
    blocks["mlp_norm"] = jnp.ones((L, D), dtype)
    return {
        "embed": drawn["embed"],
        "blocks": blocks,
        "final_norm": jnp.ones((D,), dtype),
        "unembed": drawn["unembed"],
    }


def statistics_dtype(dtype):
    """The dtype a softmax's max and sum, a logsumexp and the loss are computed in for
    inputs of `dtype`: at least float32 (bfloat16 -> float32; float32, float64 unchanged)."""
    return jnp.promote_types(dtype, jnp.float32)


def cast(params, dtype=None):
    """Mixed precision's one cast: every floating leaf of `params` as `dtype` (None, or a
    leaf already of it: unchanged, so float32 and float64 programs stay as they were). Its
    transpose carries the gradients back into the leaves' own dtype."""
    if dtype is None:
        return params
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype
                        else a, params)


def layer_params(params: dict, i: int) -> dict:
    """The block parameters of layer i (one slice of the stacked `blocks`)."""
    return jax.tree.map(lambda a: a[i], params["blocks"])


def rms_norm(x, gain, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * gain, over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def attention(q, k, v, *, causal: bool = True):
    """Softmax attention. q: [B, T, N, H]; k, v: [B, S, K, H] with N a multiple of K
    (grouped-query attention: query head n reads KV head n // (N/K)). Returns [B, T, N, H].

    With causal=True, query t sees keys s <= t + (S - T) (queries are the last T positions).
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        errors.array(name, a, ndim=4, kinds="f", shape_doc=f"{name}[batch, seq, heads, head_dim]")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        raise ConfigError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must have one "
                          f"shape [B={B}, S, K, H={H}], with q's batch and head_dim")
    if N % K:
        raise ConfigError(f"query heads N={N} must be a multiple of KV heads K={K}: each KV head serves N/K "
                          f"query heads. Fix: K in ({errors.divisors(N)})")
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
    return _mlp(p, x, mlp)


def _mlp(p: dict, x, mlp: str):
    """`mlp`'s body, for callers whose own `mlp` parameter hides the function."""
    up = x @ p["w_up"]
    if mlp == "gelu":
        hidden = jax.nn.gelu(up, approximate=False)
    elif mlp == "swiglu":
        hidden = jax.nn.silu(x @ p["w_gate"]) * up
    else:
        raise ConfigError(f"mlp={mlp!r}: use 'gelu' or 'swiglu'")
    return hidden @ p["w_down"]


def _normalised(top_vals):
    """top_vals [..., k] over their sum. With k = 1 the gate is exactly 1, a constant: v/v's
    derivative is mathematically 0 but float noise in practice, which AdamW would scale into
    full-size steps of the router."""
    if top_vals.shape[-1] == 1:
        return jnp.ones_like(jax.lax.stop_gradient(top_vals))
    return top_vals / jnp.sum(top_vals, axis=-1, keepdims=True)


def router_choice(router, x, *, top_k: int, renormalize: bool = True, scoring: str = "softmax", bias=None):
    """The router's decision for tokens x [..., D] -> (gates [..., E], zero outside each
    token's top-k; chosen [..., E], 1 on its top-k; scores [..., E]).

    scoring="softmax": scores = softmax(x W); the top-k of the scores, renormalised to sum to
    1 (Mixtral) or left raw (Switch/GShard). "sigmoid" (DeepSeek-V3): scores = sigmoid(x W);
    the top-k of scores + bias are chosen (the bias chooses, it is no gate and gets no
    gradient); the gates are the chosen scores normalised to sum to 1."""
    logits = x @ router
    E = logits.shape[-1]
    if scoring == "softmax" and bias is not None:
        raise ConfigError("a selection bias (router_bias) goes with the sigmoid router: give scoring='sigmoid' "
                          "(ModelConfig(router='sigmoid')), or no bias")
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        top_vals, top_idx = jax.lax.top_k(scores, top_k)
        if renormalize:
            top_vals = _normalised(top_vals)
    elif scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + jax.lax.stop_gradient(bias)
        top_idx = jax.lax.top_k(choice, top_k)[1]
        top_vals = _normalised(jnp.take_along_axis(scores, top_idx, axis=-1))
    else:
        raise ConfigError(f"scoring={scoring!r}: use one of {', '.join(map(repr, ROUTERS))}")
    one_hot = jax.nn.one_hot(top_idx, E, dtype=scores.dtype)  # [..., k, E]
    return jnp.einsum("...k,...ke->...e", top_vals, one_hot), jnp.sum(one_hot, axis=-2), scores


def router_weights(router, x, *, top_k: int, renormalize: bool = True, scoring: str = "softmax", bias=None):
    """The gates [..., E] of `router_choice`: zero outside each token's top-k."""
    return router_choice(router, x, top_k=top_k, renormalize=renormalize, scoring=scoring, bias=bias)[0]


def balance_loss(scores, chosen, *, top_k: int, scoring: str = "softmax"):
    """The Switch/GShard balance loss of each sequence: scores, chosen [B, T, E] ->
    aux [B] = E * sum_e f_e P_e, f_e = (token-slots of the sequence sent to e) / (T k),
    P_e = mean over its tokens of the probability of e (sigmoid scores normalised over
    the experts first, DeepSeek-V3's sequence-wise loss). 1 when balanced."""
    probs = scores if scoring == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    T, E = scores.shape[-2], scores.shape[-1]
    f = jnp.sum(chosen, axis=-2) / (T * top_k)                  # [B, E]
    return E * jnp.sum(f * jnp.mean(probs, axis=-2), axis=-1)


def moe_and_routing(p: dict, x, *, top_k: int, mlp: str = "gelu", renormalize: bool = True,
                    scoring: str = "softmax"):
    """(`moe`'s output, chosen [..., E], scores [..., E]): see router_choice. The selection
    bias is p["router_bias"] [E] when the layer has one."""
    gates, chosen, scores = router_choice(p["router"], x, top_k=top_k, renormalize=renormalize, scoring=scoring,
                                          bias=p.get("router_bias"))
    out = jnp.zeros_like(x)
    for e in range(p["router"].shape[-1]):
        expert = {name: p[name][e] for name in ("w_up", "w_gate", "w_down") if name in p}
        out = out + gates[..., e:e + 1] * _mlp(expert, x, mlp)
    return out, chosen, scores


def moe(p: dict, x, *, top_k: int, mlp: str = "gelu", renormalize: bool = True, scoring: str = "softmax"):
    """Mixture of experts, every expert (an MLP of form `mlp`) run on every token, mixed by
    the top-k gates. No capacity, nothing dropped. x: [..., D]."""
    return moe_and_routing(p, x, top_k=top_k, mlp=mlp, renormalize=renormalize, scoring=scoring)[0]


def block_and_balance(p: dict, x, cfg: ModelConfig):
    """`block`'s output and its load-balancing terms: (y [B, T, D], aux [B] per sequence
    (`balance_loss`), load [E] token-slots per expert; a dense block: zeros, [0])."""
    h = x + attention_layer(p, rms_norm(x, p["attn_norm"], cfg.norm_eps), causal=cfg.causal,
                            rope_theta=cfg.rope_theta)
    z = rms_norm(h, p["mlp_norm"], cfg.norm_eps)
    if not cfg.n_experts:
        return h + mlp(p, z, mlp=cfg.mlp), jnp.zeros(x.shape[:1], x.dtype), jnp.zeros((0,), jnp.float32)
    y, chosen, scores = moe_and_routing(p, z, top_k=cfg.top_k, mlp=cfg.mlp, renormalize=cfg.moe_renormalize,
                                        scoring=cfg.router)
    aux = balance_loss(scores, chosen, top_k=cfg.top_k, scoring=cfg.router)
    return h + y, aux, jnp.sum(chosen, axis=(0, 1), dtype=jnp.float32)


def block(p: dict, x, cfg: ModelConfig):
    """Pre-norm block: h = x + attn(norm(x)); y = h + mlp_or_moe(norm(h)). x: [B, T, D]."""
    return block_and_balance(p, x, cfg)[0]


def forward_and_balance(params: dict, tokens, cfg: ModelConfig):
    """tokens: int[B, T] -> (logits [B, T, V], aux [L, B], load [L, E]): every layer's
    balance loss per sequence and load per expert (`block_and_balance`)."""
    errors.array("tokens", tokens, ndim=2, kinds="iu", shape_doc="tokens[batch, seq] of token ids")
    x = params["embed"][tokens]
    auxes, loads = [], []
    for i in range(cfg.n_layers):
        x, aux, load = block_and_balance(layer_params(params, i), x, cfg)
        auxes.append(aux)
        loads.append(load)
    logits = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]
    return logits, jnp.stack(auxes), jnp.stack(loads)


def forward(params: dict, tokens, cfg: ModelConfig):
    """tokens: int[B, T] -> logits [B, T, V]."""
    return forward_and_balance(params, tokens, cfg)[0]


def cross_entropy(logits, targets):
    """Mean over tokens of -log softmax(logits)[target]. logits [..., V], targets int[...].
    bf16 logits are cast to float32 first (the logsumexp and the loss in float32)."""
    stats = statistics_dtype(logits.dtype)
    logp = jax.nn.log_softmax(logits if stats == logits.dtype else logits.astype(stats), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def lm_head_loss(x, final_norm, unembed, targets, eps: float = 1e-6):
    """The output layer and the loss, as `forward` and `loss` end: cross-entropy of
    rms_norm(x) @ unembed against targets. x [..., D], unembed [D, V], targets int[...]."""
    return cross_entropy(rms_norm(x, final_norm, eps) @ unembed, targets)


def loss_and_balance(params: dict, tokens, cfg: ModelConfig, compute_dtype=None):
    """(`loss`, {"aux": [L, B], "load": [L, E]}): the loss and the balancing terms it was
    made of (`forward_and_balance`), for a trainer's bias update. compute_dtype: see `loss`."""
    shape = errors.array("tokens", tokens, ndim=2, kinds="iu", shape_doc="tokens[batch, seq + 1] of token ids")
    if shape[1] < 2:
        raise ConfigError(f"tokens has shape {shape}: next-token prediction needs at least 2 positions per row")
    logits, aux, load = forward_and_balance(cast(params, compute_dtype), tokens[:, :-1], cfg)
    total = cross_entropy(logits, tokens[:, 1:])
    if cfg.aux_loss:
        total = total + cfg.aux_loss * jnp.sum(jnp.mean(aux, axis=1))
    return total, {"aux": aux, "load": load}


def loss(params: dict, tokens, cfg: ModelConfig, compute_dtype=None):
    """Next-token cross-entropy: position t predicts token t+1, plus aux_loss times the
    balance loss (summed over layers, mean over sequences) when aux_loss > 0.
    tokens: int[B, T+1]. compute_dtype (e.g. jnp.bfloat16; None: the params' own): mixed
    precision, the params cast to it before any layer (`cast`), the layers run in it, the
    attention's softmax and the loss in float32 (`statistics_dtype`); the gradients come
    back in the params' dtype."""
    return loss_and_balance(params, tokens, cfg, compute_dtype)[0]
