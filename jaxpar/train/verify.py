"""Composition proven: `jaxpar verify pp-tp` and its tour row.

The reference model pipelined over pp with tensor-parallel stages over tp, the
vocab-parallel embedding first and the LM head with the vocab-parallel cross-entropy last
(`stages.py`), on dp x pp x tp, against reference.loss: the loss and every gradient. The
compiled pipeline sends are counted exactly against the plan; the tp all-reduces sit
inside the stage's branches and are reported as the upper bound the HLO gives.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import comms, reference
from jaxpar import mesh as mesh_lib
from jaxpar.pipeline import formulas, runtime, schedule
from jaxpar.testing import Result, compare
from jaxpar.train import stages

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
