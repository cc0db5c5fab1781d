"""Layouts, the ring's block plan and the load report (pure Python), checked against the
causal mask itself: every block the plan skips is wholly masked, every full block wholly
visible, and the visible pairs it reports are those the mask has."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar.context import zigzag
from jaxpar.errors import ConfigError


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("layout", zigzag.LAYOUTS)
def test_layout_round_trips_exactly_and_positions_name_the_tokens(cp, layout):
    T = 2 * cp * 3
    x = np.arange(2 * T).reshape(2, T) * 10   # rank-coded: a token's value is its position
    y = zigzag.to_layout(x, cp, layout)
    np.testing.assert_array_equal(y[0] // 10, zigzag.positions(T, cp, layout))
    np.testing.assert_array_equal(zigzag.from_layout(y, cp, layout), x)
    assert sorted(zigzag.positions(T, cp, layout)) == list(range(T))


def test_zigzag_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i():
    assert [zigzag.chunks(i, 4, "zigzag") for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [zigzag.chunks(i, 4, "contiguous") for i in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # 16 tokens, cp 2: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11
    assert list(zigzag.positions(16, 2, "zigzag")) == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]


def _mask_block(T, cp, layout, rank, src):
    pos = zigzag.positions(T, cp, layout).reshape(cp, -1)
    return pos[rank][:, None] >= pos[src][None, :]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", zigzag.LAYOUTS)
def test_the_plan_skips_only_masked_work_and_masks_only_the_diagonal(cp, layout):
    T = 2 * cp * 4
    c = T // (2 * cp)
    table = zigzag.plan(cp, layout, causal=True)
    for r in range(cp):
        for i in range(cp):
            m = _mask_block(T, cp, layout, i, (i - r) % cp)
            kind = table[r, i]
            if kind == zigzag.SKIP:
                assert not m.any()
            elif kind == zigzag.FULL:
                assert m.all()
            elif kind == zigzag.EARLY_KV:
                assert m[:, :c].all() and not m[:, c:].any()
            elif kind == zigzag.LATE_Q:
                assert m[c:].all() and not m[:c].any()
            else:
                assert kind == zigzag.DIAGONAL and r == 0
                np.testing.assert_array_equal(m, np.tri(2 * c, dtype=bool))
    assert (zigzag.plan(cp, layout, causal=False) == zigzag.FULL).all()


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(1, 16), st.integers(1, 6), st.sampled_from(zigzag.LAYOUTS))
def test_load_report_counts_exactly_the_visible_pairs(cp, c, layout):
    T = 2 * cp * c
    rep = zigzag.load_report(T, cp, layout)
    for i in range(cp):
        visible = sum(int(_mask_block(T, cp, layout, i, j).sum()) for j in range(cp))
        assert rep.useful[i] == visible
    assert sum(rep.useful) == T * (T + 1) // 2
    assert all(u <= w for u, w in zip(rep.useful, rep.computed))


def test_contiguous_work_grows_with_rank_and_zigzag_is_equal():
    cont = zigzag.load_report(8192, 4, "contiguous")
    zz = zigzag.load_report(8192, 4, "zigzag")
    assert all(a < b for a, b in zip(cont.useful, cont.useful[1:]))
    assert cont.steps_busy == (1, 2, 3, 4)
    assert len(set(zz.useful)) == 1 and len(set(zz.computed)) == 1 and zz.imbalance == 1.0
    assert cont.imbalance == pytest.approx(1.6)          # rank 3 computes 4 blocks, the mean is 2.5
    # the lecture's picture: rank 0 almost idle, rank 3 with (nearly) 7/16 of the work
    assert cont.useful[0] / sum(cont.useful) == pytest.approx(1 / 16, rel=1e-3)
    assert cont.useful[3] / sum(cont.useful) == pytest.approx(7 / 16, rel=1e-3)
    assert zz.to_json()["imbalance"] == 1.0


@pytest.mark.parametrize("args, words", [
    ((30, 4, "zigzag"), "not divisible by 8"),
    ((30, 4, "contiguous"), "not divisible by 4"),
    ((32, 0, "zigzag"), "cp=0"),
    ((32, 4, "striped"), "layout='striped'"),
    ((32.0, 4, "zigzag"), "seq_len=32.0"),
])
def test_bad_sequences_and_layouts_are_refused(args, words):
    with pytest.raises(ConfigError, match=words):
        zigzag.check_sequence(*args)
    with pytest.raises(ConfigError):
        zigzag.load_report(*args)


@pytest.mark.parametrize("x, axis, words", [
    (np.zeros((2, 16, 8, 4)), 5, r"axis=5: x has shape \(2, 16, 8, 4\) \(rank 4\), so its sequence axis is one "
                                 r"of -4 .. 3"),
    (np.zeros((2, 16, 8, 4)), -5, "axis=-5"),
    (np.zeros((2, 16, 8, 4)), 1.0, "axis=1.0"),
    ([[0.0] * 16], 1, "x is a list, not an array"),
])
def test_a_sequence_axis_x_does_not_have_is_refused(x, axis, words):
    for f in (zigzag.to_layout, zigzag.from_layout):
        with pytest.raises(ConfigError, match=words):
            f(x, 4, "zigzag", axis=axis)
    assert zigzag.to_layout(np.zeros((2, 16, 8, 4)), 4, "zigzag", axis=-3).shape == (2, 16, 8, 4)
