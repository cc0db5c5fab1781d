"""Bad input to the tensor-parallel entry points: a ConfigError naming the value, the
constraint and a fix, before anything is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar import reference, tensor
from jaxpar.errors import ConfigError


@pytest.fixture
def no_compile(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a program was built before the input was refused")
    monkeypatch.setattr(jax, "shard_map", refuse)


@pytest.fixture(scope="module")
def block():
    cfg = reference.ModelConfig(n_layers=1)
    params = jax.eval_shape(lambda: reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0))
    return cfg, params


def test_block_refusals(no_compile, block):
    cfg, p = block
    m = mesh_lib.make_mesh(dp=2, tp=4)
    x = jnp.zeros((4, 8, cfg.d_model))
    cases = [
        (dict(x=x.astype(jnp.int32)), "x has dtype int32; x\\[batch, seq, d_model=32\\] must be floating point"),
        (dict(x=x[:0]), r"x has shape \(0, 8, 32\), with an empty axis"),
        (dict(x=np.zeros((4, 8, 32)).tolist()), "x is a list, not an array"),
        (dict(mesh="tp=4"), "mesh='tp=4' is a str, not a jax.sharding.Mesh"),
        (dict(mesh=mesh_lib.make_mesh(dp=8)), "tp_block needs a mesh with a 'tp' axis"),
        (dict(sequence_parallel="yes"), "sequence_parallel='yes' is a str: give True or False"),
        (dict(cfg={"d_model": 32}), "cfg is a dict, not a reference.ModelConfig"),
        (dict(params=[p]), "params is a list"),
        (dict(params={**p, "wq": jax.ShapeDtypeStruct(p["wq"].shape, jnp.int32)}), r"params\['wq'\] has dtype int32"),
        (dict(x=jnp.zeros((3, 8, 32))), "batch B=3 is not divisible by dp=2.*Fix"),
        (dict(cfg=reference.ModelConfig(n_layers=1, n_experts=4)), "tp_block runs dense MLP blocks"),
    ]
    for kw, match in cases:
        args = dict(params=p, x=x, mesh=m, cfg=cfg) | kw
        with pytest.raises(ConfigError, match=match):
            tensor.tp_block(args.pop("params"), args.pop("x"), **args)


def test_vocab_refusals(no_compile):
    m = mesh_lib.make_mesh(dp=2, tp=4)
    logits, targets = jnp.zeros((2, 3, 64)), jnp.zeros((2, 3), jnp.int32)
    ce = tensor.vocab_parallel_cross_entropy
    with pytest.raises(ConfigError, match=r"targets has shape \(2, 4\), the logits give \[B, T\] = \[2, 3\]"):
        ce(logits, jnp.zeros((2, 4), jnp.int32), mesh=m)
    with pytest.raises(ConfigError, match=r"logits has shape \(6, 64\) \(rank 2\); expected rank 3"):
        ce(logits.reshape(6, 64), targets, mesh=m)
    with pytest.raises(ConfigError, match="targets has dtype float32.*must be integer"):
        ce(logits, targets.astype(jnp.float32), mesh=m)
    with pytest.raises(ConfigError, match=r"targets holds ids from 0 to 64, outside \[0, vocab=64\)"):
        ce(logits, targets.at[0, 0].set(64), mesh=m)
    with pytest.raises(ConfigError, match=r"tokens holds ids from -1 to 0, outside \[0, vocab=64\)"):
        tensor.vocab_parallel_embedding(jnp.zeros((64, 8)), targets.at[1, 2].set(-1), mesh=m)
    with pytest.raises(ConfigError, match=r"embed has shape \(64,\) \(rank 1\)"):
        tensor.vocab_parallel_embedding(jnp.zeros((64,)), targets, mesh=m)


def test_tp_loss_refusals(no_compile):
    cfg = reference.ModelConfig(n_layers=1)
    params = jax.eval_shape(lambda: reference.init_params(jax.random.key(0), cfg))
    m = mesh_lib.make_mesh(dp=2, tp=4)
    with pytest.raises(ConfigError, match=r"tokens has shape \(9,\) \(rank 1\); expected rank 2"):
        tensor.tp_loss(params, jnp.zeros((9,), jnp.int32), mesh=m, cfg=cfg)
    with pytest.raises(ConfigError, match="at least 2 positions"):
        tensor.tp_loss(params, jnp.zeros((2, 1), jnp.int32), mesh=m, cfg=cfg)
    with pytest.raises(ConfigError, match="params must be the whole model"):
        tensor.tp_loss(params["blocks"], jnp.zeros((2, 9), jnp.int32), mesh=m, cfg=cfg)
    with pytest.raises(ConfigError, match="tokens has dtype float32"):
        tensor.tp_loss(params, jnp.zeros((2, 9)), mesh=m, cfg=cfg)


def test_under_jit_ids_are_traced_and_not_checked():
    # documented: a traced id cannot be checked; the embedding then gives a zero row
    m = mesh_lib.make_mesh(dp=2, tp=4)
    embed = jnp.ones((64, 8))
    out = jax.jit(lambda t: tensor.vocab_parallel_embedding(embed, t, mesh=m))(jnp.full((2, 3), 70, jnp.int32))
    assert float(jnp.abs(out).max()) == 0.0


def test_formulas_refuse_a_batch_dp_does_not_split():
    cfg = reference.ModelConfig()
    with pytest.raises(ConfigError, match="batch_size=3 is not divisible by dp=2"):
        tensor.tp_block_collectives(cfg=cfg, batch_size=3, seq_len=8, dtype=jnp.float32, dp=2, tp=4)
    with pytest.raises(ConfigError, match="seq_len=0: need at least 1"):
        tensor.embedding_collectives(cfg=cfg, batch_size=2, seq_len=0, dtype=jnp.float32)


def test_specs_and_formulas_refuse_what_is_not_a_config():
    with pytest.raises(ConfigError, match="n_kv_heads=0: need at least 1"):
        tensor.TPSpecs.megatron(n_kv_heads=0, tp=4)
    with pytest.raises(ConfigError, match="tp=0: need at least 1"):
        tensor.TPSpecs.megatron(n_kv_heads=4, tp=0)
    with pytest.raises(ConfigError, match="cfg is a NoneType, not a reference.ModelConfig"):
        tensor.tp_block_collectives(cfg=None, batch_size=2, seq_len=8, dtype=jnp.float32)
    m = mesh_lib.make_mesh(dp=2, tp=4)
    with pytest.raises(ConfigError, match="cfg is a NoneType"):
        tensor.vocab_parallel_lm_loss(jnp.zeros((2, 3, 32)), jnp.ones(32), jnp.zeros((32, 64)),
                                      jnp.zeros((2, 3), jnp.int32), mesh=m, cfg=None)


def test_row_split_gelu_refusals():
    m = mesh_lib.make_mesh(dp=2, tp=4)
    with pytest.raises(ConfigError, match="d_model=6 is not divisible by tp=4"):
        tensor.row_split_gelu(jnp.zeros((2, 6)), jnp.zeros((6, 8)), mesh=m)
    with pytest.raises(ConfigError, match="a's rows must be x's columns"):
        tensor.row_split_gelu(jnp.zeros((2, 8)), jnp.zeros((6, 8)), mesh=m)
