"""The collectives of one compiled training step equal the sum of the techniques' formulas:
the pipeline's sends, every TP/SP collective inside the stages (per pp rank, from the
plan's counts of each branch), the gradient reduction, the norm, the loss and ZeRO-1."""

import pytest

from jaxpar import comms
from jaxpar.train import summary, verify
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

CASES = {
    "dp2 pp2 tp2 1f1b": ParallelSpec(dp=2, pp=2, tp=2, microbatches=2),
    "pp2 tp4 interleaved (KV heads replicated)": ParallelSpec(pp=2, tp=4, schedule="interleaved", microbatches=2),
    "dp2 pp2 tp2 SP zb-h1 recompute": ParallelSpec(dp=2, pp=2, tp=2, microbatches=2, sequence_parallel=True,
                                                   schedule="zb-h1", recompute=True),
    "dp4 tp2 SP ZeRO-1": ParallelSpec(dp=4, tp=2, sequence_parallel=True, zero=1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_step_runs_the_formulas_collectives(name):
    spec = CASES[name]
    trainer = Trainer(verify.DENSE, spec, verify.OPTIM, batch_size=8, seq_len=16)
    c = summary.collectives(trainer, trainer.compiled)
    assert c["sends"] == c["expected_sends"]
    assert c["reductions"] == c["expected_reductions"]
    assert c["zero"] == c["expected_zero"] and (c["zero"]["all-gather"] > 0) == bool(spec.zero)
    for d in range(spec.pp):
        # one stage (pipeline.direct): the formula bounds each kind's bytes (summary.stage_matches)
        assert summary.stage_matches(c["stages"][d], c["expected_stages"][d], direct=spec.pp == 1), (
            d, c["stages"][d], c["expected_stages"][d])
        assert c["stages"][d]                       # tp > 1: something runs in every stage
    assert summary.matches(c)


def test_a_wrong_formula_is_noticed():
    trainer = Trainer(verify.DENSE, CASES["dp2 pp2 tp2 1f1b"], verify.OPTIM, batch_size=8, seq_len=16)
    c = summary.collectives(trainer, trainer.compiled)
    c["expected_stages"][0] = c["expected_stages"][0] + comms.Collectives({"all-reduce": (1, 4)})
    assert not summary.matches(c)


def test_at_one_stage_a_formula_below_the_measured_bytes_is_noticed():
    # the one-stage program's stage collectives are bounded by the formula: fewer bytes in it
    # than the program moves, or a kind it lacks, fails the check
    trainer = Trainer(verify.DENSE, CASES["dp4 tp2 SP ZeRO-1"], verify.OPTIM, batch_size=8, seq_len=16)
    c = summary.collectives(trainer, trainer.compiled)
    assert summary.matches(c)
    measured, expected = c["stages"][0], c["expected_stages"][0]
    kind = next(iter(measured))
    c["expected_stages"][0] = comms.Collectives(
        {k: (n, measured[k][1] - 4 if k == kind else b) for k, (n, b) in expected.items()})
    assert not summary.matches(c)
    c["expected_stages"][0] = comms.Collectives({k: v for k, v in expected.items() if k != kind})
    assert not summary.matches(c)
