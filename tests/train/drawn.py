"""Training configurations drawn from everything `ParallelSpec.problems()` accepts, for
the property tests of the composed model (tests/train/test_drawn.py).

`configurations(family)` draws a `reference.ModelConfig` (layers, heads with every legal
KV-head count down to one (MQA), head_dim, d_ff, vocab, GeLU or SwiGLU, RoPE on or off,
dense or an MoE of 4-8 experts with top-1 or top-2, a softmax or sigmoid router, with or
without the balance loss and DeepSeek-V3's selection bias), a `ParallelSpec` over at most 8
devices (dp, pp, tp, cp, ep of any size whose product is <= 8, odd sizes included; every
registered schedule with microbatches and chunks it accepts; SP, recompute (none, full, or
matmuls and collectives kept), ZeRO 0-3
where the spec accepts it, ring or Ulysses, both token layouts, even or uneven layers per
stage) and a batch and a sequence length, built to satisfy the
divisibility rules and then filtered by `problems()` itself, so whatever it accepts may
be drawn. A family pins one axis above 1 so that a few examples cover every technique.
"""

from __future__ import annotations

import dataclasses

from hypothesis import assume
from hypothesis import strategies as st

from jaxpar import reference
from jaxpar.schedules import orders
from jaxpar.train.spec import ParallelSpec

MAX_DEVICES = 8
FAMILIES = ("pipeline", "tensor", "context", "expert", "any")


@dataclasses.dataclass(frozen=True)
class Drawn:
    cfg: reference.ModelConfig
    spec: ParallelSpec
    batch_size: int
    seq_len: int

    def __str__(self) -> str:
        c = self.cfg
        model = (f"L{c.n_layers} D{c.d_model} N{c.n_heads} K{c.n_kv_heads} H{c.head_dim} F{c.d_ff} V{c.vocab} "
                 f"{c.mlp}{' rope' if c.rope_theta else ''}")
        if c.n_experts:
            model += (f" E{c.n_experts} top{c.top_k} {c.router}{'' if c.moe_renormalize else ' raw-gates'}"
                      f"{f' aux{c.aux_loss:g}' if c.aux_loss else ''}{f' bias{c.bias_rate:g}' if c.bias_rate else ''}")
        return f"{model} | {self.spec!r} | batch {self.batch_size} x {self.seq_len}"


def _axes(draw, family: str, moe: bool) -> dict[str, int]:
    """Axis sizes with product <= 8: the family's axis above 1, and how many axes above 1
    drawn from (3, 2, 2, 1), so that most draws compose techniques and the first one a
    derandomized run makes (hypothesis starts from each choice's first option) is 3D;
    ep only for an MoE."""
    pinned = {"pipeline": "pp", "tensor": "tp", "context": "cp", "expert": "ep"}.get(family)
    wide = draw(st.sampled_from([3, 2, 2, 1]))
    axes = ["dp", "pp", "tp", "cp"] + (["ep"] if moe else [])
    chosen = ([pinned] if pinned else []) + [a for a in draw(st.permutations(axes)) if a != pinned]
    sizes, budget = dict.fromkeys(("dp", "pp", "tp", "cp", "ep"), 1), MAX_DEVICES
    for i, axis in enumerate(chosen[:wide]):
        after = 2 ** (wide - 1 - i)                  # the axes still to size take at least 2 each
        sizes[axis] = draw(st.sampled_from([n for n in (2, 4, 3, 8) if n * after <= budget]))
        budget //= sizes[axis]
    return sizes


def _options(family: str, options: list) -> st.SearchStrategy:
    """sampled_from `options` turned by the family's place in FAMILIES: hypothesis starts
    from the first option, so each family's first draw starts from another one."""
    k = FAMILIES.index(family) % len(options)
    return st.sampled_from(options[k:] + options[:k])


