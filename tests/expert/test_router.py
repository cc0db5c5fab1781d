"""Routers: softmax top-k equals reference.router_weights; DeepSeek-V3's sigmoid router picks
by score + bias and weighs by score alone; the bias update moves load toward the mean; the
Switch/GShard loss is 1 balanced and E collapsed; positions follow the drop rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import reference
from jaxpar.expert import router
from jaxpar.expert.dispatch import positions
from jaxpar.testing import assert_close


def _x_router(t=32, D=8, E=8, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((t, D)), jnp.float32), jnp.asarray(rng.standard_normal((D, E)), jnp.float32)


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_top_k_gates_equal_the_reference(k, renormalize):
    x, w = _x_router()
    r = router.route(w, x, top_k=k, renormalize=renormalize)
    dense = jnp.einsum("tk,tke->te", r.weights, jax.nn.one_hot(r.experts, 8))
    assert_close(dense, reference.router_weights(w, x, top_k=k, renormalize=renormalize))
    assert all(len(set(row)) == k for row in np.asarray(r.experts).tolist())    # distinct experts


def test_sigmoid_router_chooses_by_score_plus_bias_and_weighs_by_score():
    x, w = _x_router()
    bias = jnp.zeros(8).at[7].set(100.0)             # expert 7 always chosen, whatever its score
    r = router.route(w, x, top_k=2, scoring="sigmoid", bias=bias)
    assert np.all(np.asarray(r.experts)[:, 0] == 7)
    scores = jax.nn.sigmoid(x @ w)
    chosen = jnp.take_along_axis(scores, r.experts, axis=1)
    assert_close(r.weights, chosen / chosen.sum(axis=1, keepdims=True))
    # the bias gets no gradient: it only chooses
    g = jax.grad(lambda b: router.route(w, x, top_k=2, scoring="sigmoid", bias=b).weights.sum())(bias)
    assert np.all(np.asarray(g) == 0)


def test_bias_update_moves_load_toward_the_mean():
    x, w = _x_router(t=512, seed=1)
    w = w.at[:, 0].add(3.0)                          # expert 0 hot
    step = jax.jit(lambda bias: router.expert_load(router.route(w, x, top_k=2, scoring="sigmoid", bias=bias).experts, 8))
    bias, loads = jnp.zeros(8), []
    for _ in range(300):
        loads.append(np.asarray(step(bias)))
        bias = router.update_bias(bias, loads[-1], rate=0.01)
    spread = lambda load: float(np.max(load) / np.mean(load))
    assert spread(np.mean(loads[-100:], axis=0)) < spread(loads[0]) - 0.2
    assert float(bias[0]) < 0 and loads[-1][0] < loads[0][0]


def test_load_balancing_loss_is_1_balanced_and_e_collapsed():
    t, E = 64, 8
    balanced = router.Routing(experts=(jnp.arange(t) % E)[:, None], weights=jnp.ones((t, 1)),
                              probs=jnp.full((t, E), 1 / E))
    collapsed = router.Routing(experts=jnp.zeros((t, 1), jnp.int32), weights=jnp.ones((t, 1)),
                               probs=jnp.zeros((t, E)).at[:, 0].set(1.0))
    assert float(router.load_balancing_loss(balanced)) == pytest.approx(1.0)
    assert float(router.load_balancing_loss(collapsed)) == pytest.approx(E)


def test_positions_follow_the_drop_rule():
    experts = jnp.array([[0, 1], [0, 2], [1, 0]])     # 3 tokens, top-2
    weights = jnp.array([[0.6, 0.4], [0.3, 0.7], [0.55, 0.45]])
    # position: first choices (slot 0) of every token, then second choices, token order
    np.testing.assert_array_equal(positions(experts, weights, 3, "position"), [[0, 1], [1, 0], [0, 2]])
    # probability: highest gate first within each expert
    np.testing.assert_array_equal(positions(experts, weights, 3, "probability"), [[0, 1], [2, 0], [0, 1]])
