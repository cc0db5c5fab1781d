"""One model trained on a dp x pp x tp mesh, batch for batch against one device (lecture section 7).

    python examples/08_train_4d.py

On 8 fake CPU devices. Opens with the technique: a ParallelSpec (dp2 x pp2 x tp2, 1F1B
over 2 microbatches), the Trainer that compiles ONE step for it (one shard_map over
every axis: the pipeline, Megatron TP inside each stage, the gradient reduction over dp,
global-norm clipping, AdamW), 10 steps of it against `reference_trainer` (the same model
and AdamW on one device) fed the same batches: every loss and gradient norm, and every
parameter after the last step; and the step's collectives against the formulas. Then:
  demo 1  a ParallelSpec that does not fit the model: one ConfigError listing every
          violated constraint, before anything compiles;
  demo 2  the model as flax NNX parameters with partition metadata (flax's own
          get_partition_spec reads them), an MoE's experts split over ep;
  demo 3  the lesson's state checkpointed at step 10, steps 10-19 with `fit` and the run's
          summary: tokens/s, memory per device from the compiled step, the collectives of
          one step against the formulas; the checkpoint restored on pp4 x tp2, bit for bit;
  demo 4  recompute="dots": F keeps the matmuls' and collectives' outputs, B recomputes
          the rest; the same collectives, less compiled memory, the same training;
  demo 5  ZeRO-3 (FSDP) on dp4 x tp2: the weights stored as their dp-th, each layer's
          gathered as one flat buffer; its collectives and the training against one device.
The same on eight meshes (context parallelism, Ulysses, MoE over ep, ZeRO-1, interleaved
and DualPipe-V pipelines): `jaxpar verify train`, tests/train/test_train.py; training from
the command line: `jaxpar train --mesh dp=2,pp=2,tp=2 --steps 200`.
"""

import dataclasses
import tempfile

from jaxpar import mesh

mesh.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import reference, testing  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.train import Checkpoints, Corpus, LanguageModel, OptimConfig, ParallelSpec, Trainer, fit  # noqa: E402
from jaxpar.train import checkpoint, reference_trainer, summary, verify  # noqa: E402

# a small Llama-style decoder: RoPE, grouped-query attention, SwiGLU
CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32, rope_theta=10000.0)
OPTIM = OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5)       # warm-up + cosine; clipping at norm 0.5
SPEC = ParallelSpec(dp=2, pp=2, tp=2, microbatches=2)            # 1F1B over 2 stages, each TP over 2, 2 replicas
B, T = 8, 16                                                     # batches int[B, T + 1]
RTOL = testing.tolerance(jnp.float32)[0]                         # the float32 rule every check uses


def rel(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


def lesson(steps=10):
    print(f"== {SPEC.describe()}: {steps} steps of the Trainer against reference_trainer on one device ==")
    trainer = Trainer(CFG, SPEC, OPTIM, batch_size=B, seq_len=T)     # checked now; the step compiles on first use
    state = trainer.init(jax.random.key(0))                          # reference.init_params(key), laid out on the mesh
    tx, reference_step = reference_trainer(CFG, OPTIM)               # reference.loss, optax.global_norm, the same AdamW
    params = reference.init_params(jax.random.key(0), CFG)
    opt = tx.init(params)
    corpus = Corpus(vocab=CFG.vocab)
    ours, ref = [], []
    for i in range(steps):
        tokens = corpus.batch(i, batch_size=B, seq_len=T)            # the same host batch for both
        state, metrics = trainer.step(state, tokens)
        params, opt, loss, norm = reference_step(params, opt, jnp.asarray(tokens))
        ours.append((float(metrics["loss"]), float(metrics["norm"])))
        ref.append((float(loss), float(norm)))
    for i in (0, 1, steps - 1):
        (loss, norm), (ref_loss, ref_norm) = ours[i], ref[i]
        print(f"  step {i}: loss {loss:.6f} vs {ref_loss:.6f}, gradient norm {norm:.6f} vs {ref_norm:.6f}")
    saved = jax.device_get(trainer.canonical(state))                 # (params, AdamW state, step): the same on any mesh
    # the run's trajectory; each step's gradients and update at the same weights: verify.parity (demos 4, 5)
    errors = {"losses": rel([o[0] for o in ours], [r[0] for r in ref]),
              "grad norms": rel([o[1] for o in ours], [r[1] for r in ref])}
    ok = max(errors.values()) <= RTOL
    print(f"  train {SPEC.describe()}, {steps} steps: max relative error "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (tolerance {RTOL:g}): {'ok' if ok else 'FAILED'}")
    c = summary.collectives(trainer, trainer.compiled)               # pp rank 0's sends and its stages' collectives
    got, want = c["sends"] + c["stages"][0], c["expected_sends"] + c["expected_stages"][0]
    print(f"  one step's collectives on pp rank 0: {got.format()} {'=' if got == want else '!='} formula "
          f"{want.format()} (every rank, the dp reduction: {'ok' if summary.matches(c) else 'FAILED'})")
    return trainer, state, saved


def demo_bad_spec():
    print("\n== demo 1: a spec that does not fit ==")
    cfg = reference.ModelConfig(n_layers=6, n_heads=6, n_kv_heads=3, vocab=30)
    try:
        Trainer(cfg, ParallelSpec(pp=4, tp=4, microbatches=3), batch_size=10, seq_len=16)
    except ConfigError as e:
        print(f"  ConfigError: {e}")


def demo_nnx():
    print("\n== demo 2: an MoE model as NNX parameters with partition metadata ==")
    model = LanguageModel(dataclasses.replace(CFG, n_experts=4, top_k=2))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model)))
    params = model.params()
    for name in ("embed", "unembed"):
        print(f"  {name:<13} {str(params[name].shape):<16} {specs[name]}")
    for name in ("wq", "wk", "wo", "router", "w_up", "w_down"):
        print(f"  blocks.{name:<6} {str(params['blocks'][name].shape):<16} {specs['blocks'][name]}")


