"""Checks of jaxpar.tensor and jaxpar.tensor_vocab against the reference, shared by
`jaxpar verify tp|sp`, the example, the benchmark and the tests: one training step of the
block (output y and, from jax.vjp, the input and every parameter gradient), the vocabulary-
parallel embedding and LM head, and the collectives of each compiled forward and backward
program next to their formulas (`tensor.tp_block_collectives`, `tensor_vocab.vocab_collectives`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

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
    """(params, x, dy) for one block: weights ~ N(0, 1/fan_in) and norm gains 1, as
    reference.init_params draws them; x ~ N(0, 1); dy = N(0,1)/(B*T), the cotangent of a
    mean loss. Drawn with numpy: no RNG kernel to compile for each shape."""
    rng = np.random.default_rng(seed)
    D, N, H, F = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    fan_in = {"wq": D, "wk": D, "wv": D, "wo": N * H, "w_up": D, "w_gate": D, "w_down": F}
    p = {k: jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in[k]) if k in fan_in else np.ones(shape), dtype)
         for k, shape in tensor.block_param_shapes(cfg).items()}
    x = jnp.asarray(rng.standard_normal((batch, seq, D)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch, seq, D)) / (batch * seq), dtype)
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
    """dp x tp over the devices there are: tp=4 when 4 divides the count, else 2, else 1
    (the one choice of tp shared by the tour, example 03 and benchmarks/tensor.py)."""
    n = len(jax.devices())
    tp = next(t for t in (4, 2, 1) if n % t == 0)
    return mesh_lib.make_mesh(dp=n // tp, tp=tp)


def _close(out, ref) -> bool:
    try:
        assert_close(out, ref)
        return True
    except AssertionError:
        return False


def check_block(*, sequence_parallel: bool):
    from jaxpar.tour import Row

    start = time.perf_counter()
    m = default_mesh()
    batch = 2 * m.shape.get(DP, 1)
    cfg = reference.ModelConfig(n_layers=1, n_kv_heads=4, mlp="swiglu")
    run = run_block(cfg, m, sequence_parallel=sequence_parallel, batch=batch)
    match = run.collectives_match
    name = "SP block (TP + sequence parallel)" if sequence_parallel else "TP block (Megatron)"
    return Row(technique=name, mesh=mesh_lib.describe(m), max_error=run.max_error,
               collectives=f"fwd {comms.format_stats(run.forward)} | bwd {comms.format_stats(run.backward)}"
                           + (" = formula" if match else " != formula"),
               seconds=time.perf_counter() - start, ok=_close(run.out, run.ref) and match,
               note=f"y, dx, all param grads vs reference.block; f32 GQA SwiGLU B={batch} T=8")


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


def fwd_bwd(fn, *args, ct):
    """fn(*args) and its gradients for cotangent ct, from two compiled programs (the
    forward, and the backward alone: jit of the function jax.vjp returns), with the
    comms.nonzero collectives of each: (out, (fwd stats, bwd stats))."""
    fwd = jax.jit(fn)
    _, vjp = jax.vjp(fwd, *args)           # of the jitted fn: an eager shard_map costs seconds
    fwd = fwd.lower(*args).compile()
    bwd = jax.jit(lambda vjp, ct: vjp(ct)).lower(vjp, ct).compile()
    return (fwd(*args), bwd(vjp, ct)), (_stats(fwd), _stats(bwd))


def lm_head_inputs(batch: int, seq: int, d_model: int, vocab: int, dtype=jnp.float32, seed: int = 0):
    """(x, final_norm, unembed, targets) for the LM head: x ~ N(0, 1), gain near 1,
    unembed ~ N(0, 1/D), targets in [0, V). Drawn with numpy: no RNG kernel to compile."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (normal(batch, seq, d_model), 1 + 0.1 * normal(d_model), normal(d_model, vocab) / d_model ** 0.5,
            jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32))


def reference_lm_loss(x, final_norm, unembed, targets, eps: float = 1e-6):
    """The unsharded LM head + loss, as reference.forward and reference.loss end."""
    return reference.cross_entropy(reference.rms_norm(x, final_norm, eps) @ unembed, targets)


# jitted: one compile instead of one per primitive when run eagerly
reference_lm_loss_and_grads = jax.jit(jax.value_and_grad(reference_lm_loss, argnums=(0, 1, 2)))


def check_vocab():
    """Vocabulary-parallel embedding (output and dL/dembed vs embed[tokens]) and LM head +
    cross-entropy (loss and the gradients of x, final_norm, unembed vs reference_lm_loss);
    each program's collectives vs tensor_vocab.vocab_collectives. The logits [B, T, V/t]
    stay on their device."""
    from jaxpar import tensor_vocab
    from jaxpar.tour import Row

    start = time.perf_counter()
    m = default_mesh()
    tp, dp = m.shape[TP], m.shape.get(DP, 1)
    cfg = reference.ModelConfig(vocab=16 * tp)
    B, T, D, V = 2 * dp, 8, cfg.d_model, cfg.vocab
    x, gain, unembed, tokens = lm_head_inputs(B, T, D, V)
    embed = jax.random.normal(jax.random.PRNGKey(5), (V, D))
    emb, emb_stats = fwd_bwd(lambda e: tensor_vocab.vocab_parallel_embedding(e, tokens, mesh=m), embed, ct=x)
    y, emb_vjp = jax.vjp(lambda e: e[tokens], embed)
    head, head_stats = fwd_bwd(lambda *a: tensor_vocab.vocab_parallel_lm_loss(*a, tokens, mesh=m, cfg=cfg),
                               x, gain, unembed, ct=jnp.float32(1.0))
    head_ref = reference_lm_loss_and_grads(x, gain, unembed, tokens)
    out, ref = (emb, head), ((y, emb_vjp(x)), head_ref)
    kw = dict(batch=B, seq=T, d_model=D, vocab=V, dtype=jnp.float32, tp=tp, dp=dp)
    want = tuple(tuple(tensor_vocab.vocab_collectives(**kw, what=what, backward=b) for b in (False, True))
                 for what in ("embedding", "lm_loss"))
    match = (emb_stats, head_stats) == want
    cells = [f"{name} fwd {comms.format_stats(f)} bwd {comms.format_stats(b)}"
             for name, (f, b) in (("embed", emb_stats), ("head", head_stats))]
    return Row(technique="vocab-parallel embedding + LM head + CE", mesh=mesh_lib.describe(m),
               max_error=max_abs_diff(out, ref),
               collectives=" | ".join(cells) + (" = formula" if match else " != formula"),
               seconds=time.perf_counter() - start, ok=_close(out, ref) and match,
               note="tp=1: all V logits on each device" if tp == 1 else
               f"logits [B, T, V/t] per device; the full {comms.human_bytes(B * T * V * 4)} never exist")
