"""Activation memory of one transformer layer, term by term (lecture 4.2-4.5).

Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer
models"), GPT-style layer with 16-bit activations and 1-byte dropout masks:

    bytes per layer = s*b*h * (34 + 5*a*s/h)          s = seq_len, b = batch_size (one
                                                      microbatch's), h = d_model, a = n_heads

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
  n_kv_heads=K    K and V are 2sbh*K/a each: Q and K 2sbh(1 + K/a), V 2sbh*K/a; with t > K
                  each device holds one KV head (replicated t/K times), 2sbh/a, not 2sbh*K/(at)
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
MAX_SIZE = 1 << 24     # tokens in a sequence, sequences, widths: past any model (10M-token contexts)
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One transformer layer's shape and form, in reference.ModelConfig's names. Defaults:
    GPT-3 style (LayerNorm, GeLU MLP of 4h, dropout, multi-head attention, attention
    matrix materialised). n_kv_heads and d_ff given as None become n_heads and 4 * d_model."""

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None   # None: = n_heads
    d_ff: int | None = None         # None: 4 * d_model
    mlp: str = "gelu"
    dropout: bool = True
    flash: bool = False
    act_bytes: int = 2              # 16-bit activations

    def __post_init__(self):
        for name in ("d_model", "n_heads"):
            errors.whole(name, getattr(self, name), maximum=MAX_SIZE)
        errors.divisible("d_model", self.d_model, "n_heads", self.n_heads, why="each head is d_model/n_heads wide",
                         fix=f"n_heads one of {errors.divisors(self.d_model)}" if self.d_model <= 4096
                         else "an n_heads that divides d_model")
        if self.act_bytes not in (1, 2, 4, 8) or isinstance(self.act_bytes, bool):
            raise ConfigError(f"act_bytes={self.act_bytes!r}: bytes per activation element, 1, 2 (16-bit), 4 or 8")
        if self.n_kv_heads is not None:
            errors.whole("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ConfigError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: each "
                                  "KV head serves n_heads/n_kv_heads query heads")
        else:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.d_ff is not None:
            errors.whole("d_ff", self.d_ff)
        else:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        errors.one_of("mlp", self.mlp, ("gelu", "swiglu"))
        errors.flag("dropout", self.dropout)
        errors.flag("flash", self.flash)


class Term(NamedTuple):
    name: str
    bytes: float       # for the whole layer, before any split
    split: str         # "tp": split by tensor parallelism; "sp": only by sequence parallelism
    quadratic: bool    # an s^2 term (dropped by selective recompute)
    kv: float = 0.0    # of `bytes`, the K or V heads': split over at most n_kv_heads devices


def layer_terms(block: Block, *, seq_len: int, batch_size: int) -> list[Term]:
    """The stored activations of one layer, unsplit (see the module docstring)."""
    errors.whole("seq_len", seq_len, maximum=MAX_SIZE)
    errors.whole("batch_size", batch_size, maximum=MAX_SIZE)
    s, b, h, a, f, k = seq_len, batch_size, block.d_model, block.n_heads, block.d_ff, block.n_kv_heads
    x = block.act_bytes * s * b * h            # one [s, b, h] activation
    kv = x * k / a
    terms = [Term("attention norm input", x, "sp", False), Term("QKV input (norm output)", x, "sp", False),
             Term("Q and K", x + kv, "tp", False, kv=kv)]
    if block.flash:
        terms.append(Term("softmax statistics (lse)", 4 * a * s * b, "tp", False))
    else:
        scores = block.act_bytes * a * s * s * b
        terms.append(Term("softmax output", scores, "tp", True))
        if block.dropout:
            terms += [Term("softmax dropout mask", scores / block.act_bytes, "tp", True),
                      Term("dropout output", scores, "tp", True)]
    terms += [Term("V", kv, "tp", False, kv=kv), Term("output projection input", x, "tp", False)]
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


def layer_bytes(block: Block, *, seq_len: int, batch_size: int = 1, tp: int = 1, sp: bool = False, cp: int = 1,
                recompute: str = "none") -> float:
    """Bytes of one layer's stored activations on one device."""
    return sum(b for _, b in breakdown(block, seq_len=seq_len, batch_size=batch_size, tp=tp, sp=sp, cp=cp,
                                       recompute=recompute))


