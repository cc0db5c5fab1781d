"""Context parallelism (lecture section 5): ring attention, zigzag load balancing, Ulysses.

    blockwise  one block of attention as (out, lse), the online-softmax merge, its backward
    zigzag     sequence layouts (contiguous, zigzag), the ring's block plan, the load report
    ring       ring attention: K/V round a ring of cp devices, memory-efficient custom_vjp
    ulysses    DeepSpeed-Ulysses all-to-all, and 2-D context parallelism (Ulysses x ring)
    formulas   the collectives and bytes in closed form (pure Python)
    verify     against reference.attention (`jaxpar verify cp|ulysses`)

>>> from jaxpar import context
>>> out = context.ring_attention(q, k, v, mesh=m, causal=True, layout="zigzag")   # == reference.attention

The names below load from their module on first use (PEP 562), so that importing
`jaxpar.context.formulas` or `zigzag` (pure Python, read by the planner) does not start JAX.
"""

from jaxpar import lazy

# public name -> the module of this package that defines it
_EXPORTS = {
    "blockwise": ("attend", "attend_backward", "merge", "softmax_block"),
    "zigzag": ("LAYOUTS", "LoadReport", "from_layout", "load_report", "plan", "positions", "to_layout"),
    "ring": ("relayout_shard", "ring_attention", "ring_attention_shard"),
    "ulysses": ("hybrid_attention", "hybrid_attention_shard", "ulysses_attention", "ulysses_attention_shard"),
    "formulas": ("hybrid_collectives", "ring_collectives", "ring_step", "ulysses_collectives"),
}
__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
