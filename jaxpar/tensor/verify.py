"""Tensor parallelism proven against the reference, for `jaxpar verify tp|sp`, the tour,
example 03, the benchmark and the tests: one training step of the block (output y and,
from jax.vjp, the input and every parameter gradient), the vocabulary-parallel embedding
and LM head, and the collectives of each compiled forward and backward program next to
their formulas (`formulas.tp_block_collectives`, `embedding_collectives`, `lm_loss_collectives`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import reference, testing
from jaxpar import mesh as mesh_lib
from jaxpar.comms import Collectives, human_bytes
from jaxpar.mesh import DP, TP
from jaxpar.tensor import formulas
from jaxpar.tensor.block import tp_block
from jaxpar.tensor.layers import row_split_gelu_error
from jaxpar.tensor.vocab import vocab_parallel_embedding, vocab_parallel_lm_loss
from jaxpar.testing import Result, Run, compare, fwd_bwd, join_notes


@dataclasses.dataclass(kw_only=True)
class BlockRun(Run):
    """One step of tp_block and of reference.block on the same inputs: out and ref are
    (y, (param grads, x grad))."""

    def named(self, outputs) -> dict:
        return {"y": outputs[0], "dx": outputs[1][1], "param grads": outputs[1][0]}


def block_inputs(cfg: reference.ModelConfig, batch_size: int, seq_len: int, dtype=jnp.float32, seed: int = 0):
    """(params, x, dy) for one block: weights ~ N(0, 1/fan_in) and norm gains 1, as
    reference.init_params draws them; x ~ N(0, 1); dy = N(0,1)/(B*T), the cotangent of a
    mean loss. Drawn with numpy: no RNG kernel to compile for each shape."""
    rng = np.random.default_rng(seed)
    D, N, H, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    fan_in = {"wq": D, "wk": D, "wv": D, "wo": N * H, "w_up": D, "w_gate": D, "w_down": F}
    p = {k: jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in[k]) if k in fan_in else np.ones(shape), dtype)
         for k, shape in formulas.block_param_shapes(cfg).items()}
    x = jnp.asarray(rng.standard_normal((batch_size, seq_len, D)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch_size, seq_len, D)) / (batch_size * seq_len), dtype)
    return p, x, dy


def run_block(cfg: reference.ModelConfig, mesh, *, sequence_parallel: bool, batch_size: int = 4,
              seq_len: int = 8, dtype=jnp.float32, seed: int = 0, collectives: bool = True) -> BlockRun:
    p, x, dy = block_inputs(cfg, batch_size, seq_len, dtype, seed)
    # Two compiled programs, run, their HLO read (no second compile of either).
    out, (forward, backward) = fwd_bwd(
        lambda p, x: tp_block(p, x, mesh=mesh, cfg=cfg, sequence_parallel=sequence_parallel), p, x, ct=dy)
    ref = _reference_step(cfg)(p, x, dy)
    kw = dict(cfg=cfg, batch_size=batch_size, seq_len=seq_len, dtype=dtype, dp=mesh_lib.axis_size(mesh, DP),
              tp=mesh_lib.axis_size(mesh, TP), sequence_parallel=sequence_parallel)
    return BlockRun(
        out=out, ref=ref,
        forward=forward if collectives else Collectives(),
        backward=backward if collectives else Collectives(),
        formula_forward=formulas.tp_block_collectives(**kw),
        formula_backward=formulas.tp_block_collectives(**kw, backward=True),
    )


@functools.cache
def _reference_step(cfg: reference.ModelConfig):
    def step(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: reference.block(p, x, cfg), p, x)
        return y, vjp(dy)
    return jax.jit(step)


def default_mesh() -> tuple[jax.sharding.Mesh, str]:
    """(dp x tp mesh, note): tp 4 or 2, the one choice shared by the tour, example 03 and
    benchmarks/tensor.py (testing.default_mesh)."""
    return testing.default_mesh(TP)


def check_block(*, sequence_parallel: bool) -> Result:
    start = time.perf_counter()
    m, mesh_note = default_mesh()
    batch_size = 2 * mesh_lib.axis_size(m, DP)
    cfg = reference.ModelConfig(n_layers=1, n_kv_heads=4, mlp="swiglu")
    run = run_block(cfg, m, sequence_parallel=sequence_parallel, batch_size=batch_size)
    errors, rule, within = run.compared
    name = "SP block (TP + sequence parallel)" if sequence_parallel else "TP block (Megatron)"
    return Result(name=name, mesh=mesh_lib.describe(m), errors=errors, tolerance=rule,
                  measured={"fwd": run.forward, "bwd": run.backward},
                  expected={"fwd": run.formula_forward, "bwd": run.formula_backward},
                  passed=within and run.collectives_match, seconds=time.perf_counter() - start,
                  note=join_notes(f"fwd and bwd programs; f32 GQA SwiGLU B={batch_size} T=8", mesh_note))


def check_counterexample() -> Result:
    start = time.perf_counter()
    m, mesh_note = default_mesh()
    err = row_split_gelu_error(mesh=m)
    tp = mesh_lib.axis_size(m, TP)
    return Result(name="counterexample: row-split A, GeLU of partial sums", mesh=mesh_lib.describe(m),
                  errors={"psum(GeLU(partial)) vs GeLU(XA)": err}, passed=err > 0.1 or tp == 1,
                  seconds=time.perf_counter() - start,
                  note=join_notes("tp=1: one device, nothing to split" if tp == 1
                               else "passes when clearly wrong, > 0.1 (lecture: 0.82 for its setup)", mesh_note))


def lm_head_inputs(batch_size: int, seq_len: int, d_model: int, vocab: int, dtype=jnp.float32, seed: int = 0):
    """(x, final_norm, unembed, targets) for the LM head: x ~ N(0, 1), gain near 1,
    unembed ~ N(0, 1/D), targets in [0, V). Drawn with numpy: no RNG kernel to compile."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (normal(batch_size, seq_len, d_model), 1 + 0.1 * normal(d_model),
            normal(d_model, vocab) / d_model ** 0.5, jnp.asarray(rng.integers(0, vocab, (batch_size, seq_len)), jnp.int32))


