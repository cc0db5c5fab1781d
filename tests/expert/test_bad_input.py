"""Inputs expert parallelism refuses: a ConfigError naming the value, the constraint and a fix."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.expert import dispatch, formulas, grouped, router


def _params(E=8, D=16, F=32):
    return {"router": jnp.zeros((D, E)), "w_up": jnp.zeros((E, D, F)), "w_down": jnp.zeros((E, F, D))}


def _call(params=None, x=None, cfg=None, mesh=None, **kw):
    cfg = cfg or reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=8, top_k=2)
    return dispatch.ep_moe(_params() if params is None else params, jnp.zeros((8, 4, 16)) if x is None else x,
                           mesh=mesh or mesh_lib.make_mesh(dp=2, ep=4), cfg=cfg, **kw)


@pytest.mark.parametrize("kw, words", [
    (dict(cfg=reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=6, top_k=2),
          params=_params(E=6)), "n_experts=6 is not divisible by ep=4.*Fix"),
    (dict(capacity_factor=0), "capacity_factor=0: must be > 0"),
    (dict(capacity_factor=-1.0), "capacity_factor=-1.0: must be > 0"),
    (dict(capacity_factor="1.25"), "capacity_factor='1.25' is not a real number"),
    (dict(drop="random"), "drop='random'"),
    (dict(params=_params() | {"router": jnp.zeros((16, 4))}), r"router has shape \(16, 4\); expected \[16, 8\]"),
    (dict(params=_params() | {"router": jnp.zeros((16, 8, 1))}), r"router has shape \(16, 8, 1\) \(rank 3\)"),
    (dict(params={"w_up": jnp.zeros((8, 16, 32)), "w_down": jnp.zeros((8, 32, 16))}), "params has no 'router'"),
    (dict(params=_params() | {"w_up": jnp.zeros((4, 16, 32))}),
     r"expert weight w_up is shape \(4, 16, 32\): cfg.n_experts=8.*leading size 8"),
    (dict(x=jnp.zeros((6, 4, 16))), "batch_size=6 is not divisible by dp=2 x ep=4 = 8"),
    (dict(x=jnp.zeros((8, 4, 12))), "x has d_model 12, cfg.d_model=16"),
    (dict(x=jnp.zeros((0, 4, 16))), "empty axis"),
    (dict(x=jnp.zeros((8, 4, 16), jnp.int32)), "must be floating point"),
    (dict(mesh=mesh_lib.make_mesh(dp=8)), "needs a mesh with a 'ep' axis"),
    (dict(cfg=reference.ModelConfig(n_layers=1, d_model=16, d_ff=32)), "n_experts=0 is a dense MLP"),
    (dict(cfg={"n_experts": 8}), "cfg is a dict: give a reference.ModelConfig"),
    (dict(scoring="relu"), "scoring='relu'"),
    (dict(scoring="sigmoid", bias=jnp.zeros(4)), r"bias has shape \(4,\).*\[8\]"),
    (dict(grouped=True), "grouped=True with ep=4.*Fix: grouped=None"),
    (dict(grouped=True, capacity_factor=1.25, mesh=mesh_lib.make_mesh(dp=8, ep=1)),
     "grouped=True with capacity_factor=1.25: the grouped experts are dropless"),
    (dict(grouped="yes"), "grouped='yes': give None"),
    (dict(params=_params() | {"w_up": jnp.zeros((8, 16, 32), jnp.int32)}), "w_up has dtype int32.*floating point"),
])
def test_ep_moe_refuses(kw, words):
    with pytest.raises(ConfigError, match=words):
        _call(**kw)


def _grouped(p=None, x=None, experts=None, weights=None, mlp="gelu", kernel="xla"):
    return grouped.grouped_moe(_params() if p is None else p, jnp.zeros((4, 16)) if x is None else x,
                               jnp.zeros((4, 2), jnp.int32) if experts is None else experts,
                               jnp.ones((4, 2)) if weights is None else weights, mlp=mlp, kernel=kernel)


@pytest.mark.parametrize("kw, words", [
    (dict(mlp="relu"), "mlp='relu'"),
    (dict(kernel="cuda"), "kernel='cuda'"),
    (dict(mlp="swiglu"), "p has no 'w_gate'"),
    (dict(p=_params() | {"w_down": jnp.zeros((8, 32, 16), jnp.int32)}), "w_down has dtype int32.*floating point"),
    (dict(experts=jnp.full((4, 2), 9, jnp.int32)), r"experts holds ids from 9 to 9, outside \[0, n_experts=8\)"),
    (dict(experts=jnp.full((4, 2), -1, jnp.int32)), r"ids from -1 to -1, outside \[0, n_experts=8\)"),
    (dict(experts=jnp.zeros((4, 2))), "experts has dtype float32.*integer"),
    (dict(experts=jnp.zeros((3, 2), jnp.int32)), r"experts has shape \(3, 2\) for x of 4 tokens"),
    (dict(x=jnp.zeros((2, 4, 16))), r"x has shape \(2, 4, 16\) \(rank 3\); expected rank 2"),
    (dict(x=jnp.zeros((4, 16), jnp.int32)), "x has dtype int32.*floating point"),
    (dict(weights=jnp.ones((4, 3))), r"weights has shape \(4, 3\), experts \(4, 2\): one gate per chosen"),
])
def test_grouped_moe_refuses(kw, words):
    with pytest.raises(ConfigError, match=words):
        _grouped(**kw)


@pytest.mark.parametrize("x, words", [
    (jnp.zeros((16,)), r"x has shape \(16,\) \(rank 1\); expected rank 2: x\[tokens, d_model\]"),
    (jnp.zeros((0, 16)), "empty axis"),
    (jnp.zeros((4, 16), jnp.int32), "x has dtype int32.*floating point"),
])
def test_route_refuses_tokens_it_cannot_score(x, words):
    with pytest.raises(ConfigError, match=words):
        router.route(jnp.zeros((16, 8)), x, top_k=2)


@pytest.mark.parametrize("args, words", [
    ((0, 2, 8, 1.0), "tokens=0: need at least 1"),
    ((8, -1, 8, 1.0), "top_k=-1: need at least 1"),
    ((8, 2, 0, 1.0), "n_experts=0: need at least 1"),
    ((8.0, 2, 8, None), "tokens=8.0 is a float, not a whole number"),
])
def test_capacity_refuses_counts_that_are_not_positive_whole_numbers(args, words):
    with pytest.raises(ConfigError, match=words):
        formulas.capacity(*args)


def test_top_k_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="top_k=9 is more than n_experts=8"):
        router.check_top_k(9, 8)
    with pytest.raises(ConfigError, match="top_k=0: need at least 1"):
        router.route(jnp.zeros((16, 8)), jnp.zeros((4, 16)), top_k=0)
    with pytest.raises(ConfigError, match="top_k=9 must be in 1..n_experts=8"):   # the config refuses it first
        reference.ModelConfig(n_experts=8, top_k=9)


def test_router_scorings_and_bias():
    with pytest.raises(ConfigError, match="scoring='topk'"):
        router.route(jnp.zeros((16, 8)), jnp.zeros((4, 16)), top_k=2, scoring="topk")
    with pytest.raises(ConfigError, match="goes with scoring='sigmoid'"):
        router.route(jnp.zeros((16, 8)), jnp.zeros((4, 16)), top_k=2, bias=jnp.zeros(8))
    with pytest.raises(ConfigError, match="rate=0"):
        router.update_bias(jnp.zeros(8), jnp.zeros(8), rate=0)


def test_expert_weights_of_the_wrong_size_are_refused_in_the_shard():
    p = _params() | {"w_up": jnp.zeros((3, 16, 32))}
    with pytest.raises(ConfigError, match="expert weight w_up is shape \\(3, 16, 32\\).*leading size 8"):
        dispatch.ep_moe_shard(p, jnp.zeros((4, 16)), axis=None, options=dispatch.MoEOptions(top_k=2))


def test_formulas_refuse_what_the_program_refuses():
    cfg = reference.ModelConfig(n_layers=1, n_experts=8, top_k=2)
    kw = dict(cfg=cfg, batch_size=8, seq_len=4, dtype=np.float32)
    with pytest.raises(ConfigError, match="n_experts=8 is not divisible by ep=3"):
        formulas.ep_moe_collectives(**kw | dict(batch_size=6), dp=2, ep=3)
    with pytest.raises(ConfigError, match="batch_size=8 is not divisible by dp x ep=16"):
        formulas.ep_moe_collectives(**kw, dp=2, ep=8)
    with pytest.raises(ConfigError, match="n_experts >= 1"):
        formulas.ep_moe_collectives(**kw | dict(cfg=reference.ModelConfig()))
    with pytest.raises(ConfigError, match="capacity_factor=0"):
        formulas.capacity(8, 2, 8, 0)
