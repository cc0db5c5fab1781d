"""Inputs context parallelism refuses: each a ConfigError naming the value, the constraint
and a fix, raised before anything is compiled."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context import formulas, ring, ulysses
from jaxpar.errors import ConfigError

def _mesh(**sizes):
    return mesh_lib.make_mesh(**sizes)


def qkv(B=2, T=16, N=8, K=2, H=4, dtype=jnp.float32):
    return jnp.zeros((B, T, N, H), dtype), jnp.zeros((B, T, K, H), dtype), jnp.zeros((B, T, K, H), dtype)


RING = [
    (dict(T=18), dict(layout="contiguous"), "seq_len=18 is not divisible by 4.*Fix"),
    (dict(T=12), dict(layout="zigzag"), "seq_len=12 is not divisible by 8: the zigzag layout"),
    (dict(N=6, K=4), {}, "query heads N=6 must be a multiple of KV heads K=4.*Fix: K in"),
    (dict(B=3), {}, "batch_size=3 is not divisible by dp=2"),
    (dict(B=0), {}, "empty axis"),
    (dict(dtype=jnp.int32), {}, "must be floating point"),
    ({}, dict(layout="striped"), "layout='striped'"),
    ({}, dict(causal=1), "causal=1"),
    ({}, dict(relayout="yes"), "relayout='yes'"),
]


@pytest.mark.parametrize("shape, kw, words", RING, ids=lambda v: str(v)[:30])
def test_ring_refuses(shape, kw, words):
    with pytest.raises(ConfigError, match=words):
        ring.ring_attention(*qkv(**shape), mesh=_mesh(dp=2, cp=4), **kw)


def test_ring_refuses_a_mesh_without_the_axis_or_not_a_mesh():
    with pytest.raises(ConfigError, match="needs a mesh with a 'cp' axis.*make_mesh"):
        ring.ring_attention(*qkv(), mesh=_mesh(dp=8))
    with pytest.raises(ConfigError, match="not a jax.sharding.Mesh"):
        ring.ring_attention(*qkv(), mesh="cp=8")


def test_ring_refuses_shapes_that_do_not_fit_together():
    q, k, v = qkv()
    with pytest.raises(ConfigError, match="self-attention"):
        ring.ring_attention(q, k[:, :8], v[:, :8], mesh=_mesh(dp=2, cp=4))
    with pytest.raises(ConfigError, match="rank 3"):
        ring.ring_attention(q[0], k, v, mesh=_mesh(dp=2, cp=4))
    with pytest.raises(ConfigError, match="one dtype"):
        ring.ring_attention(q, k.astype(jnp.bfloat16), v, mesh=_mesh(dp=2, cp=4))
    with pytest.raises(ConfigError, match="not an array"):
        ring.ring_attention(q.tolist(), k, v, mesh=_mesh(dp=2, cp=4))


def test_heads_must_split_over_tp():
    with pytest.raises(ConfigError, match="n_kv_heads=2 is not divisible by tp=4"):
        ring.ring_attention(*qkv(), mesh=_mesh(cp=2, tp=4))


def test_ulysses_refuses_heads_cp_does_not_split():
    with pytest.raises(ConfigError, match="n_heads=6 is not divisible by cp=4.*Fix"):
        ulysses.ulysses_attention(*qkv(N=6, K=2), mesh=_mesh(dp=2, cp=4))
    with pytest.raises(ConfigError, match="n_kv_heads=3 and cp=2.*Fix"):
        ulysses.ulysses_attention(*qkv(B=4, N=6, K=3, T=8), mesh=_mesh(dp=4, cp=2))
    with pytest.raises(ConfigError, match="n_kv_heads=3 and ucp=8"):
        ulysses.hybrid_attention(*qkv(N=24, K=3), mesh=_mesh(cp=1, ucp=8))


def test_hybrid_refuses_no_axes_and_an_undivided_sequence():
    with pytest.raises(ConfigError, match="ring_axis, ulysses_axis or both"):
        ulysses.hybrid_attention(*qkv(), mesh=_mesh(dp=8), ring_axis=None, ulysses_axis=None)
    with pytest.raises(ConfigError, match="seq_len=10 is not divisible by cp=2 x ucp=2 = 4.*Fix"):
        ulysses.hybrid_attention(*qkv(T=10), mesh=_mesh(dp=2, cp=2, ucp=2))
    with pytest.raises(ConfigError, match="needs a mesh with a 'ucp' axis"):
        ulysses.hybrid_attention(*qkv(), mesh=_mesh(dp=2, cp=4))


def test_the_shard_function_refuses_an_odd_zigzag_chunk():
    q, k, v = qkv(T=5)
    with pytest.raises(ConfigError, match="zigzag layout needs an even number"):
        ring.ring_attention_shard(q, k, v, axis=None, layout="zigzag")


def test_formulas_refuse_what_the_programs_refuse():
    cfg = reference.ModelConfig()
    kw = dict(cfg=cfg, batch_size=4, seq_len=32, dtype=np.float32)
    with pytest.raises(ConfigError, match="seq_len=30 is not divisible by cp=4"):
        formulas.ring_collectives(**kw | dict(seq_len=30), cp=4)
    with pytest.raises(ConfigError, match="batch_size=4 is not divisible by dp=3"):
        formulas.ring_collectives(**kw, dp=3)
    with pytest.raises(ConfigError, match="layout='diagonal'"):
        formulas.ring_collectives(**kw, cp=2, layout="diagonal")
    with pytest.raises(ConfigError, match="not a reference.ModelConfig|give a reference.ModelConfig"):
        formulas.ring_collectives(**kw | dict(cfg=object()))
    with pytest.raises(ConfigError, match="n_heads=8 is not divisible by cp=16"):
        formulas.ulysses_collectives(**kw, cp=16)
    with pytest.raises(ConfigError, match="cp=0"):
        formulas.ring_collectives(**kw, cp=0)