# jitted: one compile instead of one per primitive when run eagerly
reference_lm_loss_and_grads = jax.jit(jax.value_and_grad(reference.lm_head_loss, argnums=(0, 1, 2)))


def check_vocab() -> Result:
    """Vocabulary-parallel embedding (output and dL/dembed vs embed[tokens]) and LM head +
    cross-entropy (loss and the gradients of x, final_norm, unembed vs reference.lm_head_loss);
    each program's collectives vs formulas. The logits [B, T, V/t] stay on their device."""
    start = time.perf_counter()
    m, mesh_note = default_mesh()
    tp, dp = mesh_lib.axis_size(m, TP), mesh_lib.axis_size(m, DP)
    cfg = reference.ModelConfig(vocab=16 * tp)
    B, T, D, V = 2 * dp, 8, cfg.d_model, cfg.vocab
    x, gain, unembed, tokens = lm_head_inputs(B, T, D, V)
    embed = jax.random.normal(jax.random.key(5), (V, D))
    emb, (emb_f, emb_b) = fwd_bwd(lambda e: vocab_parallel_embedding(e, tokens, mesh=m), embed, ct=x)
    y, emb_vjp = jax.vjp(lambda e: e[tokens], embed)
    head, (head_f, head_b) = fwd_bwd(lambda *a: vocab_parallel_lm_loss(*a, tokens, mesh=m, cfg=cfg),
                                     x, gain, unembed, ct=jnp.float32(1.0))
    head_ref = reference_lm_loss_and_grads(x, gain, unembed, tokens)
    errors, rule, within = compare(
        {"embedding": emb[0], "d embed": emb[1], "loss": head[0], "d x, d final_norm, d unembed": head[1]},
        {"embedding": y, "d embed": emb_vjp(x), "loss": head_ref[0], "d x, d final_norm, d unembed": head_ref[1]})
    kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, tp=tp, dp=dp)
    programs = ("embed fwd", "embed bwd", "head fwd", "head bwd")
    want = dict(zip(programs, (f(**kw, backward=b) for f in (formulas.embedding_collectives,
                                                              formulas.lm_loss_collectives) for b in (False, True))))
    got = dict(zip(programs, (emb_f, emb_b, head_f, head_b)))
    return Result(name="vocab-parallel embedding + LM head + CE", mesh=mesh_lib.describe(m), errors=errors,
                  tolerance=rule, measured=got, expected=want, passed=within and got == want,
                  seconds=time.perf_counter() - start,
                  note=join_notes("tp=1: all V logits on each device" if tp == 1 else
                               f"logits [B, T, V/t] per device; the full {human_bytes(B * T * V * 4)} never exist",
                               mesh_note))


def check_tp() -> list[Result]:
    """`jaxpar verify tp`: the TP block, the counterexample, the vocabulary-parallel head."""
    return [check_block(sequence_parallel=False), check_counterexample(), check_vocab()]


def check_sp() -> list[Result]:
    """`jaxpar verify sp`: the sequence-parallel block."""
    return [check_block(sequence_parallel=True)]

