"""Context parallelism proven against the reference, for `jaxpar verify cp|ulysses`, the tour,
example 05, the benchmark and the tests: the output of ring, Ulysses and 2-D attention and,
from jax.vjp, dQ, dK and dV against reference.attention; the collectives of each compiled
forward and backward program next to `formulas`; lecture exercise 6's merge; the load
report of lecture 5.3.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import mesh as mesh_lib
from jaxpar import reference, testing
from jaxpar.context import formulas, zigzag
from jaxpar.context.blockwise import merge, softmax_block
from jaxpar.context.ring import CHUNK, ring_attention
from jaxpar.context.ulysses import hybrid_attention
from jaxpar.mesh import CP, DP, TP, UCP
from jaxpar.testing import Result, Run, fwd_bwd, join_notes

# (method, layout, relayout) -> what runs; the mesh decides cp, ucp, dp and tp
METHODS = ("ring", "ulysses", "hybrid")


@dataclasses.dataclass(kw_only=True)
class AttentionRun(Run):
    """One forward + backward of a context-parallel attention and of the reference: out
    and ref are (o, (dq, dk, dv))."""

    def named(self, outputs) -> dict:
        return {"out": outputs[0], "dq": outputs[1][0], "dk": outputs[1][1], "dv": outputs[1][2]}


def attention_inputs(batch_size: int, seq_len: int, n_heads: int, n_kv_heads: int, head_dim: int,
                     dtype=jnp.float32, seed: int = 0, scale: float = 1.0):
    """(q, k, v, do): q, k, v ~ N(0, scale^2) (scale 100 gives logits near 1e4), do ~ N(0, 1).
    Drawn with numpy: no RNG kernel to compile for each shape."""
    rng = np.random.default_rng(seed)
    draw = lambda heads, s=scale: jnp.asarray(s * rng.standard_normal((batch_size, seq_len, heads, head_dim)), dtype)
    return draw(n_heads), draw(n_kv_heads), draw(n_kv_heads), draw(n_heads, 1.0)


@functools.cache
def _reference_step(causal: bool):
    def step(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: reference.attention(q, k, v, causal=causal), q, k, v)
        return o, vjp(do)
    return jax.jit(step)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCase:
    """One attention `run_attention` proves: how the method attends (causal, layout,
    relayout, chunk) and the inputs it attends over (q [B, T, N, H], k and v [B, T, K, H],
    drawn by `attention_inputs`). Defaults: a small GQA case, causal, contiguous."""

    causal: bool = True
    """Each token attends to itself and the tokens before it only."""
    layout: str = "contiguous"
    """The ring's token order over cp: "contiguous" or "zigzag" (balances causal work)."""
    relayout: bool = True
    """The program reorders tokens into the layout and back itself; False: the caller
    gives them in the layout's order (reordered outside the program, as a data loader would)."""
    chunk: int = CHUNK
    """Keys per block of the blockwise softmax."""
    kernel: str = "xla"
    """What computes the ring's blocks: "xla" (the blockwise ops) or "pallas" (kernels.flash)."""
    batch_size: int = 4
    """B, sequences (a multiple of dp)."""
    seq_len: int = 32
    """T, tokens per sequence (a multiple of what the layout splits it into)."""
    n_heads: int = 8
    """N, query heads."""
    n_kv_heads: int = 2
    """K, key and value heads (a divisor of N: grouped-query attention)."""
    head_dim: int = 4
    """H, the size of each head."""
    dtype: Any = jnp.float32
    """The inputs' dtype (jnp.float64 needs jax_enable_x64)."""
    seed: int = 0
    """The numpy seed the inputs are drawn with."""
    scale: float = 1.0
    """q, k and v ~ N(0, scale^2): 100 gives logits near 1e4."""

    def inputs(self):
        """(q, k, v, do): this case's `attention_inputs`."""
        return attention_inputs(self.batch_size, self.seq_len, self.n_heads, self.n_kv_heads, self.head_dim,
                                self.dtype, self.seed, self.scale)


