"""Sequence layouts for context parallelism and the block plan of the ring (pure Python).

The sequence of T tokens is cut into 2*cp chunks of c = T/(2cp) tokens. A layout says
which two chunks each of the cp ranks holds, in order:

    contiguous  rank i holds chunks 2i and 2i+1 (tokens [i*T/cp, (i+1)*T/cp)), the naive cut
    zigzag      rank i holds chunks i and 2cp-1-i, one early and one late (Llama 3's cut)

Under a causal mask a query chunk a sees a key chunk b wholly when a > b, half (the
diagonal, a lower triangle) when a == b, not at all when a < b. At ring step r rank i
holds the K/V of rank (i - r) mod cp; the relation of its two query chunks to those two
key chunks is one of five block kinds (`KINDS`), the *plan* of that step:

    full      every query sees every key: one 2c x 2c block, no mask
    diagonal  the rank's own K/V: one 2c x 2c block under the causal mask
    early_kv  every query sees the first key chunk only: 2c x c, no mask (zigzag, r <= i)
    late_q    only the second query chunk sees anything, every key: c x 2c (zigzag, r > i)
    skip      nothing is visible: no work at all (contiguous, r > i)

The ring (`ring.py`) executes `plan(cp, layout, causal)`; `load_report` reads the same
table, so the work it reports is the work the ring does. Under zigzag every rank does
the same work at every step after the first; under contiguous rank i works on i + 1
of the cp steps (lecture 5.3).

`to_layout` / `from_layout` reorder a sequence axis (numpy or jax arrays, no JAX import)
into and out of a layout, so that sharding the reordered axis over cp gives each rank
its chunks; RoPE positions must be reordered the same way (`positions`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar import errors
from jaxpar.errors import ConfigError

LAYOUTS = ("contiguous", "zigzag")
KINDS = ("skip", "full", "diagonal", "early_kv", "late_q")
SKIP, FULL, DIAGONAL, EARLY_KV, LATE_Q = range(len(KINDS))
# score elements computed per block kind, in units of c^2 (c = tokens per chunk)
COMPUTED = {SKIP: 0, FULL: 4, DIAGONAL: 4, EARLY_KV: 2, LATE_Q: 2}

MAX_CP = 1 << 16


def check_layout(layout) -> str:
    return errors.one_of("layout", layout, LAYOUTS)


def chunks(rank: int, cp: int, layout: str) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) rank `rank` holds, in its local order."""
    return (2 * rank, 2 * rank + 1) if layout == "contiguous" else (rank, 2 * cp - 1 - rank)


def order(cp: int, layout: str) -> np.ndarray:
    """The 2*cp chunk indices in the order the layout stores them (rank 0's two first)."""
    return np.array([c for r in range(cp) for c in chunks(r, cp, layout)], dtype=np.int64)


def positions(seq_len: int, cp: int, layout: str) -> np.ndarray:
    """Token positions in layout order: positions(T, cp, L)[j] is the position of the j-th
    token of the reordered sequence (what RoPE must use on it)."""
    check_sequence(seq_len, cp, layout)
    c = seq_len // (2 * cp)
    return (order(cp, layout)[:, None] * c + np.arange(c)[None, :]).reshape(-1)


