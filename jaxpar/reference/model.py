"""The whole model: random parameters (`init_params`, the pytree of the package
docstring), the pre-norm block, the forward pass and the next-token loss, with the
load-balancing terms (aux, load) an MoE model's blocks give on the way."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.reference.config import ModelConfig
from jaxpar.reference.experts import balance_loss, moe_and_routing
from jaxpar.reference.layers import attention_layer, mlp, rms_norm, statistics_dtype


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


def check_tokens(tokens, vocab: int, shape_doc: str) -> tuple[int, int]:
    """The shape of `tokens` if it is an int[B, T] array whose ids, when it is concrete (not
    a jax.core.Tracer: under jit only its shape and dtype are known), all lie in
    [0, vocab): out of range, the embedding's gather clamps or wraps them and the loss is
    NaN or a plausible wrong number (`errors.ids_below`, the input checks all share)."""
    shape = errors.array("tokens", tokens, ndim=2, kinds="iu", shape_doc=shape_doc)
    errors.ids_below("tokens", tokens, vocab, of=f"vocab={vocab}", fix="every id must name a row of the "
                     "vocabulary. Fix: map them into range, or grow the vocabulary (ModelConfig(vocab=...))")
    return shape


def forward_and_balance(params: dict, tokens, cfg: ModelConfig):
    """tokens: int[B, T] -> (logits [B, T, V], aux [L, B], load [L, E]): every layer's
    balance loss per sequence and load per expert (`block_and_balance`). Token ids
    outside [0, vocab) are refused where tokens is concrete (`check_tokens`)."""
    check_tokens(tokens, cfg.vocab, "tokens[batch, seq] of token ids")
    x = params["embed"][tokens]

    def layer(x, p):                  # one layer, over the stacked blocks' leading dimension
        y, aux, load = block_and_balance(p, x, cfg)
        return y, (aux, load)
    # a scan, not a Python loop: one layer compiled whatever n_layers (the same arithmetic)
    x, (auxes, loads) = jax.lax.scan(layer, x, params["blocks"])
    logits = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]
    return logits, auxes, loads


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
    shape = check_tokens(tokens, cfg.vocab, "tokens[batch, seq + 1] of token ids")
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
    tokens: int[B, T+1], ids in [0, vocab) (checked where tokens is concrete, not under
    jit: `check_tokens`). compute_dtype (e.g. jnp.bfloat16; None: the params' own): mixed
    precision, the params cast to it before any layer (`cast`), the layers run in it, the
    attention's softmax and the loss in float32 (`statistics_dtype`); the gradients come
    back in the params' dtype."""
    return loss_and_balance(params, tokens, cfg, compute_dtype)[0]
