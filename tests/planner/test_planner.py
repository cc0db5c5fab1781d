"""The planner against the lecture (7.3 and exercises 1, 3, 7, 8), the published
configurations, its rejections, and the size of a full sweep (its speed is a benchmark:
benchmarks/planner.py)."""

import pytest

from jaxpar.errors import ConfigError
from jaxpar.planner import catalog, exercises
from jaxpar.planner import search as S

H100 = catalog.accelerator("h100")
L405 = catalog.model("llama3-405b")
BATCH = 16 * 2**20


def est(tp, pp, dp, recompute="full", mfu=0.5, tokens=BATCH, **kw):
    return S.evaluate(L405, S.Cluster(gpu=H100, gpus=16384, mfu=mfu), S.Candidate(tp=tp, pp=pp, dp=dp,
                      recompute=recompute, **kw), tokens=tokens, seq_len=8192)


def test_lecture_7_3_tp_communication():
    """TP 8 inside a node: about 21% of compute; TP 16 across nodes: about 4x. The lecture's
    figures come with compute at peak (mfu=1); at 50% MFU they are half as large."""
    assert est(8, 16, 128, "none", mfu=1.0).ratio("tp") == pytest.approx(0.21, abs=0.01)
    assert est(16, 16, 64, "none", mfu=1.0).ratio("tp") == pytest.approx(4.1, abs=0.15)
    assert est(8, 16, 128, "none").ratio("tp") == pytest.approx(0.105, abs=0.005)


def test_lecture_7_3_bubble_and_feasibility():
    e = est(8, 16, 128)
    assert e.microbatches == 16 and e.bubble == pytest.approx(15 / 31)          # p x d = 2048: m = p, ~50%
    assert e.feasible
    sel = est(8, 16, 128, "selective")
    assert not sel.feasible and "memory" in sel.reasons[0]                        # selective: above 80 GB
    found = S.search(L405, S.Cluster(gpu=H100, gpus=16384), tokens=BATCH, seq_len=8192)
    assert any(x.feasible and (x.candidate.tp, x.candidate.pp, x.candidate.dp) == (8, 16, 128) for x in found)


def test_llama3_8b_is_all_data_parallel():
    b = S.best(catalog.model("llama3-8b"), S.Cluster(gpu=H100, gpus=64), tokens=4 * 2**20, seq_len=8192)
    assert (b.candidate.tp, b.candidate.pp, b.candidate.dp) == (1, 1, 64)


def test_exercises():
    e1 = exercises.exercise_1()
    assert e1["microbatches"] == 63 and round(e1["tokens"] / 1e6, 2) == 1.03
    e3 = exercises.exercise_3()
    assert round(e3["bytes"] / 1e9, 2) == 0.94 and round(e3["nvlink_s"] * 1e3, 1) == 2.1
    assert round(e3["compute_s"] * 1e3) == 10 and round(e3["share"], 2) == 0.21
    assert round(e3["infiniband_s"] * 1e3) == 19
    e7 = exercises.exercise_7()
    assert round(e7["dispatch"] / 1e6) == 462 and round(e7["forward"] / 1e9, 2) == 0.92
    assert round(e7["forward_and_backward"] / 1e9, 2) == 1.85
    e8 = exercises.exercise_8()
    assert e8["microbatches"] == 32 and e8["bubble"] == pytest.approx(15 / 47)


@pytest.mark.parametrize("pub", catalog.PUBLISHED, ids=lambda p: f"{p.model}-{p.gpus}-{p.seq_len}")
def test_published_configurations_are_feasible(pub):
    e = S.evaluate(catalog.model(pub.model), S.Cluster(gpu=catalog.accelerator(pub.gpu), gpus=pub.gpus),
                   S.Candidate(tp=pub.tp, pp=pub.pp, dp=pub.dp, cp=pub.cp, ep=pub.ep, recompute="full"),
                   tokens=pub.tokens, seq_len=pub.seq_len)
    assert e.feasible, e.reasons


def test_rejections_say_why():
    cases = {(3, 1, 1024): "tp=3 splits neither", (8, 256, 8): "pp x chunks = 256 stages for 126 layers",
             (16, 1, 1024): "memory 103.9 GB > 80 GB", (8, 32, 64): None}
    for (tp, pp, dp), why in cases.items():
        e = est(tp, pp, dp)
        assert (why is None and e.feasible) or any(why in r for r in e.reasons), (tp, pp, dp, e.reasons)
    e = est(8, 16, 128, microbatch_size=4, tokens=4 * 2**20)     # 512 sequences = dp x 4: m = 1 < p
    assert any("microbatches < p = 16" in r for r in e.reasons)


@pytest.mark.parametrize("call,match", [
    (lambda: catalog.model("gpt5"), r"unknown model 'gpt5'; known: gpt3-175b, llama3-8b"),
    (lambda: catalog.accelerator("v100"), r"unknown GPU 'v100'; known: a100, h100"),
    (lambda: S.Cluster(gpu=H100, gpus=12), r"gpus=12 is not a multiple of the 8 h100 per node"),
    (lambda: S.search(L405, S.Cluster(gpu=H100, gpus=16), tokens=1000, seq_len=8192), "not a whole number of 8192-token"),
    (lambda: S.best(L405, S.Cluster(gpu=H100, gpus=8), tokens=8192 * 8, seq_len=8192), "fits no configuration on 8 h100"),
    (lambda: S.Cluster(gpu=H100, gpus=8, mfu=1.5), r"mfu=1.5"),
])
def test_bad_input(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_a_full_sweep_of_16384_gpus_evaluates_every_candidate_once():
    found = S.search(L405, S.Cluster(gpu=H100, gpus=16384), tokens=BATCH, seq_len=8192, cps=(1, 2, 4))
    # by hand: tp in 1, 2, 4, 8, 16 (powers of two up to two nodes of 8), pp in 1 .. 64 (7
    # powers of two up to the 126 layers), cp in 1, 2, 4: every product divides 16384 = 2^14;
    # 2 chunk counts when pp > 1; 3 microbatch sizes; 3 recompute choices
    assert len(found) == 5 * 3 * (1 + 6 * 2) * 3 * 3 == 1755
    assert len({e.candidate for e in found}) == 1755
    assert all(e.candidate.tp * e.candidate.pp * e.candidate.cp * e.candidate.dp == 16384 for e in found)
