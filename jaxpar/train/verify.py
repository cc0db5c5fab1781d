"""Composition proven: `jaxpar verify pp-tp`, `jaxpar verify train`, their tour rows.

`parity(spec, steps=20)`: the composed model trained for 20 steps on `spec`'s mesh
(`step.Trainer`) against the unsharded model (`step.reference_trainer`: reference.loss,
optax.global_norm, the same AdamW), batch for batch: every step's loss and gradient
norm, and every parameter after the last step, to 1e-5 relative in float32.

The reference model pipelined over pp with tensor-parallel stages over tp, the
vocab-parallel embedding first and the LM head with the vocab-parallel cross-entropy last
(`stages.py`), on dp x pp x tp, against reference.loss: the loss and every gradient. The
compiled pipeline sends are counted exactly against the plan; the tp all-reduces sit
inside the stage's branches and are reported as the upper bound the HLO gives.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import comms, reference
from jaxpar import mesh as mesh_lib
from jaxpar.pipeline import formulas, runtime, schedule
from jaxpar.testing import Result, compare
from jaxpar.train import stages, summary
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer, reference_trainer

CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32)


def default_mesh():
    n = len(jax.devices())
    sizes = dict(dp=2, pp=2, tp=2) if n >= 8 else dict(pp=2, tp=2) if n >= 4 else dict(pp=1, tp=1)
    return mesh_lib.make_mesh(**sizes, devices=jax.devices()[:int(np.prod(list(sizes.values())))])


def check_pp_tp(name: str = "1f1b", microbatches: int = 2) -> Result:
    start = time.perf_counter()
    mesh = default_mesh()
    p, dp = mesh_lib.axis_size(mesh, mesh_lib.PP), mesh_lib.axis_size(mesh, mesh_lib.DP)
    s = schedule.make(name, stages=p, microbatches=microbatches)
    params = reference.init_params(jax.random.key(0), CFG)
    rows, seq = 2 * microbatches * dp, 8
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab, (rows, seq + 1)), jnp.int32)
    stage_fn, blocks, batch, kwargs = stages.arguments(params, tokens, mesh=mesh, cfg=CFG)
    pipe = runtime.pipeline(s, stage_fn, blocks, batch, **kwargs)
    args = (runtime.to_stages(blocks, s), *batch, kwargs["first_params"], kwargs["last_params"])
    compiled = pipe.step.lower(*args).compile()
    loss, grads = runtime.run_pipeline(pipe._replace(step=compiled), blocks, batch,
                                       first_params=kwargs["first_params"], last_params=kwargs["last_params"])
    ours = dict(loss=loss, blocks=grads.params, **grads.first, **grads.last)
    ref_loss, ref = jax.value_and_grad(reference.loss)(params, tokens, CFG)
    errors, rule, within = compare(ours, dict(loss=ref_loss, **ref))
    ops = comms.resolve(comms.collective_ops_from_hlo(compiled.as_text()), pipe.plan.runs())
    measured = comms.nonzero(comms.summarize([o for o in ops if o.kind == "collective-permute"]))
    expected = formulas.pipeline_collectives(schedule=s, batch_size=rows, features=seq * CFG.d_model,
                                             dtype=jnp.float32, dp=dp)
    expected = comms.Collectives({k: v for k, v in expected.items() if k == "collective-permute"})
    bound = comms.summarize([o for o in ops if o.kind != "collective-permute"])["all-reduce"]
    return Result(name=f"pp x tp {name} (embedding first, LM head last)", mesh=mesh_lib.describe(mesh),
                  errors=errors, tolerance=rule, measured={"pp sends": measured}, expected={"pp sends": expected},
                  passed=within and measured == expected, seconds=time.perf_counter() - start,
                  note=f"loss and every grad vs reference.loss; tp/dp all-reduces: at most {bound['count']} "
                       f"({bound['in_conditional']} inside the stage branches)")


# ---- training parity ------------------------------------------------------------------------

DENSE = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                              vocab=32, rope_theta=10000.0)
MOE = dataclasses.replace(DENSE, n_experts=4, top_k=2)
DEEP = dataclasses.replace(DENSE, n_layers=16)          # pp8 x 2 chunks
OPTIM = OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5)   # clip < the norms seen: clipping is exercised

# eight meshes covering every axis and schedule family (docs/train.md), each with the model it needs
MESHES: dict[str, tuple[ParallelSpec, reference.ModelConfig, int]] = {
    "1 device": (ParallelSpec(), DENSE, 8),
    "dp2 pp2 tp2": (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2), DENSE, 8),
    "pp2 tp2 cp2": (ParallelSpec(pp=2, tp=2, cp=2, microbatches=2, layout="zigzag"), DENSE, 8),
    "dp2 ep2 tp2": (ParallelSpec(dp=2, ep=2, tp=2, sequence_parallel=True, zero=1), MOE, 8),
    "pp2 cp2 ep2": (ParallelSpec(pp=2, cp=2, ep=2, microbatches=2), MOE, 8),
    "dp8": (ParallelSpec(dp=8, zero=1), DENSE, 8),
    "pp8 interleaved": (ParallelSpec(pp=8, schedule="interleaved", microbatches=8), DEEP, 8),
    "pp8 dualpipe-v": (ParallelSpec(pp=8, schedule="dualpipe-v", microbatches=16), DEEP, 16),
}


@functools.cache
def reference_run(cfg: reference.ModelConfig, optim: OptimConfig, steps: int, batch_size: int, seq_len: int,
                  dtype_name: str = "float32", compute_name: str | None = None):
    """(losses, norms, final params) of the unsharded model on the corpus' batches
    (compute_name, e.g. "bfloat16": mixed precision, reference.loss's casts)."""
    dtype = jnp.dtype(dtype_name)
    tx, step = reference_trainer(cfg, optim, compute_name)
    params = reference.init_params(jax.random.key(0), cfg, dtype)
    opt = tx.init(params)
    corpus, losses, norms = Corpus(vocab=cfg.vocab), [], []
    for i in range(steps):
        params, opt, loss, norm = step(params, opt, jnp.asarray(corpus.batch(i, batch_size=batch_size,
                                                                               seq_len=seq_len)))
        losses.append(float(loss))
        norms.append(float(norm))
    return np.array(losses), np.array(norms), jax.device_get(params)


def parity(spec: ParallelSpec, cfg: reference.ModelConfig = DENSE, *, steps: int = 20, batch_size: int = 8,
           seq_len: int = 16, optim: OptimConfig = OPTIM, dtype=jnp.float32, devices=None) -> Result:
    """`steps` steps on `spec` against the unsharded model: max relative error of the
    losses, the gradient norms and the final parameters (each leaf's max abs error over
    its max abs value), and of the first step's loss and gradient norm alone (before
    any update: the forward and backward at the same weights)."""
    start = time.perf_counter()
    devices = list(jax.devices()[:spec.devices] if devices is None else devices)
    trainer = Trainer(cfg, spec, optim, batch_size=batch_size, seq_len=seq_len, devices=devices, dtype=dtype)
    corpus = Corpus(vocab=cfg.vocab)
    state, losses, norms = trainer.init(jax.random.key(0)), [], []
    for i in range(steps):
        state, m = trainer.step(state, corpus.batch(i, batch_size=batch_size, seq_len=seq_len))
        losses.append(float(m["loss"]))
        norms.append(float(m["norm"]))
    params = jax.device_get(trainer.canonical(state)[0])
    ref_losses, ref_norms, ref_params = reference_run(cfg, optim, steps, batch_size, seq_len, jnp.dtype(dtype).name)
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a) - b)) / max(np.max(np.abs(b)), 1e-30))
    errors = {"losses": rel(losses, ref_losses), "grad norms": rel(norms, ref_norms),
              "params": max(rel(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))),
              "first step": max(rel(losses[:1], ref_losses[:1]), rel(norms[:1], ref_norms[:1]))}
    rtol = 1e-5 if jnp.dtype(dtype) == jnp.float32 else 1e-12
    c = summary.collectives(trainer, trainer.compiled)      # pp rank 0's: sends and its stages'
    measured = {"step": c["sends"] + c["stages"][0]}
    expected = {"step": c["expected_sends"] + c["expected_stages"][0]}
    return Result(name=f"train {spec.describe()}, {steps} steps", mesh=mesh_lib.describe(trainer.mesh),
                  errors=errors, tolerance=(rtol, 0.0), measured=measured, expected=expected,
                  passed=max(errors.values()) <= rtol and summary.matches(c),
                  seconds=time.perf_counter() - start,
                  note=f"relative to the unsharded model; loss {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}"
                       + (", MoE" if cfg.n_experts else "") + "; collectives of pp rank 0")


