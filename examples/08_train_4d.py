"""One model trained on a dp x pp x tp mesh, step for step against one device (lecture section 7).

    python examples/08_train_4d.py

On 8 fake CPU devices. `Trainer(cfg, ParallelSpec(dp=2, pp=2, tp=2, microbatches=2))` compiles ONE step
(one shard_map: 1F1B, Megatron TP in each stage, the dp reduction, clipping, AdamW); `fit` trains it against
the unsharded model. Then a spec refused; the NNX layout; a checkpoint restored on pp4 x tp2 bit for bit;
recompute="dots" and ZeRO-3. Eight more meshes: `jaxpar verify train`; the command line: `jaxpar train
--mesh dp=2,pp=2,tp=2` (`--recompute dots`, `--zero 3`), `jaxpar checkpoint ls DIR`.
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
from jaxpar.train import Checkpoints, LanguageModel, OptimConfig, ParallelSpec, Trainer, fit  # noqa: E402
from jaxpar.train import summary, verify  # noqa: E402

CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32, rope_theta=10000.0)      # a small Llama: RoPE, grouped-query attention, SwiGLU
OPTIM = OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5)       # warm-up + cosine; clipping at norm 0.5
SPEC = ParallelSpec(dp=2, pp=2, tp=2, microbatches=2)            # 1F1B over 2 stages, each TP over 2, 2 replicas
B, T = 8, 16                                                     # batches int[B, T + 1]
RTOL = testing.tolerance(jnp.float32)[0]                         # the float32 rule every check uses
verdict = lambda ok: "ok" if ok else "FAILED"
rel = lambda ours, ref: float(np.max(np.abs(np.subtract(ours, ref))) / np.max(np.abs(ref)))   # max |diff| / max |ref|


def lesson(steps=10):
    print(f"== {SPEC.describe()}: {steps} steps of Trainer + fit against the unsharded model on one device ==")
    trainer = Trainer(CFG, SPEC, OPTIM, batch_size=B, seq_len=T)    # checked now; the step compiles on first use
    state, history = fit(trainer, steps=steps, progress=False)      # Corpus(vocab=CFG.vocab)'s batches 0, 1, ...
    ref_losses, ref_norms, _ = verify.reference_run(CFG, OPTIM, steps, B, T)   # the same AdamW on one device
    print("\n".join(f"  step {i}: loss {history.losses[i]:.6f} vs {ref_losses[i]:.6f}, gradient norm "
                    f"{history.norms[i]:.6f} vs {ref_norms[i]:.6f}" for i in (0, 1, steps - 1)))
    err = max(rel(history.losses, ref_losses), rel(history.norms, ref_norms))
    print(f"  train {SPEC.describe()}, {steps} steps: max relative error of the losses and gradient norms {err:.1e} "
          f"(tolerance {RTOL:g}): {verdict(err <= RTOL)}")
    return trainer, state


def demo_checkpoint(trainer, state, directory):
    print("\n== demo 3: the state saved at step 10, steps 10-19 with fit and its summary, restored on pp4 x tp2 ==")
    saved = jax.device_get(trainer.canonical(state))                # (params, AdamW state, step): any mesh's
    with Checkpoints(directory) as ckpt:
        ckpt.save(trainer, state)                                   # orbax, in the canonical (reference) layout
        _, history = fit(trainer, steps=20, state=state, progress=False)   # steps 10-19; the state is donated
        print("  " + summary.format_summary(summary.summarize(trainer, history)).replace("\n", "\n  "))
        other = Trainer(CFG, ParallelSpec(pp=4, tp=2, microbatches=4), OPTIM, batch_size=B, seq_len=T)
        restored = jax.device_get(other.canonical(ckpt.restore(other, step=10)))   # compiles nothing
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)))
    print(f"  restored on {other.spec.describe()}: parameters, AdamW moments and step equal to the saved ones, bit "
          f"for bit: {verdict(same)}; fit(other, steps=20, state=...) trains on from there")


def demo_memory():
    print("\n== demo 4: memory per device: recompute=\"dots\" (F keeps only matmul and collective outputs), ZeRO-3 ==")
    for spec in (SPEC, dataclasses.replace(SPEC, recompute="dots"), ParallelSpec(dp=4, tp=2, recompute="dots"),
                 ParallelSpec(dp=4, tp=2, zero=3, recompute="dots")):   # ZeRO-3: each weight stored as its dp-th
        trainer = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)
        m, ok = trainer.compiled.memory_analysis(), summary.matches(summary.collectives(trainer, trainer.compiled))
        print(f"  {spec.describe():<35} weights+state {m.argument_size_in_bytes / 1024:4.1f} KiB, temporaries "
              f"{m.temp_size_in_bytes / 1024:3.0f} KiB; collectives = the formulas: {verdict(ok)}")
    dims = trainer.zero_dims                                        # per weight: its dim split over dp, or -1
    sharded = sum((d >= 0) * (CFG.n_layers if part == "blocks" else 1) for part in dims for d in dims[part].values())
    count = lambda op: sum(op in line and "zero3_gather" in line for line in trainer.compiled.as_text().splitlines())
    print(f"  ZeRO-3: {sharded} weights stored as their dp-th; one step compiles {count(' all-gather(')} all-gathers "
          f"and {count(' reduce-scatter(')} reduce-scatters for them (one per layer, the embedding and the head)")
    r = verify.parity(spec, CFG, steps=3, batch_size=B, seq_len=T, optim=OPTIM)   # each step at the same weights
    print(f"  ZeRO-3, 3 steps against the unsharded model: max relative error {max(r.errors.values()):.1e} "
          f"(tolerance {r.tolerance[0]:g}): {verdict(r.passed)}")


if __name__ == "__main__":
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices\n")
    trainer, state = lesson()
    print("\n== demo 1: a spec that does not fit ==")
    try:
        Trainer(reference.ModelConfig(n_layers=6, n_heads=6, n_kv_heads=3, vocab=30),
                ParallelSpec(pp=4, tp=4, microbatches=3), batch_size=10, seq_len=16)
    except ConfigError as e:
        print(f"  ConfigError: {e}")
    print("\n== demo 2: an MoE model as flax NNX parameters; flax's get_partition_spec reads their layout ==")
    model = LanguageModel(dataclasses.replace(CFG, n_experts=4, top_k=2))
    pspecs, params = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model))), model.params()
    for name in ("wq", "wo", "router", "w_up", "w_down"):
        print(f"  blocks.{name:<6} {str(params['blocks'][name].shape):<16} {pspecs['blocks'][name]}")
    with tempfile.TemporaryDirectory() as directory:
        demo_checkpoint(trainer, state, directory)
    demo_memory()
