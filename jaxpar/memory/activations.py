"""Activation memory of one transformer layer, term by term (lecture 4.2-4.5).

Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer
models"), GPT-style layer with 16-bit activations and 1-byte dropout masks:

    bytes per layer = s*b*h * (34 + 5*a*s/h)          s sequence, b microbatch, h hidden, a heads

`layer_terms` lists the terms that make it up, each with the factor it is split by:

    term                          bytes        split by          why it is stored
    attention norm input          2sbh         sp                LayerNorm's backward
    QKV input (norm output)       2sbh         sp                X of X @ W_qkv
    Q and K                       4sbh         tp                softmax(QK^T)'s backward
    softmax output                2as^2b       tp                dropout's backward / P of P @ V
    softmax dropout mask          as^2b        tp                1 byte per element
    dropout output                2as^2b       tp                P of P @ V
    V                             2sbh         tp                P @ V's backward
    output projection input       2sbh         tp                X of X @ W_o
    attention dropout mask        sbh          sp
    MLP norm input                2sbh         sp
    MLP input (norm output)       2sbh         sp
    up projection output          8sbh         tp                GeLU's input (2sbF, F = 4h)
    GeLU output                   8sbh         tp                X of X @ W_down
    MLP dropout mask              sbh          sp

"tp" terms live inside the column/row-parallel region and are split t ways by tensor
parallelism; "sp" terms are the 10sbh TP cannot split, which sequence parallelism splits
along s. Context parallelism splits s for every term (and its ring attention is
blockwise: no s^2 term). Selective recompute drops the s^2 terms (recomputed in the
backward, as FlashAttention does); full recompute keeps only the layer's input, 2sbh.

Modern blocks (`Block` options; constants derived in docs/memory.md):
  dropout=False   no masks and no dropout output: 32sbh + 2as^2b
  kv_heads=K      K and V are 2sbh*K/a each: Q and K 2sbh(1 + K/a), V 2sbh*K/a
  mlp="swiglu"    gate and up outputs and their product (the down projection's input):
                  6sbF (a fused SwiGLU recomputes silu(gate)); F = d_ff
  flash=True      no s^2 term: the softmax statistics instead, 4asb (float32 lse)
RMSNorm stores its input like LayerNorm: the norm terms are the same.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxpar import errors
from jaxpar.errors import ConfigError

RECOMPUTE = ("none", "selective", "full")
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One transformer layer's shape and kind. Defaults: GPT-3 style (LayerNorm, GeLU MLP
    of 4h, dropout, multi-head attention, attention matrix materialised)."""

    hidden: int
    heads: int
    kv_heads: int | None = None     # None: = heads
    ffn: int | None = None          # None: 4 * hidden
    mlp: str = "gelu"
    dropout: bool = True
    flash: bool = False
    act_bytes: int = 2              # 16-bit activations

    def __post_init__(self):
        for name in ("hidden", "heads", "act_bytes"):
            errors.whole(name, getattr(self, name))
        if self.kv_heads is not None:
            errors.whole("kv_heads", self.kv_heads)
            if self.heads % self.kv_heads:
                raise ConfigError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}: each KV head "
                                  "serves heads/kv_heads query heads")
        if self.ffn is not None:
            errors.whole("ffn", self.ffn)
        errors.one_of("mlp", self.mlp, ("gelu", "swiglu"))
        errors.flag("dropout", self.dropout)
        errors.flag("flash", self.flash)

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def k(self) -> int:
        return self.kv_heads or self.heads


class Term(NamedTuple):
    name: str
    bytes: float       # for the whole layer, before any split
    split: str         # "tp": split by tensor parallelism; "sp": only by sequence parallelism
    quadratic: bool    # an s^2 term (dropped by selective recompute)


