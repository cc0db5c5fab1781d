"""ModelConfig: the decoder-only transformer every parallel version builds, with the
checks that refuse a config no model has (jaxpar.errors.ConfigError naming the fix)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

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
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, numbers.Real) or not (
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
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < float("inf"):
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