def breakdown(block: Block, *, seq_len: int, batch_size: int = 1, tp: int = 1, sp: bool = False, cp: int = 1,
              recompute: str = "none") -> list[tuple[str, float]]:
    """[(term, bytes on one device)] for one layer under tp (and sp), cp and recompute."""
    for name, value in (("tp", tp), ("cp", cp)):
        errors.whole(name, value)
    errors.flag("sp", sp)
    errors.one_of("recompute", recompute, RECOMPUTE)
    if block.n_heads % tp or (block.n_kv_heads % tp and tp % block.n_kv_heads):
        raise ConfigError(f"tp={tp} splits neither the {block.n_heads} heads nor the {block.n_kv_heads} KV heads "
                          f"evenly: tensor parallelism gives each device n_heads/tp heads and n_kv_heads/tp KV heads "
                          f"(or one KV head, replicated, where tp is a multiple of n_kv_heads); use a tp that divides "
                          f"{block.n_heads}")
    if seq_len % cp:
        raise ConfigError(f"seq_len={seq_len} is not divisible by cp={cp}: each cp rank holds seq_len/cp tokens")
    if sp and seq_len % (tp * cp):
        raise ConfigError(f"seq_len={seq_len} is not divisible by tp x cp = {tp * cp}: sequence parallelism keeps "
                          "seq_len/(tp cp) tokens per device")
    s = seq_len // cp
    if recompute == "full":
        return [("layer input (full recompute)", block.act_bytes * s * batch_size * block.d_model / (tp if sp else 1))]
    ring = dataclasses.replace(block, flash=True) if cp > 1 else block   # ring attention is blockwise
    out = []
    for t in layer_terms(ring, seq_len=s, batch_size=batch_size):
        if t.quadratic and recompute == "selective":
            continue
        if t.split == "tp":      # K and V heads past n_kv_heads devices are replicated, not split
            out.append((t.name, (t.bytes - t.kv) / tp + t.kv / min(tp, block.n_kv_heads)))
        else:
            out.append((t.name, t.bytes / (tp if sp else 1)))
    return out


def gpt_formula(*, seq_len: int, batch_size: int, d_model: int, n_heads: int, tp: int = 1, sp: bool = False,
                recompute: str = "none") -> float:
    """The paper's closed forms (bytes per layer), for checking the terms:
    sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh/t (34 + 5as/h);
    selective recompute drops 5as/h; full recompute 2sbh (/t with SP)."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("d_model", d_model),
                        ("n_heads", n_heads), ("tp", tp)):
        errors.whole(name, value, maximum=MAX_SIZE)
    errors.flag("sp", sp)
    errors.one_of("recompute", recompute, RECOMPUTE)
    sbh, q = seq_len * batch_size * d_model, 5 * n_heads * seq_len / d_model
    q = 0 if recompute == "selective" else q
    if recompute == "full":
        return 2 * sbh / (tp if sp else 1)
    if sp:
        return sbh * (34 + q) / tp
    return sbh * (10 + 24 / tp + q / tp)


# ---- the whole model on the first pipeline stage ---------------------------------------

def first_stage_bytes(block: Block, *, n_layers: int, seq_len: int, batch_size: int = 1, tp: int = 1,
                      sp: bool = False, cp: int = 1, recompute: str = "none", pp: int = 1,
                      in_flight: float = 1) -> float:
    """Activation bytes on the first pipeline stage at its peak: layers per stage (the
    first stage takes ceil(n_layers/pp)) x one layer x `in_flight`, the microbatches whose
    activations it holds, in whole stages (a schedule's: `pipeline.formulas.in_flight`).
    batch_size is one microbatch's."""
    errors.whole("n_layers", n_layers)
    errors.whole("pp", pp)
    errors.number("in_flight", in_flight, fix="give the microbatches in flight, e.g. "
                  "pipeline.formulas.in_flight('1f1b', p=8, m=64) = 8")
    per_stage = -(-n_layers // pp)
    return per_stage * layer_bytes(block, seq_len=seq_len, batch_size=batch_size, tp=tp, sp=sp, cp=cp,
                                   recompute=recompute) * float(in_flight)
