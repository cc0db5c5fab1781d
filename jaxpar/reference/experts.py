"""The mixture of experts: the top-k routers (softmax, or DeepSeek-V3's sigmoid with a
selection bias), the balance loss, and the MoE layer computed densely over all experts.

Load balancing. Each sequence is a routing group (GShard; DeepSeek-V3's
sequence-wise balance loss): for sequence b and layer l, f_e is the fraction of its
T*k token-slots sent to expert e, P_e the mean over its T tokens of the router's
probability of e (for the sigmoid router, the scores normalised to sum to 1 over the
experts), and aux[l, b] = E * sum_e f_e P_e: 1 when balanced, E when collapsed on one
expert. `loss` adds aux_loss * sum over layers of the mean over sequences. The load
load[l, e] is the number of token-slots of the whole batch sent to e; a trainer moves
router_bias by bias_rate * sign(mean load - load) after each step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError
from jaxpar.reference import layers
from jaxpar.reference.config import ROUTERS


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
    experts = {name: p[name] for name in ("w_up", "w_gate", "w_down") if name in p}     # [E, ...] each

    def add(out, expert_and_gate):    # expert e on every token, weighted by its gate, added
        expert, gate = expert_and_gate
        return out + gate[..., None] * layers.mlp(expert, x, mlp=mlp), None
    # a scan over the experts, in order: one expert compiled whatever E
    out, _ = jax.lax.scan(add, jnp.zeros_like(x), (experts, jnp.moveaxis(gates, -1, 0)))
    return out, chosen, scores


def moe(p: dict, x, *, top_k: int, mlp: str = "gelu", renormalize: bool = True, scoring: str = "softmax"):
    """Mixture of experts, every expert (an MLP of form `mlp`) run on every token, mixed by
    the top-k gates. No capacity, nothing dropped. x: [..., D]."""
    return moe_and_routing(p, x, top_k=top_k, mlp=mlp, renormalize=renormalize, scoring=scoring)[0]