def _schedule(draw, family: str, pp: int) -> tuple[str, int | None, int]:
    """(schedule, chunks, microbatches) the schedule accepts at pp stages (at most 2p + 2
    microbatches: bigger tables cost compile time, not coverage)."""
    name = draw(_options(family, list(orders.REGISTRY)[::-1]))
    chunks = draw(st.sampled_from([None, 3])) if name == "interleaved" else None
    low = {"interleaved": pp, "zb-h1": pp, "zb-h2": pp, "dualpipe-v": 2 * pp - 1}.get(name, 1)
    m = draw(st.integers(low, max(low, 2 * pp + 2)))
    if name == "interleaved":
        m = max(pp, m // pp * pp)
    return name, chunks, m


@st.composite
def configurations(draw, family: str = "any") -> Drawn:
    moe = family == "expert" or draw(st.booleans())
    sizes = _axes(draw, family, moe)
    dp, pp, tp, cp, ep = (sizes[a] for a in ("dp", "pp", "tp", "cp", "ep"))
    name, chunks, m = _schedule(draw, family, pp)      # any schedule, pp = 1 too (the one-stage program)
    attention = draw(_options(family, ["ring", "ulysses"])) if cp > 1 else "ring"
    layout = draw(_options(family, ["zigzag", "contiguous"])) if cp > 1 else "contiguous"
    sp = draw(_options(family, [True, False])) if tp > 1 else False
    recompute = draw(_options(family, ["dots", "none", "full"]))
    zero = draw(_options(family, [3, 1, 0, 2]))
    spec = ParallelSpec(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep, schedule=name, chunks=chunks, microbatches=m,
                        sequence_parallel=sp, recompute=recompute, zero=zero, attention=attention, layout=layout)
    stages = pp * spec.resolved_chunks        # deeper stacks add compile time, not coverage: <= 2 layers a stage
    # uneven stages wherever pp > 1: each stage 1 or 2 layers, at least one of each; past 4
    # stages one stage of 2
    layer_counts = None
    if pp > 1 and draw(st.booleans()):
        if stages <= 4:
            layer_counts = tuple(draw(st.lists(st.sampled_from([1, 2]), min_size=stages, max_size=stages)
                                      .filter(lambda counts: len(set(counts)) == 2)))
        else:
            heavy = draw(st.integers(0, stages - 1))
            layer_counts = tuple(2 if k == heavy else 1 for k in range(stages))
        spec = dataclasses.replace(spec, layers_per_stage=layer_counts)

    # the model: sized to the mesh, so that most draws satisfy the rules by construction
    per_tp = draw(st.sampled_from([1, 2])) * (cp if attention == "ulysses" else 1)
    n_heads = tp * per_tp
    legal_kv = [k for k in range(1, n_heads + 1) if n_heads % k == 0 and (k % tp == 0 or tp % k == 0)]
    n_kv_heads = draw(st.sampled_from(legal_kv))
    rope = draw(st.booleans())
    head_dim = draw(st.sampled_from([2, 4]))
    n_experts, top_k, renormalize, balance = 0, 2, True, {}
    if moe:
        n_experts = draw(st.sampled_from([e for e in range(4, 9) if e % ep == 0]))
        top_k = draw(st.sampled_from([1, 2]))
        router = draw(st.sampled_from(["softmax", "sigmoid"]))
        renormalize = router == "sigmoid" or draw(st.booleans())
        balance = dict(router=router, aux_loss=draw(st.sampled_from([0.0, 0.01])),
                       bias_rate=draw(st.sampled_from([0.0, 1e-3])) if router == "sigmoid" else 0.0)
    n_layers = (sum(layer_counts) if layer_counts else stages * (draw(st.sampled_from([1, 2])) if stages <= 4 else 1)) if pp > 1 \
        else draw(st.integers(1, 2))
    cfg = reference.ModelConfig(
        n_layers=n_layers,
        d_model=draw(st.sampled_from([8, 16])), n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        d_ff=tp * draw(st.sampled_from([4, 8])), vocab=tp * draw(st.sampled_from([4, 8])) if tp > 2 else 16,
        mlp=draw(st.sampled_from(["gelu", "swiglu"])), n_experts=n_experts, top_k=top_k,
        moe_renormalize=renormalize, rope_theta=10000.0 if rope else 0.0, **balance)
    rows = dp * ep * m
    per = cp * (2 if layout == "zigzag" and cp > 1 else 1) * (tp if sp else 1)
    seq_len = per * draw(st.sampled_from([1, 2])) if per > 1 else draw(st.sampled_from([4, 8]))
    drawn = Drawn(cfg, spec, rows * draw(st.sampled_from([1, 2])) if rows < 8 else rows, seq_len)
    assume(not spec.problems(cfg, batch_size=drawn.batch_size, seq_len=seq_len, n_devices=spec.devices))
    return drawn