TOUR = ("dp2 pp2 tp2", "pp2 cp2 ep2")


def check_train(names=None) -> list[Result]:
    """The tour's rows: 20 steps on each of `names` (default TOUR; on fewer than 8
    devices, the meshes that fit)."""
    n = len(jax.devices())
    out = []
    for name in TOUR if names is None else names:
        spec, cfg, batch = MESHES[name]
        if spec.devices <= n:
            out.append(parity(spec, cfg, batch_size=batch))
    return out


# ---- mixed precision ------------------------------------------------------------------------

# Bounds of a bf16 run (Trainer(compute_dtype=jnp.bfloat16)) against the unsharded model with
# the same casts, relative. The sharded program rounds to bf16 where the unsharded one does
# not (a tp shard's partial sums before their all-reduce, the microbatches' gradients summed
# in bf16), each rounding off by up to 2^-9: losses within 2^-8 (bf16's epsilon), gradient
# norms within 1e-2. AdamW divides each gradient by its own root mean square, so a weight
# whose gradient is near zero takes a step of about lr in whichever direction the rounding
# left it: the updates (final params - initial, per weight, ||ours - reference|| / ||reference||)
# agree to a few percent only, as bf16 itself moves them from the float32 model's
# (`mixed_errors`' "float32 vs bf16"); 5e-2 still catches a wrong gradient, which moves
# them by O(1).
MIXED_BOUNDS = {"losses": 2 ** -8, "grad norms": 1e-2, "updates": 5e-2}


