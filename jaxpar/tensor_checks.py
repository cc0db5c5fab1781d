"""Checks of jaxpar.tensor against the reference, shared by `jaxpar verify tp|sp`, the
example and the benchmark: one training step of the block (output y and, from jax.vjp,
the input and every parameter gradient), and the collectives of its compiled forward and
backward programs next to `tensor.tp_block_collectives`.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from jaxpar import comms, reference, tensor
from jaxpar import mesh as mesh_lib
from jaxpar.mesh import DP, TP
from jaxpar.testing import assert_close, max_abs_diff


@dataclasses.dataclass
class BlockRun:
    """One step of tp_block and of reference.block on the same inputs."""

    out: tuple            # (y, (param grads, x grad)) from tp_block
    ref: tuple            # the same from reference.block
    forward: dict         # comms.nonzero of the compiled forward
    backward: dict        # comms.nonzero of the compiled backward (jit of the vjp function)
    formula_forward: dict
    formula_backward: dict

    @property
    def max_error(self) -> float:
        return max_abs_diff(self.out, self.ref)

    @property
    def collectives_match(self) -> bool:
        return self.forward == self.formula_forward and self.backward == self.formula_backward


def block_inputs(cfg: reference.ModelConfig, batch: int, seq: int, dtype=jnp.float32, seed: int = 0):
    """(params, x, dy) for one block; dy = N(0,1)/(B*T), the cotangent of a mean loss."""
    kp, kx, ky = jax.random.split(jax.random.PRNGKey(seed), 3)
    p = reference.layer_params(reference.init_params(kp, cfg, dtype), 0)
    x = jax.random.normal(kx, (batch, seq, cfg.d_model), dtype)
    dy = jax.random.normal(ky, (batch, seq, cfg.d_model), dtype) / (batch * seq)
    return p, x, dy


def run_block(cfg: reference.ModelConfig, mesh, *, sequence_parallel: bool, batch: int = 4,
              seq: int = 8, dtype=jnp.float32, seed: int = 0, collectives: bool = True) -> BlockRun:
    p, x, dy = block_inputs(cfg, batch, seq, dtype, seed)
    # Compile once, run the compiled programs and read their HLO (no second compile).
    fwd = jax.jit(lambda p, x: tensor.tp_block(p, x, mesh=mesh, cfg=cfg, sequence_parallel=sequence_parallel))
    fwd_c = fwd.lower(p, x).compile()
    y, vjp = jax.vjp(fwd, p, x)
    bwd_c = jax.jit(lambda vjp, dy: vjp(dy)).lower(vjp, dy).compile()
    out = (y, bwd_c(vjp, dy))
    ref = _reference_step(cfg)(p, x, dy)
    tp, dp = mesh.shape.get(TP, 1), mesh.shape.get(DP, 1)
    kw = dict(sequence_parallel=sequence_parallel, dp=dp)
    return BlockRun(
        out=out, ref=ref,
        forward=_stats(fwd_c) if collectives else {},
        backward=_stats(bwd_c) if collectives else {},
        formula_forward=tensor.tp_block_collectives(cfg, batch, seq, dtype, tp, **kw),
        formula_backward=tensor.tp_block_collectives(cfg, batch, seq, dtype, tp, backward=True, **kw),
    )


def _stats(compiled) -> dict:
    return comms.nonzero(comms.summarize(comms.collective_ops_from_hlo(compiled.as_text())))


@functools.cache
def _reference_step(cfg: reference.ModelConfig):
    def step(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: reference.block(p, x, cfg), p, x)
        return y, vjp(dy)
    return jax.jit(step)


def default_mesh():
    """dp x tp over the devices there are: tp=4 when 4 divides the count, else 2, else 1."""
    n = len(jax.devices())
    tp = next(t for t in (4, 2, 1) if n % t == 0)
    return mesh_lib.make_mesh(dp=n // tp, tp=tp)


def _fmt(stats: dict) -> str:
    return " + ".join(f"{c} {comms.SHORT[k]} {comms.human_bytes(b)}" for k, (c, b) in stats.items()) or "-"


def check_block(*, sequence_parallel: bool):
    from jaxpar.tour import Row

    start = time.perf_counter()
    m = default_mesh()
    cfg = reference.ModelConfig(n_layers=1, n_kv_heads=4, mlp="swiglu")
    run = run_block(cfg, m, sequence_parallel=sequence_parallel)
    try:
        assert_close(run.out, run.ref)
        close = True
    except AssertionError:
        close = False
    match = run.collectives_match
    name = "SP block (TP + sequence parallel)" if sequence_parallel else "TP block (Megatron)"
    return Row(technique=name, mesh=mesh_lib.describe(m), max_error=run.max_error,
               collectives=f"fwd {_fmt(run.forward)} | bwd {_fmt(run.backward)}"
                           + (" = formula" if match else " != formula"),
               seconds=time.perf_counter() - start, ok=close and match,
               note="y, dx, all param grads vs reference.block; f32 GQA SwiGLU B=4 T=8")


def check_counterexample():
    from jaxpar.tour import Row

    start = time.perf_counter()
    m = default_mesh()
    err = tensor.row_split_gelu_error(mesh=m)
    return Row(technique="counterexample: row-split A, GeLU of partial sums", mesh=mesh_lib.describe(m),
               max_error=err, collectives="-", seconds=time.perf_counter() - start,
               ok=err > 0.1 or m.shape[TP] == 1,
               note="tp=1: one device, nothing to split" if m.shape[TP] == 1
               else "ok = clearly wrong (lecture: 0.82 for its setup)")


def check_vocab_cross_entropy():
    """Vocabulary-parallel cross-entropy: loss and dL/dlogits vs reference.cross_entropy,
    collectives of the forward and of the backward vs tensor_vocab.vocab_collectives."""
    from jaxpar import tensor_vocab
    from jaxpar.tour import Row

    start = time.perf_counter()
    m = default_mesh()
    tp, dp = m.shape[TP], m.shape.get(DP, 1)
    B, T, V = 2 * dp, 8, 16 * tp
    logits = 4 * jax.random.normal(jax.random.PRNGKey(3), (B, T, V))
    targets = jax.random.randint(jax.random.PRNGKey(4), (B, T), 0, V)
    fn = lambda l: tensor_vocab.vocab_parallel_cross_entropy(l, targets, mesh=m)
    _, vjp = jax.vjp(fn, logits)
    fwd, bwd = jax.jit(fn), jax.jit(lambda ct: vjp(ct)[0])
    out = (fwd(logits), bwd(1.0))
    ref = jax.value_and_grad(lambda l: reference.cross_entropy(l, targets))(logits)
    got = [comms.nonzero(comms.collective_stats(f, a)) for f, a in ((fwd, logits), (bwd, 1.0))]
    want = [tensor_vocab.vocab_collectives(batch=B, seq=T, d_model=0, vocab=V, dtype=jnp.float32, tp=tp, dp=dp,
                                           what="cross_entropy", backward=b) for b in (False, True)]
    try:
        assert_close(out, ref)
        close = True
    except AssertionError:
        close = False
    return Row(technique="vocab-parallel cross-entropy", mesh=mesh_lib.describe(m),
               max_error=max_abs_diff(out, ref),
               collectives=f"fwd {_fmt(got[0])} | bwd {_fmt(got[1])}" + (" = formula" if got == want else " != formula"),
               seconds=time.perf_counter() - start, ok=close and got == want,
               note=f"logits [B, T, V/t] never gathered ({comms.human_bytes(logits.nbytes)} in all)")
