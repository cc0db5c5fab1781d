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
    (lambda: catalog.model("gpt5"), r"unknown model 'gpt5'; known: gpt3-175b, megatron-1t, llama3-8b"),
    (lambda: catalog.accelerator("v100"), r"unknown GPU 'v100'; known: a100, h100"),
    (lambda: S.Cluster(gpu=H100, gpus=12), r"gpus=12 is not a multiple of the 8 h100 per node"),
    (lambda: S.search(L405, S.Cluster(gpu=H100, gpus=16), tokens=1000, seq_len=8192), "not a whole number of 8192-token"),
    (lambda: S.best(L405, S.Cluster(gpu=H100, gpus=8), tokens=8192 * 8, seq_len=8192), "fits no configuration on 8 h100"),
    (lambda: S.Cluster(gpu=H100, gpus=8, mfu=1.5), r"mfu=1.5"),
    (lambda: S.Cluster(gpu=H100, gpus=2**40), r"gpus=1099511627776 is more than 16,777,216"),
    (lambda: S.Candidate(tp=0, pp=16, dp=128), r"tp=0: need at least 1"),
    (lambda: S.Candidate(tp=8, pp=16, dp=128, microbatch_size=0), r"microbatch_size=0: need at least 1"),
    (lambda: S.Candidate(tp=8, pp=16, dp=128, cp=2.5), r"cp=2.5 is a float"),
    (lambda: S.Candidate(tp=8, pp=16, dp=128, recompute="some"), r"recompute='some'"),
    (lambda: S.sequences(float("nan"), 8192), r"tokens=nan"),
    (lambda: S.sequences(float("inf"), 8192), r"tokens=inf"),
    (lambda: S.sequences(1e30, 8192), r"tokens=1e\+30"),
    (lambda: exercises.exercise_1(max_bubble=0.0), r"max_bubble=0.0: a fraction of the step in \(0, 1\)"),
    (lambda: exercises.exercise_1(max_bubble=1.0), r"max_bubble=1.0"),
    (lambda: exercises.exercise_3(t=3), r"n_heads=64 is not divisible by t=3"),
    (lambda: exercises.exercise_3(t=128), r"n_heads=64 is not divisible by t=128"),
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


# ---- uneven stages: per-stage costs, the slowest stage's pace, a balanced split ------------------

L8B = catalog.model("llama3-8b")


def test_balanced_split_makes_the_ends_lighter():
    assert S.balanced_split(6, 4) == (1, 2, 2, 1)
    assert S.balanced_split(8, 4) == (2, 2, 2, 2)
    assert S.balanced_split(126, 16, head_cost=0.63) == (7,) + (8,) * 14 + (7,)      # Llama 3 405B on pp=16
    assert S.balanced_split(32, 4, head_cost=2.09) == (8, 9, 9, 6)                   # the 8B's head: 2 layers' work
    assert S.balanced_split(6, 4, chunks=2) == (1, 2, 2, 1)     # devices 0 (stages 0, 2) and 1 (1, 3): 3 layers each
    assert S.split_label((7,) + (8,) * 14 + (7,)) == "7/8x14/7"
    assert S.head_cost(L405, 8192) == pytest.approx(0.63, abs=0.01)
    assert S.head_cost(L8B, 8192) == pytest.approx(2.09, abs=0.01)