def train_run(trainer: Trainer, steps: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """(final state, losses, grad norms) of `steps` steps of `trainer` on the corpus' batches
    from reference.init_params(key(0))."""
    corpus = Corpus(vocab=trainer.cfg.vocab)
    state, losses, norms = trainer.init(jax.random.key(0)), [], []
    for i in range(steps):
        state, m = trainer.step(state, corpus.batch(i, batch_size=trainer.batch_size, seq_len=trainer.seq_len))
        losses.append(float(m["loss"]))
        norms.append(float(m["norm"]))
    return state, np.array(losses), np.array(norms)


def update_error(params, ref_params, start) -> float:
    """Max over the weights of ||(params - start) - (ref_params - start)|| / ||ref_params - start||:
    how far the steps taken are from the reference's (weights the steps left alone skipped)."""
    errs = [float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64) - s))
            for a, b, s in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), jax.tree.leaves(start))
            if np.any(np.asarray(b) != np.asarray(s))]
    return max(errs)


def mixed_errors(trainer: Trainer, losses, norms, params, steps: int) -> dict[str, dict[str, float]]:
    """A bf16 run's relative errors (losses, first-step loss, grad norms, updates) against
    the unsharded model with the same casts ("bf16"), and, for scale, the unsharded bf16
    model's against the float32 one ("float32 vs bf16")."""
    args = (trainer.cfg, trainer.optim, steps, trainer.batch_size, trainer.seq_len)
    dtype = jnp.dtype(trainer.dtype).name
    ref = reference_run(*args, dtype, jnp.dtype(trainer.compute_dtype).name)
    full = reference_run(*args, dtype)
    start = reference.init_params(jax.random.key(0), trainer.cfg, trainer.dtype)
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a) - b) / np.abs(b)))

    def errors(ls, ns, ps, r):
        return {"losses": rel(ls, r[0]), "first step": rel(ls[:1], r[0][:1]), "grad norms": rel(ns, r[1]),
                "updates": update_error(ps, r[2], start)}
    return {"bf16": errors(losses, norms, params, ref), "float32 vs bf16": errors(*ref, full)}


def mixed_parity(spec: ParallelSpec, cfg: reference.ModelConfig = DENSE, *, steps: int = 4, batch_size: int = 8,
                 seq_len: int = 16, optim: OptimConfig = OPTIM, devices=None) -> Result:
    """`steps` bf16 steps (float32 state) on `spec` against the unsharded model with the same
    casts: each of MIXED_BOUNDS within its bound, and the first step's loss (the same
    weights) nearer the bf16 model's than half the way to the float32 model's."""
    start = time.perf_counter()
    devices = list(jax.devices()[:spec.devices] if devices is None else devices)
    trainer = Trainer(cfg, spec, optim, batch_size=batch_size, seq_len=seq_len, devices=devices,
                      compute_dtype=jnp.bfloat16)
    state, losses, norms = train_run(trainer, steps)
    found = mixed_errors(trainer, losses, norms, jax.device_get(trainer.canonical(state)[0]), steps)
    errors, scale = found["bf16"], found["float32 vs bf16"]
    passed = all(errors[k] <= bound for k, bound in MIXED_BOUNDS.items()) and \
        errors["first step"] <= scale["first step"] / 2
    return Result(name=f"train bf16 {spec.describe()}, {steps} steps", mesh=mesh_lib.describe(trainer.mesh),
                  errors=errors, tolerance=None, passed=passed, seconds=time.perf_counter() - start,
                  note="relative to the unsharded model with the same casts; bounds " +
                       ", ".join(f"{k} {v:.1e}" for k, v in MIXED_BOUNDS.items()) +
                       "; float32 vs bf16: " + ", ".join(f"{k} {v:.1e}" for k, v in scale.items()))
