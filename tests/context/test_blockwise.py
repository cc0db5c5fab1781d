"""The online-softmax block and merge: lecture exercise 6, the merge's algebra, masked rows
and huge logits without NaN, and the block backward against autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import reference
from jaxpar.context import blockwise
from jaxpar.context.verify import exercise_6
from jaxpar.testing import assert_close


def test_exercise_6_two_blocks_merge_to_25_75():
    ex = exercise_6()
    # the lecture's worked figures
    assert ex["lse1"] == pytest.approx(2.3133, abs=1e-4)
    assert ex["o1"] == pytest.approx(17.311, abs=1e-3)
    assert ex["lse2"] == pytest.approx(3.0) and ex["o2"] == pytest.approx(30.0)
    assert ex["lse"] == pytest.approx(3.4076, abs=1e-4)
    assert ex["o"] == pytest.approx(25.75, abs=5e-3)
    assert ex["o"] == pytest.approx(ex["direct"], rel=1e-6)


def _grouped(rng, B, T, K, G, H, scale=1.0):
    """Grouped queries [B, K, G, T, H]."""
    return jnp.asarray(scale * rng.standard_normal((B, K, G, T, H)), jnp.float32)


def _kv(rng, B, S, K, H, scale=1.0):
    """Keys or values [B, K, S, H]."""
    return jnp.asarray(scale * rng.standard_normal((B, K, S, H)), jnp.float32)


def _dense(q, k, v, mask=None):
    """Softmax attention written out on the grouped layout."""
    H = q.shape[-1]
    s = jnp.einsum("bkgqh,bksh->bkgqs", q, k) / jnp.sqrt(H)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bkgqs,bksh->bkgqh", jax.nn.softmax(s, axis=-1), v)


def test_merging_blocks_in_any_order_equals_attention_over_all_keys():
    rng = np.random.default_rng(0)
    q = _grouped(rng, 2, 5, 2, 3, 4)
    k, v = (_kv(rng, 2, 12, 2, 4) for _ in range(2))
    orders = ((0, 1, 2), (2, 0, 1), (1, 2, 0))

    @jax.jit   # one compile instead of one per operation
    def merged_and_wanted(q, k, v):
        parts = [blockwise.attend(q, k[:, :, a:b], v[:, :, a:b], scale=0.5) for a, b in ((0, 3), (3, 8), (8, 12))]
        merged = []
        for order in orders:
            o, lse = parts[order[0]]
            for i in order[1:]:
                o, lse = blockwise.merge(o, lse, *parts[i])
            merged.append((o, lse))
        return merged, (_dense(q, k, v), jax.nn.logsumexp(jnp.einsum("bkgqh,bksh->bkgqs", q, k) / 2, axis=-1))

    merged, (want, want_lse) = merged_and_wanted(q, k, v)
    for o, lse in merged:
        assert_close(o, want)
        assert_close(lse, want_lse)


def test_a_fully_masked_block_is_the_identity_of_merge_and_nothing_is_nan():
    rng = np.random.default_rng(1)
    q = _grouped(rng, 1, 4, 1, 2, 4)
    k, v = (_kv(rng, 1, 4, 1, 4) for _ in range(2))
    none = jnp.zeros((4, 4), bool)
    o0, lse0 = blockwise.attend(q, k, v, scale=0.5, mask=none)
    assert np.all(np.asarray(o0) == 0) and np.all(np.isneginf(np.asarray(lse0)))
    o1, lse1 = blockwise.attend(q, k, v, scale=0.5)
    for o, lse in (blockwise.merge(o0, lse0, o1, lse1), blockwise.merge(o1, lse1, o0, lse0)):
        np.testing.assert_array_equal(o, o1)
        np.testing.assert_array_equal(lse, lse1)
    o, lse = blockwise.merge(o0, lse0, o0, lse0)      # both empty: still no NaN
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isneginf(np.asarray(lse)))
    # partly masked rows (row 0 sees one key) and their gradients
    grads = jax.grad(lambda q: blockwise.attend(q, k, v, scale=0.5, mask=blockwise.causal_mask(4, 4))[0].sum())(q)
    assert np.all(np.isfinite(np.asarray(grads)))


@pytest.mark.parametrize("scale", [1e2, -1e2])
def test_logits_of_1e4_give_no_nan_or_inf(scale):
    rng = np.random.default_rng(2)
    q = _grouped(rng, 1, 6, 1, 1, 4, scale)
    k, v = _kv(rng, 1, 6, 1, 4, scale), _kv(rng, 1, 6, 1, 4)
    s = blockwise.scores(q, k, 1.0)
    assert float(jnp.max(jnp.abs(s))) > 1e4
    (o1, l1), (o2, l2) = (blockwise.attend(q, k[:, :, a:b], v[:, :, a:b], scale=1.0) for a, b in ((0, 2), (2, 6)))
    o, lse = blockwise.merge(o1, l1, o2, l2)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(lse)))
    assert_close(o, jnp.einsum("bkgqs,bksh->bkgqh", jax.nn.softmax(s, axis=-1), v), scale=10)


@pytest.mark.parametrize("masked", [False, True])
def test_block_backward_equals_autodiff(masked):
    rng = np.random.default_rng(3)
    q = _grouped(rng, 2, 6, 2, 2, 4)
    k, v = (_kv(rng, 2, 6, 2, 4) for _ in range(2))
    do = _grouped(rng, 2, 6, 2, 2, 4)
    mask = blockwise.causal_mask(6, 6) if masked else None

    @jax.jit   # one compile instead of one per operation
    def block_and_autodiff(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, mask), q, k, v)
        _, lse = blockwise.attend(q, k, v, scale=0.5, mask=mask)
        delta = jnp.sum(do * o, -1)
        return blockwise.attend_backward(q, k, v, do, lse, delta, scale=0.5, mask=mask), vjp(do)

    assert_close(*block_and_autodiff(q, k, v, do))


def test_grouped_layout_round_trips_and_matches_reference_heads():
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 5, 6, 4)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 5, 2, 4)), jnp.float32) for _ in range(2))
    np.testing.assert_array_equal(blockwise.ungroup(blockwise.group(q, 2)), q)
    hm = blockwise.heads_major
    np.testing.assert_array_equal(hm(hm(k)), k)
    o, _ = blockwise.attend(blockwise.group(q, 2), hm(k), hm(v), scale=0.5, mask=blockwise.causal_mask(5, 5))
    assert_close(blockwise.ungroup(o), reference.attention(q, k, v, causal=True))


@pytest.mark.parametrize("t, chunk", [(12, 4), (12, 5), (16, 3), (7, 2), (8, 8), (9, 1)])
def test_chunked_and_halved_diagonal_blocks_equal_the_masked_block(t, chunk):
    rng = np.random.default_rng(t * 10 + chunk)
    q, do = _grouped(rng, 2, t, 2, 2, 4), _grouped(rng, 2, t, 2, 2, 4)
    k, v = (_kv(rng, 2, t, 2, 4) for _ in range(2))
    mask = blockwise.causal_mask(t, t)

    @jax.jit   # one compile per case instead of one per primitive
    def everything(q, k, v, do):
        out = {}
        for causal in (False, True):
            o, lse = blockwise.attend(q, k, v, scale=0.5, mask=mask if causal else None)
            delta = jnp.sum(do * o, -1)
            out[causal] = {
                "want": ((o, lse), blockwise.attend_backward(q, k, v, do, lse, delta, scale=0.5,
                                                             mask=mask if causal else None)),
                "chunked": (blockwise.attend_chunked(q, k, v, scale=0.5, causal=causal, chunk=chunk),
                            blockwise.attend_backward_chunked(q, k, v, do, lse, delta, scale=0.5, causal=causal,
                                                              chunk=chunk))}
            if causal:
                for depth in (0, 1, 3):
                    out[causal][f"halved {depth}"] = (
                        blockwise.attend_diagonal(q, k, v, scale=0.5, chunk=chunk, depth=depth),
                        blockwise.attend_diagonal_backward(q, k, v, do, lse, delta, scale=0.5, chunk=chunk,
                                                           depth=depth))
        return out

    for results in everything(q, k, v, do).values():
        want = results.pop("want")
        for name, got in results.items():
            assert_close(got, want)


def test_chunk_size_divides_or_keeps_the_block_whole():
    assert blockwise.chunk_size(1024, 128) == 128
    assert blockwise.chunk_size(100, 128) == 100
    assert blockwise.chunk_size(96, 64) == 48
    assert blockwise.chunk_size(131, 16) == 131      # a prime: no slivers of one key