def layer_terms(block: Block, *, seq: int, batch: int) -> list[Term]:
    """The stored activations of one layer, unsplit (see the module docstring)."""
    errors.whole("seq", seq)
    errors.whole("batch", batch)
    s, b, h, a, f, k = seq, batch, block.hidden, block.heads, block.f, block.k
    x = block.act_bytes * s * b * h            # one [s, b, h] activation
    kv = x * k / a
    terms = [Term("attention norm input", x, "sp", False), Term("QKV input (norm output)", x, "sp", False),
             Term("Q and K", x + kv, "tp", False)]
    if block.flash:
        terms.append(Term("softmax statistics (lse)", 4 * a * s * b, "tp", False))
    else:
        scores = block.act_bytes * a * s * s * b
        terms.append(Term("softmax output", scores, "tp", True))
        if block.dropout:
            terms += [Term("softmax dropout mask", scores / block.act_bytes, "tp", True),
                      Term("dropout output", scores, "tp", True)]
    terms += [Term("V", kv, "tp", False), Term("output projection input", x, "tp", False)]
    if block.dropout:
        terms.append(Term("attention dropout mask", x / block.act_bytes, "sp", False))
    terms += [Term("MLP norm input", x, "sp", False), Term("MLP input (norm output)", x, "sp", False)]
    wide = block.act_bytes * s * b * f
    if block.mlp == "gelu":
        terms += [Term("up projection output", wide, "tp", False), Term("GeLU output", wide, "tp", False)]
    else:
        terms += [Term("gate output", wide, "tp", False), Term("up output", wide, "tp", False),
                  Term("gate x up (down projection input)", wide, "tp", False)]
    if block.dropout:
        terms.append(Term("MLP dropout mask", x / block.act_bytes, "sp", False))
    return terms


def layer_bytes(block: Block, *, seq: int, batch: int = 1, tp: int = 1, sp: bool = False, cp: int = 1,
                recompute: str = "none") -> float:
    """Bytes of one layer's stored activations on one device."""
    return sum(b for _, b in breakdown(block, seq=seq, batch=batch, tp=tp, sp=sp, cp=cp, recompute=recompute))


def breakdown(block: Block, *, seq: int, batch: int = 1, tp: int = 1, sp: bool = False, cp: int = 1,
              recompute: str = "none") -> list[tuple[str, float]]:
    """[(term, bytes on one device)] for one layer under tp (and sp), cp and recompute."""
    for name, value in (("tp", tp), ("cp", cp)):
        errors.whole(name, value)
    errors.flag("sp", sp)
    errors.one_of("recompute", recompute, RECOMPUTE)
    if seq % cp:
        raise ConfigError(f"seq={seq} is not divisible by cp={cp}: each cp rank holds seq/cp tokens")
    if sp and seq % (tp * cp):
        raise ConfigError(f"seq={seq} is not divisible by tp x cp = {tp * cp}: sequence parallelism keeps "
                          "seq/(tp cp) tokens per device")
    s = seq // cp
    if recompute == "full":
        return [("layer input (full recompute)", block.act_bytes * s * batch * block.hidden / (tp if sp else 1))]
    ring = dataclasses.replace(block, flash=True) if cp > 1 else block   # ring attention is blockwise
    out = []
    for t in layer_terms(ring, seq=s, batch=batch):
        if t.quadratic and recompute == "selective":
            continue
        out.append((t.name, t.bytes / (tp if t.split == "tp" or sp else 1)))
    return out


def gpt_formula(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1, sp: bool = False,
                recompute: str = "none") -> float:
    """The paper's closed forms (bytes per layer), for checking the terms:
    sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h);
    selective recompute drops 5as/h; full recompute 2sbh (/t with SP)."""
    sbh, q = seq * batch * hidden, 5 * heads * seq / hidden
    q = 0 if recompute == "selective" else q
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    if sp:
        return sbh * (34 + q) / tp
    return sbh * (10 + 24 / tp + q / tp)


# ---- the whole model on the first pipeline stage ---------------------------------------

def first_stage_bytes(block: Block, *, layers: int, seq: int, batch: int = 1, tp: int = 1, sp: bool = False,
                      cp: int = 1, recompute: str = "none", pp: int = 1, in_flight: float = 1) -> float:
    """Activation bytes on the first pipeline stage at its peak: layers per stage (the
    first stage takes ceil(layers/pp)) x one layer x `in_flight`, the microbatches whose
    activations it holds, in whole stages (a schedule's: `pipeline.formulas.in_flight`)."""
    errors.whole("layers", layers)
    errors.whole("pp", pp)
    errors.number("in_flight", in_flight, fix="give the microbatches in flight, e.g. "
                  "pipeline.formulas.in_flight('1f1b', p=8, m=64) = 8")
    per_stage = -(-layers // pp)
    return per_stage * layer_bytes(block, seq=seq, batch=batch, tp=tp, sp=sp, cp=cp, recompute=recompute) * \
        float(in_flight)