def run_attention(method: str, mesh, case: AttentionCase = AttentionCase()) -> AttentionRun:
    """`method` (ring over cp, ulysses over cp, hybrid over ucp x cp) on `mesh`, against
    reference.attention, with both programs' collectives and their formulas."""
    causal, layout, relayout, chunk = case.causal, case.layout, case.relayout, case.chunk
    q, k, v, do = case.inputs()
    if method == "ring":
        fn = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=causal, layout=layout, relayout=relayout,
                                            chunk=chunk, kernel=case.kernel)
    elif method == "ulysses":
        fn = lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, causal=causal, ring_axis=None, ulysses_axis=CP,
                                              chunk=chunk)
    else:
        fn = lambda q, k, v: hybrid_attention(q, k, v, mesh=mesh, causal=causal, layout=layout, relayout=relayout,
                                              chunk=chunk)
    if relayout or method == "ulysses":
        out, (fwd, bwd) = fwd_bwd(fn, q, k, v, ct=do)
    else:  # the program takes the layout's order: reorder outside it, as a data loader would
        ring_cp = mesh_lib.axis_size(mesh, CP)
        into, back = (functools.partial(f, cp=ring_cp, layout=layout) for f in (zigzag.to_layout, zigzag.from_layout))
        out, (fwd, bwd) = fwd_bwd(fn, into(q), into(k), into(v), ct=into(do))
        out = jax.tree.map(back, out)
    cfg = reference.ModelConfig(n_heads=case.n_heads, n_kv_heads=case.n_kv_heads, head_dim=case.head_dim)
    size = functools.partial(mesh_lib.axis_size, mesh)
    kw = dict(cfg=cfg, batch_size=case.batch_size, seq_len=case.seq_len, dtype=case.dtype, dp=size(DP), tp=size(TP))
    if method == "ring":
        formula = functools.partial(formulas.ring_collectives, **kw, cp=size(CP), layout=layout, relayout=relayout)
    elif method == "ulysses":
        formula = functools.partial(formulas.ulysses_collectives, **kw, cp=size(CP))
    else:
        formula = functools.partial(formulas.hybrid_collectives, **kw, cp=size(CP), ucp=size(UCP), layout=layout,
                                    relayout=relayout)
    return AttentionRun(out=out, ref=_reference_step(causal)(q, k, v, do), forward=fwd, backward=bwd,
                        formula_forward=formula(), formula_backward=formula(backward=True))