@pytest.mark.parametrize("call, match", [
    (lambda: S.balanced_split(3, 4), "3 layers cannot fill 4 stages"),
    (lambda: S.balanced_split(8, 4, head_cost=-1.0), "head_cost=-1.0: a cost in layers"),
    (lambda: S.balanced_split(8, 3, chunks=2), "stages=3 is not pp x chunks"),
    (lambda: S.parse_split("7/8y/7", model=L405, stages=16, seq_len=8192), "layers='7/8y/7'"),
])
def test_bad_split_input(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


@pytest.mark.parametrize("name, p, m, chunks", [("1f1b", 4, 8, 1), ("1f1b", 16, 16, 1), ("interleaved", 4, 8, 2)])
def test_even_stages_span_is_the_closed_form_bubble(name, p, m, chunks):
    from jaxpar.pipeline import formulas

    span, busiest = S.pipeline_span((1.0,) * (p * chunks), pp=p, microbatches=m, chunks=chunks)
    assert (span - busiest) / span == pytest.approx(formulas.bubble(name, p, m, chunks))


def test_uneven_span_bounds_the_timed_schedule():
    """The closed form's span is an upper bound of the 1F1B table timed with these
    per-stage costs (`schedules.timing`), within a few percent: the slowest stage sets it."""
    from jaxpar.schedules import schedule, timing

    for costs in ((3.0, 6.0, 6.0, 3.0), (3.0, 6.0, 3.0, 3.0), (2.0, 3.0, 3.0, 2.5)):
        timed = timing.timed(schedule.make("1f1b", stages=4, microbatches=8),
                             timing.Costs(F=tuple(c / 3 for c in costs), B=tuple(2 * c / 3 for c in costs)))
        span, busiest = S.pipeline_span(costs, pp=4, microbatches=8)
        assert busiest == 8 * max(costs)
        assert timed.makespan <= span <= 1.1 * timed.makespan


def _est8b(split, recompute="full"):
    return S.evaluate(L8B, S.Cluster(gpu=H100, gpus=64), S.Candidate(tp=1, pp=4, dp=16, recompute=recompute,
                      layers_per_stage=split), tokens=4 * 2**20, seq_len=8192)


def test_the_slowest_stage_sets_the_step():
    """Llama 3 8B on pp=4: even stages leave the LM head (2.09 layers) on a last stage of 8
    layers, the slowest; the balanced split (8, 9, 9, 6) is faster by about 10.09/9."""
    even, balanced = _est8b((8, 8, 8, 8)), _est8b((8, 9, 9, 6))
    assert even.feasible and balanced.feasible
    head = S.head_cost(L8B, 8192)
    m = balanced.microbatches
    # (sum of the stages' costs - the slowest's) / (m x the slowest's + that): the slowest 9 layers, or 8 + the head
    assert balanced.bubble == pytest.approx((32 + head - 9) / (9 * m + 32 + head - 9))
    assert even.bubble == pytest.approx(24 / ((8 + head) * m + 24))
    assert even.step / balanced.step == pytest.approx(1.1, abs=0.02)
    split = S.propose_split(L8B, S.Cluster(gpu=H100, gpus=64), S.Candidate(tp=1, pp=4, dp=16, recompute="full"),
                            tokens=4 * 2**20, seq_len=8192)
    assert split.layers_per_stage == (8, 9, 9, 6) and split.near_even.candidate.layers_per_stage == (8, 8, 8, 8)
    assert split.balanced.step < split.near_even.step


def test_memory_counts_each_stages_own_layers():
    """Llama 3 405B on pp=16: the even model holds ceil(126/16) = 8 layers on the first
    stage at p microbatches in flight; with 7/8x14/7 the first holds 7 x 16 and the
    second, the peak, 8 x 15 (layer-microbatches); a split that loads the first device
    more raises its memory."""
    even = est(8, 16, 128)
    balanced = est(8, 16, 128, layers_per_stage=(7,) + (8,) * 14 + (7,))
    heavy_first = est(8, 16, 128, layers_per_stage=(9,) + (8,) * 13 + (7, 6))
    assert balanced.memory["activations"] == pytest.approx(even.memory["activations"] * 8 * 15 / (8 * 16))
    assert heavy_first.memory["activations"] == pytest.approx(even.memory["activations"] * 9 / 8)
    assert heavy_first.memory["total"] > balanced.memory["total"]


def test_exercise_1_is_the_fewest_microbatches_for_any_bound():
    """The closed form m >= (p-1)(1-b)/b against counting up until the bubble fits."""
    from jaxpar.pipeline import formulas

    for p in range(1, 17):
        for b in (0.01, 0.05, 0.1, 3 / 11, 1 / 3, 0.5, 0.9):
            m = exercises.exercise_1(p=p, max_bubble=b)["microbatches"]
            assert formulas.bubble("1f1b", p, m) <= b + 1e-12
            assert m == 1 or formulas.bubble("1f1b", p, m - 1) > b + 1e-12, (p, b, m)


def test_uneven_interleaved_memory_is_the_tables_peak():
    """With chunks, a device holds microbatch-chunks of several stages of different sizes:
    the planner reads each device's peak off the interleaved table, each stage weighing
    its layers (405B's 126 layers as 2 x 30 then 33, 33 over pp=16, v=2: device 14 holds
    stages 14 (2 layers) and 30 (33), its peak 131 layer-microbatches, the largest)."""
    from jaxpar.memory import activations
    from jaxpar.schedules import schedule

    split = (2,) * 30 + (33, 33)
    e = est(8, 16, 128, recompute="selective", chunks=2, layers_per_stage=split)
    peaks = schedule.make("interleaved", 16, e.microbatches, 2).weighted_peaks(split)
    assert max(peaks) == peaks[14] == 131
    per_layer = activations.layer_bytes(S.block(L405), seq_len=8192, tp=8, sp=True, recompute="selective")
    assert e.memory["activations"] == pytest.approx(131 * per_layer)


def test_a_split_that_does_not_fit_is_rejected_with_its_reason():
    e = est(8, 16, 128, layers_per_stage=(8,) * 16)
    assert not e.feasible and any("sums to 128, the model has 126 layers" in r for r in e.reasons)
    assert "layers=8x16" in e.candidate.label()


def test_jaxpar_plan_shows_and_takes_a_split(capsys):
    from jaxpar.cli.main import main as cli_main

    assert cli_main(["plan", "--model", "llama3-8b", "--gpus", "64", "--tokens", "4M",
                     "--config", "tp=1,pp=4,dp=16,recompute=full,layers=balanced"]) == 0
    assert "layers=8/9/9/6" in capsys.readouterr().out
    assert cli_main(["plan", "--model", "llama3-70b", "--gpus", "512", "--tokens", "4M"]) == 0
    out = capsys.readouterr().out
    assert "uneven stages (the LM head costs 1.14 layers, on the last stage" in out and "balanced split layers=" in out
    assert "nearest to even, layers=5x16" in out
