"""Composition proven: `jaxpar verify pp-tp`, `jaxpar verify train`, their tour rows.

`parity(spec, steps=20)`: the composed model trained for 20 steps on `spec`'s mesh
(`step.Trainer`) against the unsharded model (`unsharded.reference_parts`: reference.loss,
optax's norm, the same AdamW), each step at the weights it started from: its loss,
gradient norm and every gradient (read back from AdamW's first moment), and the update
AdamW makes of them; and the run's losses and gradient norms against the unsharded
model's own run. All relative, to the dtype's rule (testing.tolerance). `mixed_parity`:
the same for bf16 compute, each leaf's gradient by direction and length.

The reference model pipelined over pp with tensor-parallel stages over tp, the
vocab-parallel embedding first and the LM head with the vocab-parallel cross-entropy last
(`stages.py`), on dp x pp x tp, against reference.loss: the loss and every gradient. The
compiled pipeline sends are counted exactly against the plan; the tp all-reduces sit
inside the stage's branches and are reported as the upper bound the HLO gives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar import comms, reference
from jaxpar import mesh as mesh_lib
from jaxpar.pipeline import formulas, runtime
from jaxpar.schedules import schedule
from jaxpar.testing import Result, compare, skipped, tolerance
from jaxpar.train import model as model_lib
from jaxpar.train import stages, summary
from jaxpar.train.data import Corpus
from jaxpar.train.cache import TrainerCache
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer
from jaxpar.train.unsharded import reference_parts

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
    parts = reference_parts(cfg, optim, compute_name)      # the step in the halves `judged_run` compiles
    params = jax.device_get(reference.init_params(jax.random.key(0), cfg, dtype))
    opt = jax.device_get(parts.tx.init(params))
    corpus, losses, norms = Corpus(vocab=cfg.vocab), [], []
    for i in range(steps):
        loss, grads, norm, load = parts.gradients(params, corpus.batch(i, batch_size=batch_size, seq_len=seq_len))
        params, opt = jax.device_get(parts.apply(params, opt, grads, load))
        losses.append(float(loss))
        norms.append(float(norm))
    return np.array(losses), np.array(norms), jax.device_get(params)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(a, np.float64) for a in jax.tree.leaves(jax.device_get(tree))]


def relative(actual, expected, allowance=0.0) -> float:
    """max |actual - expected| (less `allowance`, elementwise: rounding the comparison
    itself cannot avoid) over max |expected|, in float64; 0 when both are zero."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    diff = float(np.max(np.maximum(np.abs(a - b) - allowance, 0.0), initial=0.0))
    scale = float(np.max(np.abs(b), initial=0.0))
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def applied_gradients(opt_before, opt_after, b1: float, dtype) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The gradients a step applied (clipped), read back from AdamW's first moment, which
    the step wrote: mu' = b1 mu + (1 - b1) g, so g = (mu' - b1 mu) / (1 - b1) with optax's
    constants in `dtype`; and, per leaf, what that read-back cannot resolve (the rounding
    of mu' and b1 mu, each up to one spacing, divided by 1 - b1). Leaves in jax.tree order."""
    decay, keep = np.asarray(b1, dtype).astype(np.float64), np.asarray(1 - b1, dtype).astype(np.float64)
    mu0, mu1 = (jax.device_get(optax.tree_utils.tree_get(o, "mu")) for o in (opt_before, opt_after))
    grads, unresolved = [], []
    for a, b in zip(jax.tree.leaves(mu0), jax.tree.leaves(mu1)):
        grads.append((np.asarray(b, np.float64) - decay * np.asarray(a, np.float64)) / keep)
        unresolved.append((np.abs(np.spacing(np.asarray(b))) + np.abs(np.spacing(decay.astype(b.dtype) * a)))
                          .astype(np.float64) / keep)
    return grads, unresolved


def _joined(opt):
    """A canonical optimizer state (mu and nu as {"blocks", "first", "last"}) with mu and nu
    in reference.init_params's structure, as the unsharded model's AdamW keeps them."""
    split = lambda x: isinstance(x, dict) and set(x) == {"blocks", "first", "last"}
    return jax.tree.map(lambda x: model_lib.join(x) if split(x) else x, opt, is_leaf=split)


def _direction_and_scale(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(1 - cos(a, b), | |a| / |b| - 1 |) of one leaf's gradients; (0, 0) when both are zero."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if not nb:
        return (0.0, 0.0) if not na else (math.inf, math.inf)
    return (1.0 - float(np.sum(a * b)) / (na * nb) if na else 1.0), abs(na / nb - 1.0)


def step_errors(parts, before, after, metrics, tokens, b1: float, dtype) -> dict[str, float]:
    """One step of a run judged at the weights it started from (`before` and `after`:
    `Trainer.canonical` of the states around it; `metrics` its loss and norm): the
    unsharded model's loss, norm and clipped gradients at those weights against the
    step's (its gradients read back from AdamW's first moment, `applied_gradients`), and
    the same AdamW update applied to those gradients against the step's new weights
    (less one rounding of each weight) and second moments. Each error relative, the max
    over the leaves of max |error| / max |reference|; the updates' relative to the step.
    Each leaf's gradient also by direction and length ("gradient directions": 1 - cos,
    "gradient scales": | |ours| / |reference| - 1 |), which bf16 is judged by."""
    (p0, opt0, _), (p1, opt1, _) = before, after
    loss, grads, norm, load = parts.gradients(p0, tokens)
    applied, unresolved = applied_gradients(opt0, opt1, b1, dtype)
    as_params = jax.tree.unflatten(jax.tree.structure(p0), [g.astype(dtype) for g in applied])
    ref_p1, ref_opt1 = parts.apply(p0, _joined(opt0), as_params, load)
    start, new, ref_new, ref_grads = _leaves(p0), _leaves(p1), _leaves(ref_p1), _leaves(grads)
    spacing = [np.abs(np.spacing(np.asarray(a, dtype))).astype(np.float64) for a in ref_new]
    nu, ref_nu = (_leaves(optax.tree_utils.tree_get(o, "nu")) for o in (opt1, ref_opt1))
    shapes = [_direction_and_scale(a, b) for a, b in zip(applied, ref_grads)]
    return {"step loss": relative(metrics["loss"], loss), "step norm": relative(metrics["norm"], norm),
            "gradients": max(relative(a, b, u) for a, b, u in zip(applied, ref_grads, unresolved)),
            "gradient directions": max(d for d, _ in shapes), "gradient scales": max(r for _, r in shapes),
            "updates": max([relative(a - s, b - s, e) for a, b, s, e in zip(new, ref_new, start, spacing)]
                           + [relative(a, b) for a, b in zip(nu, ref_nu)])}


def judged_run(trainer: Trainer, steps: int) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """`steps` steps of `trainer` on the corpus' batches from reference.init_params(key(0)),
    each judged at its own starting weights against the unsharded model with the same
    casts (`step_errors`: the max over the steps of each error), and the run's losses
    and gradient norms."""
    dtype = jnp.dtype(trainer.dtype)
    parts = reference_parts(trainer.cfg, trainer.optim, trainer.compute_dtype)
    corpus, errors = Corpus(vocab=trainer.cfg.vocab), {}
    state = trainer.init(jax.random.key(0))
    # on the host: the unsharded model's halves take the same inputs as in reference_run
    # (one compiled program each), not arrays laid out on the trainer's mesh
    before, losses, norms = jax.device_get(trainer.canonical(state)), [], []
    for i in range(steps):
        tokens = corpus.batch(i, batch_size=trainer.batch_size, seq_len=trainer.seq_len)
        state, m = trainer.step(state, tokens)
        after = jax.device_get(trainer.canonical(state))
        found = step_errors(parts, before, after, m, tokens, trainer.optim.b1, dtype)
        errors = {k: max(v, errors.get(k, 0.0)) for k, v in found.items()}
        losses.append(float(m["loss"]))
        norms.append(float(m["norm"]))
        before = after
    return errors, np.array(losses), np.array(norms)


def parity(spec: ParallelSpec, cfg: reference.ModelConfig = DENSE, *, steps: int = 20, batch_size: int = 8,
           seq_len: int = 16, optim: OptimConfig = OPTIM, dtype=jnp.float32, devices=None,
           trainers: TrainerCache | None = None) -> Result:
    """`steps` steps on `spec` against the unsharded model, each step at the same weights
    (`step_errors`: its loss, norm, gradients and update, where the reference's is
    well-conditioned), and the whole run by its trajectory: the losses and gradient norms
    against the unsharded model's own run ("losses", "grad norms"). Every error relative,
    held to the dtype's rule (testing.tolerance's rtol: 2e-5 in float32, 1e-12 in float64).
    The weights after several AdamW steps are not compared: AdamW divides each gradient by
    its own root mean square, so a gradient near zero whose rounding differs between two
    summation orders moves its weight by a full step either way. trainers: where to take
    the Trainer from (a `TrainerCache`: one an earlier call built), None: a new one."""
    start = time.perf_counter()
    devices = list(jax.devices()[:spec.devices] if devices is None else devices)
    trainer = (trainers or Trainer)(cfg, spec, optim, batch_size=batch_size, seq_len=seq_len, devices=devices,
                                    dtype=dtype)
    errors, losses, norms = judged_run(trainer, steps)
    ref_losses, ref_norms, _ = reference_run(cfg, optim, steps, batch_size, seq_len, jnp.dtype(dtype).name)
    errors = {"losses": relative(losses, ref_losses), "grad norms": relative(norms, ref_norms), **errors}
    rtol = tolerance(dtype)[0]
    c = summary.collectives(trainer, trainer.compiled)      # pp rank 0's: sends and its stages'
    measured = {"step": c["sends"] + c["stages"][0]}
    expected = {"step": c["expected_sends"] + c["expected_stages"][0]}
    return Result(name=f"train {spec.describe()}, {steps} steps", mesh=mesh_lib.describe(trainer.mesh),
                  errors=errors, tolerance=(rtol, 0.0), measured=measured, expected=expected,
                  passed=max(errors.values()) <= rtol and summary.matches(c),
                  seconds=time.perf_counter() - start,
                  note=f"relative to the unsharded model, each step at the same weights; loss {ref_losses[0]:.3f} "
                       f"-> {ref_losses[-1]:.3f}" + (", MoE" if cfg.n_experts else "") + "; collectives of pp rank 0")


TOUR, TOUR_STEPS = ("dp2 pp2 tp2", "pp2 cp2 ep2"), 20


def check_train(names=None) -> list[Result]:
    """The tour's rows: TOUR_STEPS steps on each of `names` (default TOUR; a mesh of more devices
    than there are is a skipped row)."""
    n = len(jax.devices())
    out = []
    for name in TOUR if names is None else names:
        spec, cfg, batch = MESHES[name]
        if spec.devices > n:
            mesh = " ".join(f"{a}={s}" for a, s in spec.sizes.items() if s > 1)
            out.append(skipped(f"train {spec.describe()}, {TOUR_STEPS} steps", needs=spec.devices, have=n,
                               mesh=mesh))
        else:
            out.append(parity(spec, cfg, steps=TOUR_STEPS, batch_size=batch))
    return out


# ---- mixed precision ------------------------------------------------------------------------

# Bounds of a bf16 run (Trainer(compute_dtype=jnp.bfloat16)) against the unsharded model with
# the same casts, relative. The sharded program rounds to bf16 where the unsharded one does
# not (a tp shard's partial sums before their all-reduce, the microbatches' gradients summed
# in bf16), each rounding off by up to 2^-9. Over the run: losses within 2^-8 (bf16's
# epsilon), gradient norms within 1e-2; at each step's weights the loss and the norm the
# same. Each leaf's gradient at each step's weights, by direction (1 - cos) within 1e-3
# and by length (norm ratio - 1) within 2e-2: measured at most 3.3e-4 and 9.2e-3 on dp2
# tp2, dp2 pp2 tp2, tp2 with SP and dp8 (docs/train.md), while a wrong gradient of one
# leaf (doubled, dropped, a microbatch counted twice) is off by O(1) in one or the other,
# which AdamW's update alone would hide (it divides each gradient by its own scale). The
# AdamW update of the gradients the step applied is held to the float32 rule: the state
# and the optimizer are float32, nothing bf16 is left in that comparison.
MIXED_BOUNDS = {"losses": 2 ** -8, "grad norms": 1e-2, "step loss": 2 ** -8, "step norm": 1e-2,
                "gradient directions": 1e-3, "gradient scales": 2e-2}


def mixed_parity(spec: ParallelSpec, cfg: reference.ModelConfig = DENSE, *, steps: int = 4, batch_size: int = 8,
                 seq_len: int = 16, optim: OptimConfig = OPTIM, devices=None,
                 trainers: TrainerCache | None = None) -> Result:
    """`steps` bf16 steps (float32 state) on `spec` against the unsharded model with the same
    casts (`mixed_errors`): each of MIXED_BOUNDS within its bound, the updates to the
    float32 rule, and the first step's loss (the same weights) nearer the bf16 model's
    than half the way to the float32 model's. trainers: as `parity`'s."""
    start = time.perf_counter()
    devices = list(jax.devices()[:spec.devices] if devices is None else devices)
    trainer = (trainers or Trainer)(cfg, spec, optim, batch_size=batch_size, seq_len=seq_len, devices=devices,
                                    compute_dtype=jnp.bfloat16)
    errors, scale = mixed_errors(trainer, steps)
    passed = mixed_within(errors, scale)
    return Result(name=f"train bf16 {spec.describe()}, {steps} steps", mesh=mesh_lib.describe(trainer.mesh),
                  errors=errors, tolerance=None, passed=passed, seconds=time.perf_counter() - start,
                  note="relative to the unsharded model with the same casts; bounds " +
                       ", ".join(f"{k} {v:.1e}" for k, v in MIXED_BOUNDS.items()) +
                       f", updates {tolerance(jnp.float32)[0]:.0e}; float32 vs bf16: "
                       + ", ".join(f"{k} {v:.1e}" for k, v in scale.items()))


def mixed_errors(trainer: Trainer, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """A bf16 run's errors (`judged_run` against the unsharded model with the same casts,
    and its losses and gradient norms against that model's run, and the first step's
    loss), and, for scale, the unsharded bf16 model's losses, first loss and norms against
    the float32 one's."""
    errors, losses, norms = judged_run(trainer, steps)
    args = (trainer.cfg, trainer.optim, steps, trainer.batch_size, trainer.seq_len, jnp.dtype(trainer.dtype).name)
    ref = reference_run(*args, jnp.dtype(trainer.compute_dtype).name)
    full = reference_run(*args)
    errors = {"losses": relative(losses, ref[0]), "grad norms": relative(norms, ref[1]),
              "first step": relative(losses[:1], ref[0][:1]), **errors}
    scale = {"losses": relative(ref[0], full[0]), "grad norms": relative(ref[1], full[1]),
             "first step": relative(ref[0][:1], full[0][:1])}
    return errors, scale


def mixed_within(errors: dict[str, float], scale: dict[str, float]) -> bool:
    """A bf16 run's errors (`mixed_errors`) within MIXED_BOUNDS, its updates within the
    float32 rule, and its first loss nearer the bf16 model's than half the way to the
    float32 one's."""
    return (all(errors[k] <= bound for k, bound in MIXED_BOUNDS.items())
            and errors["updates"] <= tolerance(jnp.float32)[0] and errors["first step"] <= scale["first step"] / 2)