def check_sequence(seq_len: int, cp: int, layout: str) -> int:
    """Refuse a sequence the layout cannot cut (contiguous: into cp pieces, zigzag: into 2*cp);
    return the tokens of one piece."""
    check_layout(layout)
    errors.whole("cp", cp, maximum=MAX_CP)
    errors.whole("seq_len", seq_len)
    pieces = 2 * cp if layout == "zigzag" else cp
    if seq_len % pieces:
        why = (f"the zigzag layout cuts the sequence into 2*cp={pieces} chunks, two per rank"
               if layout == "zigzag" else f"each of the cp={cp} ranks holds seq_len/cp tokens")
        ok = [m * pieces for m in (max(1, seq_len // pieces), seq_len // pieces + 1)]
        raise ConfigError(f"seq_len={seq_len} is not divisible by {pieces}: {why}. Fix: a sequence length "
                          f"that is a multiple of {pieces} (e.g. {' or '.join(map(str, dict.fromkeys(ok)))}), "
                          "or another cp")
    return seq_len // pieces


def _reorder(x, axis: int, cp: int, perm: np.ndarray):
    shape = tuple(x.shape)
    axis = axis % len(shape)
    pieces = len(perm)
    split = shape[:axis] + (pieces, shape[axis] // pieces) + shape[axis + 1:]
    index = (slice(None),) * axis + (perm,)
    return x.reshape(split)[index].reshape(shape)


def sequence_axis(x, axis) -> int:
    """`axis` as an index into x's dimensions (-rank .. rank-1 accepted), if x is an array
    and `axis` a whole number in range (ConfigError otherwise)."""
    shape = errors.array("x", x, nonempty=False, shape_doc="x with a sequence axis, e.g. q[batch, seq, heads, "
                         "head_dim]")
    if not errors.is_whole(axis) or not -len(shape) <= axis < len(shape):
        raise ConfigError(f"axis={axis!r}: x has shape {shape} (rank {len(shape)}), so its sequence axis is one of "
                          f"{-len(shape)} .. {len(shape) - 1}. Fix: the index of the sequence, e.g. axis=1 for "
                          "x[batch, seq, ...]")
    return int(axis) % len(shape)


def to_layout(x, cp: int, layout: str, *, axis: int = 1):
    """x with its sequence axis reordered into `layout` (a no-op for contiguous)."""
    axis = sequence_axis(x, axis)
    check_sequence(int(x.shape[axis]), cp, layout)
    return x if layout == "contiguous" else _reorder(x, axis, cp, order(cp, layout))


def from_layout(x, cp: int, layout: str, *, axis: int = 1):
    """The inverse of to_layout: the sequence axis back in natural order."""
    axis = sequence_axis(x, axis)
    check_sequence(int(x.shape[axis]), cp, layout)
    return x if layout == "contiguous" else _reorder(x, axis, cp, np.argsort(order(cp, layout)))


def _relation(a: int, b: int, causal: bool) -> str:
    """How query chunk a sees key chunk b: 'F' wholly, 'D' the diagonal triangle, 'S' not at all."""
    if not causal or a > b:
        return "F"
    return "D" if a == b else "S"


_PATTERNS = {"FFFF": FULL, "SSSS": SKIP, "DSFD": DIAGONAL, "FSFS": EARLY_KV, "SSFF": LATE_Q}


def step_kind(rank: int, step: int, cp: int, layout: str, causal: bool) -> int:
    """The block kind rank `rank` computes at ring step `step` (K/V of rank - step)."""
    src = (rank - step) % cp
    qa, kb = chunks(rank, cp, layout), chunks(src, cp, layout)
    pattern = "".join(_relation(a, b, causal) for a in qa for b in kb)
    if pattern not in _PATTERNS:  # cannot happen for the two layouts; guards a new one
        raise AssertionError(f"layout {layout}: rank {rank} step {step} has block pattern {pattern}")
    return _PATTERNS[pattern]


def plan(cp: int, layout: str, causal: bool) -> np.ndarray:
    """int table [step, rank] of block kinds (indices into KINDS)."""
    check_layout(layout)
    errors.whole("cp", cp, maximum=MAX_CP)
    return np.array([[step_kind(i, r, cp, layout, causal) for i in range(cp)] for r in range(cp)], dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Per-rank attention work of the ring for one layout: score elements computed (the
    blocks the plan runs, masked diagonals in full) and query-key pairs actually visible."""

    layout: str
    causal: bool
    seq_len: int
    cp: int
    computed: tuple[int, ...]    # per rank
    useful: tuple[int, ...]      # per rank
    steps_busy: tuple[int, ...]  # ring steps on which the rank computes anything

    @property
    def imbalance(self) -> float:
        """Busiest rank's computed work over the mean (1.0 = balanced)."""
        mean = sum(self.computed) / self.cp
        return max(self.computed) / mean if mean else 1.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"imbalance": self.imbalance}


def load_report(seq_len: int, cp: int, layout: str, causal: bool = True) -> LoadReport:
    """The work of each rank under `plan(cp, layout, causal)` for a sequence of seq_len."""
    check_sequence(seq_len, cp, layout)
    if seq_len % (2 * cp):
        raise ConfigError(f"seq_len={seq_len}: the load report counts chunks of seq_len/(2*cp); use a multiple "
                          f"of {2 * cp}")
    c = seq_len // (2 * cp)
    table = plan(cp, layout, causal)
    pair = {"F": c * c, "D": c * (c + 1) // 2, "S": 0}
    computed, useful, busy = [], [], []
    for i in range(cp):
        kinds = table[:, i]
        computed.append(int(sum(COMPUTED[int(k)] for k in kinds)) * c * c)
        busy.append(int(sum(1 for k in kinds if k != SKIP)))
        useful.append(sum(pair[_relation(a, b, causal)] for r in range(cp)
                          for a in chunks(i, cp, layout) for b in chunks((i - r) % cp, cp, layout)))
    return LoadReport(layout, causal, seq_len, cp, tuple(computed), tuple(useful), tuple(busy))
