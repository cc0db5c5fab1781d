"""Composed stages: the pipeline runtime in one shard_map over dp x pp x tp,
tensor-parallel blocks as per-shard stages, the vocab-parallel embedding on the first
stage and the LM head with the vocab-parallel cross-entropy on the last, against
reference.loss: the loss and every gradient, embedding and head included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import reference
from jaxpar import mesh as mesh_lib
from jaxpar.errors import ConfigError
from jaxpar.schedules import schedule
from jaxpar.testing import assert_close
from jaxpar.train import stages

CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32)


def tokens(rows: int, seq: int = 8, seed: int = 0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab, (rows, seq + 1)), jnp.int32)


# dp x pp x tp (1F1B), float64 and a size-1 tp are in test_train.py's parity runs of the
# whole trainer; here the case those lack: tp > n_kv_heads (KV heads replicated over tp)
def test_tp_stages_match_reference_loss_and_every_gradient():
    mesh = mesh_lib.make_mesh(pp=2, tp=4, devices=jax.devices()[:8])
    params = reference.init_params(jax.random.key(0), CFG)
    toks = tokens(4)
    s = schedule.make("interleaved", stages=2, microbatches=2)
    loss, grads = stages.pp_tp_loss(params, toks, mesh=mesh, cfg=CFG, schedule=s)
    ref_loss, ref = jax.value_and_grad(reference.loss)(params, toks, CFG)
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    assert_close((loss, grads), (ref_loss, ref))


def test_bad_input_is_refused():
    mesh = mesh_lib.make_mesh(pp=2, tp=2, devices=jax.devices()[:4])
    params = reference.init_params(jax.random.key(0), CFG)
    s = schedule.make("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="needs a mesh with a 'tp' axis"):
        stages.pp_tp_loss(params, tokens(4), mesh=mesh_lib.make_mesh(pp=2, devices=jax.devices()[:2]), cfg=CFG,
                          schedule=s)
    with pytest.raises(ConfigError, match="vocab=30 is not divisible by tp=4"):
        cfg = reference.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, vocab=30)
        stages.pp_tp_loss(reference.init_params(jax.random.key(0), cfg), tokens(4), cfg=cfg, schedule=s,
                          mesh=mesh_lib.make_mesh(pp=2, tp=4, devices=jax.devices()[:8]))
    with pytest.raises(ConfigError, match="n_heads=4 is not divisible by tp=8"):
        stages.pp_tp_loss(params, tokens(4), mesh=mesh_lib.make_mesh(pp=1, tp=8, devices=jax.devices()[:8]),
                          cfg=CFG, schedule=schedule.make("1f1b", 1, 2))
    with pytest.raises(ConfigError, match="params must be the whole model"):
        stages.pp_tp_loss(params["blocks"], tokens(4), mesh=mesh, cfg=CFG, schedule=s)
    with pytest.raises(ConfigError, match="tokens has shape"):
        stages.pp_tp_loss(params, tokens(4)[:, :1], mesh=mesh, cfg=CFG, schedule=s)
