"""One model trained on a dp x pp x tp x cp x ep mesh (lecture section 7).

    python examples/08_train_4d.py

On 8 fake CPU devices:
  demo 1  a ParallelSpec that does not fit the model: one ConfigError listing every
          violated constraint, before anything compiles;
  demo 2  the model as flax NNX parameters with partition metadata (flax's own
          get_partition_spec reads them);
  demo 3  20 steps on pp2 x cp2 x ep2 (an MoE balanced by its loss and DeepSeek-V3's
          bias, Ulysses attention on zigzag-ordered tokens inside the pipeline stages)
          against the unsharded model, batch for batch: losses, gradient norms and final
          parameters, and the step's collectives against the formulas (eight meshes:
          tests/train/test_train.py; drawn configurations: tests/train/test_drawn.py);
  demo 4  20 steps on dp2 x pp2 x tp2 (1F1B) and the run's summary: tokens/s, memory per
          device from the compiled step, the collectives of one step against the formulas;
  demo 5  a checkpoint saved on dp2 x pp2 x tp2, restored on pp4 x tp2, training on
          with the same losses.
The same: `jaxpar train --mesh dp=2,pp=2,tp=2 --steps 200`, `jaxpar verify train`.
"""

import dataclasses
import tempfile

from jaxpar import mesh

mesh.use_cpu_devices(8)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import reference  # noqa: E402
from jaxpar.errors import ConfigError  # noqa: E402
from jaxpar.train import model, verify  # noqa: E402
from jaxpar.train.checkpoint import Checkpoints  # noqa: E402
from jaxpar.train.loop import fit  # noqa: E402
from jaxpar.train.spec import ParallelSpec  # noqa: E402
from jaxpar.train.step import Trainer  # noqa: E402
from jaxpar.train.summary import format_summary, summarize  # noqa: E402

SPEC, CFG, BATCH = verify.MESHES["dp2 pp2 tp2"]


def demo_bad_spec():
    print("== demo 1: a spec that does not fit ==")
    cfg = reference.ModelConfig(n_layers=6, n_heads=6, n_kv_heads=3, vocab=30)
    try:
        Trainer(cfg, ParallelSpec(pp=4, tp=4, microbatches=3), batch_size=10, seq_len=16)
    except ConfigError as e:
        print(f"  ConfigError: {e}")


def demo_nnx():
    print("\n== demo 2: the model as NNX parameters with partition metadata ==")
    m = model.LanguageModel(verify.MOE)
    specs, params = nnx.get_partition_spec(nnx.state(m)), m.params()
    for name in ("embed", "unembed"):
        print(f"  {name:<13} {str(params[name].shape):<16} {specs[name].value}")
    for name in ("wq", "wk", "wo", "router", "w_up", "w_down"):
        print(f"  blocks.{name:<6} {str(params['blocks'][name].shape):<16} {specs['blocks'][name].value}")


def demo_parity():
    print("\n== demo 3: 20 steps against the unsharded model ==")
    # an MoE balanced both ways (the Switch/GShard loss, DeepSeek-V3's selection bias),
    # Ulysses attention over cp on zigzag-ordered tokens, the experts over ep, in 1F1B
    cfg = dataclasses.replace(verify.MOE, router="sigmoid", aux_loss=0.01, bias_rate=1e-3)
    spec = ParallelSpec(pp=2, cp=2, ep=2, microbatches=2, attention="ulysses", layout="zigzag")
    r = verify.parity(spec, cfg, batch_size=8)
    errs = ", ".join(f"{k} {v:.1e}" for k, v in r.errors.items())
    print(f"  {r.name}: max relative error {errs} (tolerance 1e-5): {'ok' if r.passed else 'FAILED'}; {r.note}")
    ok = "=" if r.collectives_match else "!="
    print(f"  one step's collectives on pp rank 0: {r.measured['step'].format()} {ok} formula "
          f"{r.expected['step'].format()} (every rank, the reduction and ZeRO: {'ok' if r.passed else 'FAILED'})")


def demo_summary():
    print("\n== demo 4: a run's summary ==")
    trainer = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
    _, history = fit(trainer, steps=20, progress=False)
    print("  " + format_summary(summarize(trainer, history)).replace("\n", "\n  "))


def demo_checkpoint():
    print("\n== demo 5: saved on dp2 x pp2 x tp2, restored on pp4 x tp2 ==")
    with tempfile.TemporaryDirectory() as directory:
        a = Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=16)
        with Checkpoints(directory, every=10) as ckpt:
            _, whole = fit(a, steps=20, checkpoints=ckpt, progress=False)
        spec = ParallelSpec(pp=4, tp=2, microbatches=4)
        b = Trainer(CFG, spec, verify.OPTIM, batch_size=BATCH, seq_len=16)
        with Checkpoints(directory) as ckpt:
            state = ckpt.restore(b, step=10)
        _, resumed = fit(b, steps=20, state=state, progress=False)
    diff = np.max(np.abs(np.array(resumed.losses) - whole.losses[10:]) / np.array(whole.losses[10:]))
    print(f"  steps 10-19 on {spec.describe()} after the restore: losses {np.round(resumed.losses[:4], 4)} ...; "
          f"max relative difference from the uninterrupted run {diff:.1e}")


if __name__ == "__main__":
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices\n")
    demo_bad_spec()
    demo_nnx()
    demo_parity()
    demo_summary()
    demo_checkpoint()
