"""Expert parallelism (lecture section 6): routing, all-to-all dispatch and combine, capacity.

    router    softmax top-k and DeepSeek-V3's sigmoid router with a selection bias; the
              Switch/GShard load-balancing loss (whole, or per sequence); expert load
    dispatch  ep_moe: pack per-expert buffers, all-to-all, local experts, all-to-all back;
              capacity and drops; MoEStats
    grouped   dropless on one device (ep = 1): each expert's rows one run of whole blocks,
              the experts as block-batched matmuls (about t*k rows, not the buffer's E*t)
    formulas  the collectives and bytes in closed form, exercise 7 (pure Python)
    verify    against reference.moe (`jaxpar verify ep`), the lecture's imbalance experiment

>>> from jaxpar import expert
>>> y, stats = expert.ep_moe(params, x, mesh=m, cfg=cfg, capacity_factor=1.25)

The names below load from their module on first use (PEP 562), so that importing
`jaxpar.expert.formulas` (pure Python, read by the planner) does not start JAX.
"""

from jaxpar import lazy

# public name -> the module of this package that defines it
_EXPORTS = {
    "router": ("Routing", "balance_probs", "expert_load", "load_balancing_loss", "route", "sequence_balance_loss",
               "sequence_sums", "update_bias"),
    "dispatch": ("MoEOptions", "MoEStats", "ep_moe", "ep_moe_shard", "positions"),
    "grouped": ("grouped_moe",),
    "formulas": ("balance_collectives", "balance_reduction", "capacity", "dispatch_bytes", "ep_moe_collectives",
                 "exercise_7"),
}
__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
