"""Expert parallelism (lecture section 6): routing, all-to-all dispatch and combine, capacity.

    router    softmax top-k and DeepSeek-V3's sigmoid router with a selection bias; the
              Switch/GShard load-balancing loss; expert load
    dispatch  ep_moe: pack per-expert buffers, all-to-all, local experts, all-to-all back;
              capacity and drops; MoEStats
    formulas  the collectives and bytes in closed form, exercise 7 (pure Python)
    verify    against reference.moe (`jaxpar verify ep`), the lecture's imbalance experiment

>>> from jaxpar import expert
>>> y, stats = expert.ep_moe(params, x, mesh=m, cfg=cfg, capacity_factor=1.25)

The names below load from their module on first use (PEP 562), so that importing
`jaxpar.expert.formulas` (pure Python, read by the planner) does not start JAX.
"""

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "router": ("Routing", "expert_load", "load_balancing_loss", "route", "update_bias"),
    "dispatch": ("MoEStats", "ep_moe", "ep_moe_shard", "positions"),
    "formulas": ("capacity", "dispatch_bytes", "ep_moe_collectives", "exercise_7"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxpar.expert' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxpar.expert.{_WHERE[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
