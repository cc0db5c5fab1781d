"""The expert-parallel collectives and bytes in closed form (pure Python: the planner reads it).

`ep_moe_collectives(*, cfg, batch_size, seq_len, dtype, dp, ep, capacity_factor,
backward)` has the signature shape of the other techniques' formulas and returns the
`comms.Collectives` the compiled ep_moe shows. t = batch_size*seq_len/(dp*ep) tokens per
device, C slots per expert (`capacity`: ceil(cf*t*k/E), or t dropless); the
buffer each all-to-all exchanges is E*C*D elements per device:

    forward   2 all-to-alls (dispatch, combine), 2*E*C*D elements
    backward  2 all-to-alls (their transposes), the same; the router's gradient summed
              over all dp*ep devices (D*E elements; none when the router gets no
              gradient, `router_learns`) and the local experts' gradients over
              dp (E/ep * (2 or 3) * D*F, when dp > 1). XLA's combiner merges the two
              all-reduces into one when their groups are the same (ep = 1).

The buffer holds E*C = cf*t*k rows: the bytes follow tokens x k x D times the capacity
padding, and do not depend on the experts' width F (tests double F).

`balance_collectives` and `balance_reduction` are what the composed model's load
balancing adds (`jaxpar.train.balance`): per MoE layer, one all-reduce over cp of the
per-sequence sums when the balance loss is on; per step, one all-reduce of the
per-layer statistics.

`dispatch_bytes` is the lecture's exercise 7: what one device sends in one all-to-all,
t*k*(ep-1)/ep*D elements (the share for its own experts stays home), about 462 MB for
DeepSeek-V3's 4096 tokens, k=8, D=7168, EP=64 in bf16.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import numpy as np

from jaxpar import errors
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError


@runtime_checkable
class MoESizes(Protocol):
    """The sizes of `reference.ModelConfig` these formulas read."""

    d_model: int
    d_ff: int
    n_experts: int
    top_k: int
    mlp: str


def capacity(tokens: int, top_k: int, n_experts: int, capacity_factor) -> int:
    """Slots per expert per source device: ceil(capacity_factor * tokens * k / E), at
    least 1, at most `tokens`; `tokens` when capacity_factor is None (dropless: a token
    picks an expert at most once, so one device never sends an expert more). tokens,
    top_k and n_experts are whole numbers >= 1 (ConfigError)."""
    errors.whole("tokens", tokens, fix="tokens is the count one device routes, e.g. tokens=4096")
    errors.whole("top_k", top_k, fix="top_k is the number of experts per token, e.g. top_k=2")
    errors.whole("n_experts", n_experts, fix="n_experts counts the experts, e.g. n_experts=8")
    if capacity_factor is None:
        return tokens
    cf = errors.number("capacity_factor", capacity_factor,
                       fix="capacity_factor is slots per expert over the mean load, e.g. 1.25; None is dropless")
    return max(1, min(tokens, math.ceil(cf * tokens * top_k / n_experts)))


def _tokens(cfg, batch_size, seq_len, dp, ep) -> int:
    if not isinstance(cfg, MoESizes) or not cfg.n_experts:
        raise ConfigError(f"cfg={cfg!r}: give a reference.ModelConfig with n_experts >= 1")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("dp", dp), ("ep", ep)):
        errors.whole(name, value)
    errors.divisible("batch_size", batch_size, "dp x ep", dp * ep, why="the batch is split over the dp x ep devices",
                     fix=f"a multiple of {dp * ep}")
    errors.divisible("n_experts", cfg.n_experts, "ep", ep, why="each ep device owns E/ep whole experts",
                     fix=f"ep in ({errors.divisors(cfg.n_experts)})")
    return batch_size // (dp * ep) * seq_len


def constant_gates(cfg) -> bool:
    """Each token keeps one expert with renormalised gates: every gate is the constant 1,
    so nothing in the backward reads the experts' outputs or the router's scores."""
    return cfg.top_k == 1 and getattr(cfg, "moe_renormalize", True)


def router_learns(cfg) -> bool:
    """Whether the router gets a gradient (and so a gradient all-reduce): its gates depend
    on it (not `constant_gates`), or the balance loss reads its probabilities."""
    return not constant_gates(cfg) or bool(getattr(cfg, "aux_loss", 0))


def ep_moe_collectives(*, cfg: MoESizes, batch_size: int, seq_len: int, dtype, dp: int = 1, ep: int = 1,
                       capacity_factor=None, backward: bool = False, param_dtype=None) -> Collectives:
    """The collectives of jit(ep_moe) (backward=False) or of its backward alone."""
    t = _tokens(cfg, batch_size, seq_len, dp, ep)
    item = np.dtype(dtype).itemsize
    pitem = np.dtype(param_dtype or dtype).itemsize
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_ff
    C = capacity(t, cfg.top_k, E, capacity_factor)
    out = Collectives({"all-to-all": (2, 2 * E * C * D * item)}) if ep > 1 else Collectives()
    if not errors.flag("backward", backward):
        return out
    router = D * E * pitem if dp * ep > 1 and router_learns(cfg) else 0
    experts = (E // ep) * (3 if cfg.mlp == "swiglu" else 2) * D * F * pitem if dp > 1 else 0
    count = (1 if router else 0) + (1 if experts else 0)
    if ep == 1 and count == 2:
        count = 1                   # the same replica groups: XLA combines them
    return out + Collectives({"all-reduce": (count, router + experts)})


def _stats_itemsize(dtype) -> int:
    # the statistics are float32, or float64 for a float64 model (exact token counts)
    return max(np.dtype(dtype).itemsize, 4)


def balance_collectives(*, cfg, batch_size: int, seq_len: int, dtype, cp: int = 1,
                        backward: bool = False) -> Collectives:
    """The collectives load balancing adds to ONE MoE layer's forward (backward=False) or
    backward (True) on one device, inside a pipeline stage of the composed model.

    batch_size: the sequences this device's layer runs at once (a microbatch's rows on
    one device: global batch / (dp * ep * microbatches)); seq_len: the whole sequence
    (the layer sees seq_len / cp of it); dtype: the model's.

    forward   with cfg.aux_loss > 0 and cp > 1: 1 all-reduce over the cp devices of the
              per-sequence token-slot counts and probability sums, [batch_size, 2E] in
              float32 (float64 for a float64 model); nothing otherwise (the bias alone
              needs only counts, summed once per step: `balance_reduction`).
    backward  nothing: the loss's derivative is written from the summed counts the
              forward kept, and the statistics' cotangents are made on each device.
    Under recompute the F pass keeps nothing that reads the sums, so XLA drops the
    all-reduce there, and B's rerun of the forward has it: count the forward once per
    B instead of once per F (measured: pp2 x cp2 x ep2, with and without recompute).
    seq_len enters only the checks: the bytes do not depend on the sequence's length."""
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("cp", cp)):
        errors.whole(name, value)
    if not isinstance(cfg, MoESizes):
        raise ConfigError(f"cfg={cfg!r}: give a reference.ModelConfig")
    errors.divisible("seq_len", seq_len, "cp", cp, why="each cp device holds seq_len/cp tokens of a sequence",
                     fix=f"a multiple of {cp}")
    if errors.flag("backward", backward) or cp == 1 or not cfg.n_experts or not getattr(cfg, "aux_loss", 0):
        return Collectives()
    return Collectives({"all-reduce": (1, batch_size * 2 * cfg.n_experts * _stats_itemsize(dtype))})


