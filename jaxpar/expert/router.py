"""Routers (lecture 6, and lecture 4's MoE): which k experts each token goes to, with what weight.

    softmax   p = softmax(x W); the top-k of p; weights renormalised to sum to 1 (Mixtral)
              or the raw probabilities (Switch/GShard); `reference.router_weights`' rule
    sigmoid   DeepSeek-V3: s = sigmoid(x W); the top-k of s + b are chosen, where b is a
              per-expert bias used only for the choice, never in the weights; the
              weights are the chosen s, normalised. After each step b moves by
              `rate` toward the experts that got too few tokens (`update_bias`): load
              balancing with no auxiliary loss.

`load_balancing_loss` is the Switch/GShard auxiliary loss, E * sum_e f_e P_e, with f_e the
fraction of the token-slots sent to expert e and P_e the mean router probability of e
(for the sigmoid router, the scores normalised over the experts: DeepSeek-V3's
sequence-wise loss): 1 when perfectly balanced, E when every token goes to one expert.
A trainer takes it per sequence (each sequence one routing group, so that the loss of a
microbatch depends on nothing else), in two halves: `sequence_sums`, additive over the
devices a sequence is split over (summed over cp by the caller), then
`sequence_balance_loss`.

The router is replicated: every device routes its own tokens, and its gradient is summed
over the devices that share it (shard_map's transpose of a replicated input).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar import errors
from jaxpar.errors import ConfigError

SCORINGS = ("softmax", "sigmoid")   # how the router turns its logits into scores


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """The route of each token: `experts` [t, k] int32 (distinct per token, highest score
    first), `weights` [t, k] the gates, `probs` [t, E] the router's scores (softmax
    probabilities, or sigmoid scores) for the auxiliary loss and the statistics."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array


def check_router(router, d_model: int, n_experts: int | None = None) -> int:
    """Refuse a router that is not a [d_model, E] float array; return E."""
    shape = errors.array("router", router, ndim=2, kinds="f", shape_doc="router[d_model, n_experts]")
    if shape[0] != d_model or (n_experts is not None and shape[1] != n_experts):
        want = f"[{d_model}, {n_experts if n_experts is not None else 'E'}]"
        raise ConfigError(f"router has shape {shape}; expected {want}: one column of scores per expert over "
                          "the model width. Fix: reference.init_params draws it, or build it with that shape")
    return shape[1]


def check_top_k(top_k, n_experts: int) -> int:
    errors.whole("top_k", top_k, fix="top_k is the number of experts per token, e.g. top_k=2")
    if top_k > n_experts:
        raise ConfigError(f"top_k={top_k} is more than n_experts={n_experts}: each token picks top_k distinct "
                          f"experts. Fix: top_k in 1..{n_experts}")
    return top_k


def check_route(router, d_model: int, *, top_k, scoring, bias=None, n_experts: int | None = None) -> int:
    """Refuse (ConfigError) what `route` refuses: a scoring not in SCORINGS, a router that
    is not [d_model, E] (E = n_experts when given), top_k outside 1..E, a bias with
    softmax gates. Returns E."""
    errors.one_of("scoring", scoring, SCORINGS)
    E = check_router(router, d_model, n_experts)
    check_top_k(top_k, E)
    if scoring == "softmax" and bias is not None:
        raise ConfigError("bias= is DeepSeek-V3's selection bias: it goes with scoring='sigmoid'")
    return E


def route(router, x, *, top_k: int, scoring: str = "softmax", renormalize: bool = True, bias=None) -> Routing:
    """Route tokens x [t, D] (a float array, at least one token) with router [D, E],
    checked first (check_route): scores by `scoring` (softmax, or DeepSeek-V3's sigmoid).
    `bias` [E] (sigmoid only) shifts the choice, not the weights."""
    _, D = errors.array("x", x, ndim=2, kinds="f", shape_doc="x[tokens, d_model]")
    check_route(router, D, top_k=top_k, scoring=scoring, bias=bias)
    return select_experts(router, x, top_k=top_k, scoring=scoring, renormalize=renormalize, bias=bias)


