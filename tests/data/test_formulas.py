"""data.formulas by hand (pure Python): the reduction's bytes per group, ZeRO-1's, the
program's collectives, and the weights it refuses."""

import pytest

from jaxpar.data import formulas
from jaxpar.data.formulas import Weight
from jaxpar.errors import ConfigError

SIZES = {"dp": 2, "pp": 2, "cp": 1, "ep": 2, "tp": 2}
BATCH = ("dp", "ep")


def test_summed_axes_leave_out_what_the_layout_splits_and_add_the_extra():
    assert formulas.summed_axes((), BATCH) == ("dp", "ep")
    assert formulas.summed_axes(("ep", "tp"), BATCH) == ("dp",)
    assert formulas.summed_axes(("tp",), BATCH, ("pp",)) == ("dp", "ep", "pp")
    assert formulas.all_reduce_axes(Weight(nbytes=8, itemsize=4, zero=True), BATCH) == ("ep",)


def test_reduction_bytes_by_group_size():
    weights = [Weight(nbytes=64, itemsize=4),                                # over dp x ep: 4
               Weight(nbytes=32, itemsize=4, split=("ep", "tp")),            # over dp: 2
               Weight(nbytes=16, itemsize=4, split=("tp",), extra=("pp",)),  # over dp x ep x pp: 8
               Weight(nbytes=8, itemsize=4, zero=True),                      # over ep (dp: reduce-scatter)
               Weight(nbytes=4, itemsize=4, split=("dp", "ep"))]             # split over both: no sum
    assert formulas.reduction_bytes(weights, sizes=SIZES, batch_axes=BATCH) == {4: 64.0, 2: 40.0, 8: 16.0}
    assert formulas.reduction_bytes(weights, sizes=SIZES | {"dp": 1, "ep": 1}, batch_axes=BATCH) == {2: 16.0}
    assert formulas.zero_bytes(weights, dp=2) == {"reduce-scatter": 8.0, "all-gather": 8.0}
    assert formulas.zero_bytes(weights, dp=1) == {"reduce-scatter": 0.0, "all-gather": 0.0}


def test_the_program_has_one_all_reduce_per_group_and_a_pair_per_zero_weight():
    weights = [Weight(nbytes=64, itemsize=4), Weight(nbytes=32, itemsize=4),
               Weight(nbytes=24, itemsize=4, split=("ep",)),
               Weight(nbytes=8, itemsize=4, zero=True), Weight(nbytes=16, itemsize=4, zero=True)]
    c = formulas.dp_collectives(weights, sizes=SIZES, batch_axes=BATCH)
    # groups: {dp, ep} (64 + 32), {dp} (24), {ep} (the ZeRO weights' non-dp part, 8 + 16)
    assert c == {"all-reduce": (3, 144), "reduce-scatter": (2, 24), "all-gather": (2, 24)}
    assert formulas.dp_collectives(weights, sizes={a: 1 for a in SIZES}, batch_axes=BATCH) == {}


@pytest.mark.parametrize("kw, words", [
    (dict(nbytes=-1, itemsize=4), "nbytes=-1"),
    (dict(nbytes=8, itemsize=0), "itemsize=0"),
    (dict(nbytes=8, itemsize=4, split="tp"), "split='tp': give a tuple of mesh axis names"),
    (dict(nbytes=8, itemsize=4, extra=("pp", 2)), r"extra=\('pp', 2\)"),
    (dict(nbytes=8, itemsize=4, zero=1), "zero=1"),
])
def test_bad_weights_are_refused(kw, words):
    with pytest.raises(ConfigError, match=words):
        Weight(**kw)


def test_zero3_bytes_by_hand():
    """Per use: every ZeRO weight gathered forward, the regathered ones again in the backward,
    each reduce-scattered once; weights ZeRO leaves whole move nothing here."""
    weights = [Weight(nbytes=64, itemsize=4, zero=True, regather=True),     # a matrix
               Weight(nbytes=16, itemsize=4, zero=True),                    # a norm's gain: not gathered again
               Weight(nbytes=8, itemsize=4)]                                # whole: all-reduced instead
    got = formulas.zero3_bytes(weights, dp=4, forward=2, backward=3, scatters=3)
    assert got == {"all-gather": 2 * 80 + 3 * 64, "reduce-scatter": 3 * 80}
    assert formulas.zero3_bytes(weights, dp=1, forward=2, backward=3, scatters=3) == {"all-gather": 0.0,
                                                                                      "reduce-scatter": 0.0}
    one_use = formulas.zero3_bytes(weights[:1], dp=2, forward=1, backward=1, scatters=1)
    assert sum(one_use.values()) == 3 * 64                  # the weights move 3 times per use
    with pytest.raises(ConfigError, match="regather"):
        Weight(nbytes=8, itemsize=4, regather=1)