def balance_reduction(*, cfg, layers: int, dtype, dp: int = 1, ep: int = 1, cp: int = 1,
                      tp: int = 1) -> dict[int, int]:
    """{group size: bytes} of the all-reduce load balancing adds once per step, outside
    the pipeline loop (the format of train.summary.expected_reductions): on each device
    the statistics of its `layers` layers (n_layers / pp), E token-slot counts and one
    balance-loss sum per layer, float32 (float64 for a float64 model), summed over the
    dp * ep * cp * tp devices. {} when the model does not balance (aux_loss = 0 and
    bias_rate = 0, or dense) or that group is one device. The balance loss joins the
    loss's own all-reduce, and the router bias's gradient (zero) is reduced as any
    weight's (not at all at pp = 1, where XLA sees the zero and folds it: train.summary):
    neither adds anything here."""
    for name, value in (("layers", layers), ("dp", dp), ("ep", ep), ("cp", cp), ("tp", tp)):
        errors.whole(name, value)
    if not isinstance(cfg, MoESizes):
        raise ConfigError(f"cfg={cfg!r}: give a reference.ModelConfig")
    group = dp * ep * cp * tp
    on = cfg.n_experts and (getattr(cfg, "aux_loss", 0) or getattr(cfg, "bias_rate", 0))
    if not on or group == 1:
        return {}
    return {group: layers * (cfg.n_experts + 1) * _stats_itemsize(dtype)}


def dispatch_bytes(*, tokens: int, top_k: int, d_model: int, ep: int, dtype) -> float:
    """Bytes one device sends in one all-to-all (exercise 7): t*k*(ep-1)/ep*D elements."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("d_model", d_model), ("ep", ep)):
        errors.whole(name, value)
    return tokens * top_k * (ep - 1) / ep * d_model * np.dtype(dtype).itemsize


def exercise_7() -> dict[str, float]:
    """DeepSeek-V3's MoE layer: D=7168, k=8, 4096 tokens per device, EP=64, bf16 (2 bytes)."""
    dispatch = dispatch_bytes(tokens=4096, top_k=8, d_model=7168, ep=64, dtype=np.float16)
    return {"dispatch": dispatch, "forward": 2 * dispatch, "forward_backward": 4 * dispatch}