def select_experts(router, x, *, top_k: int, scoring: str, renormalize: bool, bias) -> Routing:
    """`route` on inputs check_route has passed: each token of x [t, D] scored by router
    [D, E], its top_k experts chosen and gated."""
    # the weight itself where it is in x's dtype (a ZeRO-3 backward then gathers it again,
    # as every matrix; a converted copy would be kept from the forward, whole)
    logits = jnp.einsum("td,de->te", x, router if router.dtype == x.dtype else router.astype(x.dtype))
    if scoring == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, top_k)
        if renormalize:
            weights = _normalised(weights)
        return Routing(experts.astype(jnp.int32), weights, probs)
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias).astype(scores.dtype)
    _, experts = jax.lax.top_k(choice, top_k)
    weights = _normalised(jnp.take_along_axis(scores, experts, axis=-1))
    return Routing(experts.astype(jnp.int32), weights, scores)


def _normalised(weights):
    """weights [t, k] over their sum; top-1's gate is the constant 1 (no float-noise gradient
    for AdamW to blow up into router steps)."""
    if weights.shape[-1] == 1:
        return jnp.ones_like(jax.lax.stop_gradient(weights))
    return weights / jnp.sum(weights, axis=-1, keepdims=True)


def expert_load(experts, n_experts: int):
    """Token-slots per expert [E] (int32) for experts [t, k]."""
    return jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)


def update_bias(bias, load, *, rate: float = 1e-3):
    """DeepSeek-V3's auxiliary-loss-free balancing: b_e += rate * sign(mean load - load_e),
    the mean over the experts (the last axis: bias, load [..., E], one row per layer).
    Overloaded experts become less likely to be chosen, underloaded ones more."""
    errors.number("rate", rate, fix="rate is the bias step, e.g. rate=1e-3")
    load = load.astype(bias.dtype)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def balance_probs(probs, scoring: str = "softmax"):
    """The probabilities P_e averages: softmax probabilities as they are, sigmoid scores
    normalised to sum to 1 over the experts (DeepSeek-V3), so that a balanced router
    scores 1 either way. probs [..., E]."""
    errors.one_of("scoring", scoring, SCORINGS)
    return probs if scoring == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)


def sequence_sums(routing: Routing, *, sequences: int, scoring: str = "softmax"):
    """Per sequence, the two sums the balance loss is made of, for tokens laid out
    [sequences, t / sequences]: (counts [s, E], token-slots sent to each expert; prob_sums
    [s, E], the sum over the tokens of `balance_probs`). Both add over the devices a
    sequence is split over; counts carry no gradient (a choice is not differentiable)."""
    t, k = routing.experts.shape
    E = routing.probs.shape[-1]
    if t % sequences:
        raise ConfigError(f"{t} tokens do not split into sequences={sequences}: give the tokens laid out "
                          "[sequences, tokens per sequence]")
    dtype = jnp.promote_types(routing.probs.dtype, jnp.float32)     # counts exact to 2^24
    chosen = jax.nn.one_hot(routing.experts.reshape(sequences, -1), E, dtype=dtype)       # [s, t/s*k, E]
    probs = balance_probs(routing.probs, scoring).reshape(sequences, -1, E).astype(dtype)
    return jnp.sum(chosen, axis=1), jnp.sum(probs, axis=1)


def sequence_balance_loss(counts, prob_sums, *, tokens: int, top_k: int):
    """aux [s] = E * sum_e f_e P_e per sequence from `sequence_sums` over its whole
    length `tokens`: f_e = counts / (tokens * k), P_e = prob_sums / tokens."""
    E = counts.shape[-1]
    return E * jnp.sum(counts / (tokens * top_k) * (prob_sums / tokens), axis=-1)


def load_balancing_loss(routing: Routing, *, scoring: str = "softmax"):
    """Switch/GShard auxiliary loss E * sum_e f_e P_e over all the tokens, as one group
    (1 when balanced)."""
    t, k = routing.experts.shape
    counts, prob_sums = sequence_sums(routing, sequences=1, scoring=scoring)
    return sequence_balance_loss(counts, prob_sums, tokens=t, top_k=k)[0]