def demo_checkpoint(trainer, state, saved, directory):
    """The lesson's state at step 10 saved, 10 more steps and the run's summary, then the
    checkpoint restored on pp4 x tp2 and compared with `saved` (the lesson's canonical
    params, optimizer state and step)."""
    print(f"\n== demo 3: the lesson's state saved at step 10, steps 10-19 with fit on {SPEC.describe()}, "
          "the checkpoint restored on pp4 x tp2 ==")
    with Checkpoints(directory) as ckpt:
        ckpt.save(trainer, state)                                    # orbax, in the canonical (reference) layout
        _, history = fit(trainer, steps=20, state=state, progress=False)   # steps 10-19; the state is donated
        print("  " + summary.format_summary(summary.summarize(trainer, history)).replace("\n", "\n  "))
        spec = ParallelSpec(pp=4, tp=2, microbatches=4)
        other = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)   # another mesh: its step compiles only if run
        restored = jax.device_get(other.canonical(ckpt.restore(other, step=10)))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)))
    print(f"  restored on {spec.describe()}: parameters, AdamW moments and step equal to the saved ones, bit for bit: "
          f"{'ok' if same else 'FAILED'}; fit(other, steps=20, state=...) trains on from there")
    for step in checkpoint.listing(directory):                       # `jaxpar checkpoint ls DIR`, nothing written
        print(f"  listed: step {step['step']}, {step['model']} on {step['mesh']}, {step['schedule']['steps']}-step "
              f"schedule, {'intact' if step['intact'] else step['problem']}")


def demo_recompute_dots():
    """The lesson's spec with recompute="dots" against recompute=False: 3 steps against
    the unsharded model, the collectives of one step, the compiled memory per device."""
    print("\n== demo 4: recompute=\"dots\": F keeps the matmuls' and collectives' outputs, B recomputes the rest ==")
    memory = {}
    for recompute in (False, "dots"):
        spec = dataclasses.replace(SPEC, recompute=recompute)
        trainer = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)
        c = summary.collectives(trainer, trainer.compiled)
        memory[recompute] = trainer.compiled.memory_analysis().temp_size_in_bytes
        print(f"  recompute={recompute!r:<7} temporaries {memory[recompute] / 1024:6.0f} KiB per device; collectives "
              f"equal to the formulas (none run again in B): {'ok' if summary.matches(c) else 'FAILED'}")
    r = verify.parity(dataclasses.replace(SPEC, recompute="dots"), CFG, steps=3, batch_size=B, seq_len=T, optim=OPTIM)
    print(f"  dots holds {memory['dots'] / memory[False]:.2f}x the temporaries; 3 steps against the unsharded model: "
          f"max relative error {max(r.errors.values()):.1e} (tolerance {r.tolerance[0]:g}): "
          f"{'ok' if r.passed else 'FAILED'}")


def demo_zero3(steps=3):
    """ZeRO-3 (FSDP) on dp4 x tp2: every matrix stored as its dp-th and gathered where it
    is used, each layer's weights as one flat buffer (one all-gather forward, one again in
    the backward, one reduce-scatter of their gradients); the collectives of one step
    against the formula, `steps` steps against the unsharded model."""
    spec = ParallelSpec(dp=4, tp=2, zero=3, recompute="dots")
    print(f"\n== demo 5: ZeRO-3 (FSDP) on {spec.describe()}: each layer's weights gathered in one all-gather ==")
    trainer = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)
    sharded = sum(d >= 0 for part in ("first", "last") for d in trainer.zero_dims[part].values()) \
        + CFG.n_layers * sum(d >= 0 for d in trainer.zero_dims["blocks"].values())
    text = trainer.compiled.as_text()
    count = lambda op: sum(op in line and "zero3_gather" in line for line in text.splitlines())
    c = summary.collectives(trainer, trainer.compiled)
    print(f"  {sharded} weights stored as their dp-th; one step compiles {count(' all-gather(')} all-gathers and "
          f"{count(' reduce-scatter(')} reduce-scatters for them (one per layer, the embedding and the head), "
          f"bytes equal to the formula: {'ok' if summary.matches(c) else 'FAILED'}")
    r = verify.parity(spec, CFG, steps=steps, batch_size=B, seq_len=T, optim=OPTIM)    # the same compiled step
    print(f"  {steps} steps against the unsharded model: max relative error {max(r.errors.values()):.1e} "
          f"(tolerance {r.tolerance[0]:g}): {'ok' if r.passed else 'FAILED'}")


if __name__ == "__main__":
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices\n")
    trainer, state, saved = lesson()
    demo_bad_spec()
    demo_nnx()
    with tempfile.TemporaryDirectory() as directory:
        demo_checkpoint(trainer, state, saved, directory)
    demo_recompute_dots()
    demo_zero3()
