"""The unsharded model every parallel version is tested against.

Plain, obviously-correct jnp: einsum attention with an explicit mask, GeLU and SwiGLU
MLPs, a top-k MoE computed densely over all experts, pre-norm blocks, next-token loss.
No sharding, no collectives, no cleverness: if a parallel version disagrees with this
package, the parallel version is wrong.

    config    ModelConfig: the model's sizes and choices, and the checks that refuse bad ones
    layers    RMSNorm, attention (grouped-query, causal), the rotary embedding, the MLP
    experts   the routers, the balance loss and the MoE layer (load balancing explained there)
    model     init_params, the block, the forward pass and the loss

Every name is used from the package: `from jaxpar import reference`, then
`reference.loss(params, tokens, cfg)`. A module imports only modules listed above it:
model uses experts, layers and config; experts uses layers and config's ROUTERS; layers
and config use neither.

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

The names are imported eagerly, not lazily as in the technique packages: every module
here needs JAX, so a lazy import would save nothing.
"""

from jaxpar.reference.config import MAX_SIZE, ROUTERS, ModelConfig
from jaxpar.reference.experts import balance_loss, moe, moe_and_routing, router_choice, router_weights
from jaxpar.reference.layers import attention, attention_layer, attention_shapes, mlp, rms_norm, rope, statistics_dtype
from jaxpar.reference.model import (block, block_and_balance, cast, cross_entropy, forward, forward_and_balance,
                                    init_params, layer_params, lm_head_loss, loss, loss_and_balance)

__all__ = [
    "MAX_SIZE", "ROUTERS", "ModelConfig",
    "attention", "attention_layer", "attention_shapes", "mlp", "rms_norm", "rope", "statistics_dtype",
    "balance_loss", "moe", "moe_and_routing", "router_choice", "router_weights",
    "block", "block_and_balance", "cast", "cross_entropy", "forward", "forward_and_balance", "init_params",
    "layer_params", "lm_head_loss", "loss", "loss_and_balance",
]