def default_mesh(*, two_d: bool = False) -> tuple[jax.sharding.Mesh, str]:
    """(mesh, note) over the devices there are: dp x cp with cp 4 or 2
    (testing.default_mesh), or for two_d dp x cp=2 x ucp=2 (dp filling the rest); one
    device, or fewer than 4 for two_d: nothing is split."""
    n = len(jax.devices())
    if not two_d:
        return testing.default_mesh(CP)
    sizes = dict(dp=n // 4, cp=2, ucp=2) if n >= 4 else dict(dp=1, cp=1, ucp=1)
    used = math.prod(sizes.values())
    m = mesh_lib.make_mesh(**sizes, devices=jax.devices()[:used])
    note = ("fewer than 4 devices: nothing is split" if used == 1 else
            f"{n - used} of {n} devices unused" if used < n else "")
    return m, note


def check_attention(method: str, *, layout: str = "contiguous", causal: bool = True, kernel: str = "xla") -> Result:
    """One tour row: `method` on the default mesh against the reference, collectives
    against their formula. kernel="pallas" (the ring's blocks through kernels.flash) takes
    T = 32 cp and H = 16, the smallest the kernel's tiles take, and N = 4 (it runs
    interpreted off a GPU, tile by tile)."""
    start = time.perf_counter()
    m, mesh_note = default_mesh(two_d=method == "hybrid")
    B = 2 * mesh_lib.axis_size(m, DP)
    shape = dict(seq_len=32 * mesh_lib.axis_size(m, CP), head_dim=16, n_heads=4) if kernel == "pallas" else {}
    case = AttentionCase(causal=causal, layout=layout, batch_size=B, kernel=kernel, **shape)
    run = run_attention(method, m, case)
    errors, rule, within = run.compared
    name = {"ring": f"ring attention ({layout})", "ulysses": "Ulysses attention",
            "hybrid": f"2-D: Ulysses x ring ({layout})"}[method] + (", Pallas blocks" if kernel == "pallas" else "")
    return Result(name=name, mesh=mesh_lib.describe(m), errors=errors, tolerance=rule,
                  measured={"fwd": run.forward, "bwd": run.backward},
                  expected={"fwd": run.formula_forward, "bwd": run.formula_backward},
                  passed=within and run.collectives_match, seconds=time.perf_counter() - start,
                  note=join_notes(f"out, dQ, dK, dV vs reference.attention; f32 GQA N={case.n_heads} "
                                  f"K={case.n_kv_heads} B={B} T={case.seq_len}" + (", causal" if causal else ""),
                                  mesh_note))


def exercise_6() -> dict[str, float]:
    """Lecture exercise 6(a): block 1 scores [1, 2] values [10, 20], block 2 score [3]
    value [30]: each block's (o, lse), their merge, and softmax([1, 2, 3]) . [10, 20, 30]."""
    as_block = lambda s, v: softmax_block(jnp.asarray(s, jnp.float32).reshape(1, 1, 1, 1, -1),
                                          jnp.asarray(v, jnp.float32).reshape(1, 1, -1, 1))
    o1, lse1 = as_block([1.0, 2.0], [10.0, 20.0])
    o2, lse2 = as_block([3.0], [30.0])
    o, lse = merge(o1, lse1, o2, lse2)
    direct = float(jnp.dot(jax.nn.softmax(jnp.array([1.0, 2.0, 3.0])), jnp.array([10.0, 20.0, 30.0])))
    return {"lse1": float(lse1.squeeze()), "o1": float(o1.squeeze()), "lse2": float(lse2.squeeze()),
            "o2": float(o2.squeeze()), "lse": float(lse.squeeze()), "o": float(o.squeeze()), "direct": direct}


def check_merge() -> Result:
    start = time.perf_counter()
    ex = exercise_6()
    err = abs(ex["o"] - ex["direct"])
    return Result(name="online-softmax merge (exercise 6)", errors={"merged vs direct softmax": err},
                  tolerance=(0.0, 1e-5), passed=err < 1e-5 and abs(ex["o"] - 25.75) < 5e-3,
                  seconds=time.perf_counter() - start,
                  note=f"lse1 {ex['lse1']:.4f}, o1 {ex['o1']:.3f}, lse {ex['lse']:.4f}, o {ex['o']:.2f} "
                       "(lecture: 2.3133, 17.311, 3.4076, 25.75)")


def check_balance(seq_len: int = 8192, cp: int = 4) -> Result:
    """Lecture 5.3: causal work per rank, contiguous growing with rank, zigzag equal."""
    start = time.perf_counter()
    reports = {layout: zigzag.load_report(seq_len, cp, layout) for layout in zigzag.LAYOUTS}
    cont, zz = reports["contiguous"], reports["zigzag"]
    share = lambda r: "/".join(f"{u / sum(r.useful):.0%}" for u in r.useful)
    balanced = len(set(zz.computed)) == 1 and len(set(zz.useful)) == 1
    growing = all(a < b for a, b in zip(cont.useful, cont.useful[1:]))
    return Result(name=f"causal load balance T={seq_len} cp={cp}",
                  errors={"zigzag busiest/mean - 1": zz.imbalance - 1.0},
                  passed=balanced and growing and zz.imbalance == 1.0, seconds=time.perf_counter() - start,
                  note=f"visible pairs per rank: contiguous {share(cont)} (busiest/mean {cont.imbalance:.2f}), "
                       f"zigzag {share(zz)}")


def check_cp() -> list[Result]:
    """`jaxpar verify cp`: the merge, ring attention in both layouts (and zigzag with its
    blocks through the Pallas kernel), the load report."""
    return [check_merge(), check_attention("ring", layout="contiguous"), check_attention("ring", layout="zigzag"),
            check_attention("ring", layout="zigzag", kernel="pallas"), check_balance()]


def check_ulysses() -> list[Result]:
    """`jaxpar verify ulysses`: Ulysses over cp, and Ulysses inside the ring (2-D)."""
    return [check_attention("ulysses"), check_attention("hybrid", layout="zigzag")]
