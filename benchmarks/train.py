"""The composed training step: speed against the unsharded step, collectives against the
formulas, compile time. The bounds: at most 1.5x the unsharded step on the same machine
(the sharded program's bookkeeping and collectives stay small beside the model's math),
collectives = formulas (nothing is sent that the formulas do not account for), compile
under 60 s (a run, or a test of it, starts within a minute).

    python -m benchmarks.train
    python -m benchmarks.run train

Side by side in one process: the unsharded step (reference.loss, optax.tree.norm, the
same AdamW, one device) and the dp2 x pp2 x tp2 1F1B step on 8 devices, alternated so the
load of a shared machine hits both alike. On fake CPU devices all 8 share the cores,
so the ratio measures the overhead of the sharded program (pipeline bookkeeping,
collectives), not a speed-up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import reference
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer
from jaxpar.train.unsharded import reference_trainer
from jaxpar.train.summary import collectives, matches

SIZES = {  # name -> (model, batch, seq)
    "small": (reference.ModelConfig(n_layers=4, d_model=64, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=256,
                                    vocab=256, mlp="swiglu", rope_theta=10000.0), 16, 64),
    "medium": (reference.ModelConfig(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=1024,
                                     vocab=512, mlp="swiglu", rope_theta=10000.0), 16, 128),
}
SPEC = ParallelSpec(dp=2, pp=2, tp=2, microbatches=4)


def run(repeats: int = 10) -> list[dict]:
    rows = []
    optim = OptimConfig(steps=1000)
    for name, (cfg, batch, seq) in SIZES.items():
        corpus = Corpus(vocab=cfg.vocab)
        tokens = [corpus.batch(i, batch_size=batch, seq_len=seq) for i in range(repeats + 1)]
        start = time.perf_counter()
        trainer = Trainer(cfg, SPEC, optim, batch_size=batch, seq_len=seq)
        compiled = trainer.lower().compile()
        compile_s = time.perf_counter() - start
        c = collectives(trainer, compiled)
        tx, ref_step = reference_trainer(cfg, optim)
        params = reference.init_params(jax.random.key(0), cfg)
        opt = tx.init(params)
        state = trainer.init()
        batches = [trainer.put(t) for t in tokens]
        ref_batches = [jnp.asarray(t) for t in tokens]
        state, _ = trainer.step(state, batches[0])                       # warm up both
        params, opt, loss, _ = ref_step(params, opt, ref_batches[0])
        jax.block_until_ready((state, loss))
        t_ref, t_par = [], []
        for i in range(1, repeats + 1):
            t0 = time.perf_counter()
            params, opt, loss, _ = ref_step(params, opt, ref_batches[i])
            jax.block_until_ready(loss)
            t_ref.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state, m = trainer.step(state, batches[i])
            jax.block_until_ready(m["loss"])
            t_par.append(time.perf_counter() - t0)
        ref_ms, par_ms = 1e3 * float(np.median(t_ref)), 1e3 * float(np.median(t_par))
        rows.append({"model": name, "d_model": cfg.d_model, "batch x seq": f"{batch} x {seq}",
                     "mesh": SPEC.describe(), "unsharded ms": ref_ms, "sharded ms": par_ms,
                     "ratio": par_ms / ref_ms, "goal": "<= 1.5", "compile s": compile_s,
                     "collectives = formulas": matches(c),
                     "pipeline sends": c["sends"].format()})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
