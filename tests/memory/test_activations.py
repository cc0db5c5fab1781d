"""The activation and model-state model against the lecture's figures (4.2, 4.5, 5.1) and
Korthikanti et al.'s closed forms, for drawn shapes too."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpar.errors import ConfigError
from jaxpar.memory import activations as A
from jaxpar.memory import states as S
from jaxpar.pipeline.formulas import in_flight

GPT3 = A.Block(d_model=12288, n_heads=96)


def test_lecture_4_2_gpt3_layer():
    terms = A.breakdown(GPT3, seq_len=2048)
    linear = sum(b for name, b in terms if name not in ("softmax output", "softmax dropout mask", "dropout output"))
    assert round(linear / 1e9, 2) == 0.86 and round((A.layer_bytes(GPT3, seq_len=2048) - linear) / 1e9, 2) == 2.01
    assert round(A.layer_bytes(GPT3, seq_len=2048) / 1e9, 2) == 2.87
    assert round(96 * A.layer_bytes(GPT3, seq_len=2048) / 1e9) == 275
    assert len(terms) == 14


def test_lecture_5_1_long_sequences_with_tp_and_sp():
    small, large = (A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True, recompute="selective") for s in (2048, 131072))
    assert round(small / 1e9, 2) == 0.11 and round(large / 1e9, 2) == 6.85
    share = [1 - A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True, recompute="selective")
             / A.layer_bytes(GPT3, seq_len=s, tp=8, sp=True) for s in (2048, 131072)]
    assert round(share[0], 2) == 0.70 and round(share[1], 2) == 0.99


def test_lecture_4_5_gpt3_with_t8():
    """34sbh/t per layer with TP + SP + selective recompute: 0.107 GB, from 2.87 GB."""
    got = {kw: A.layer_bytes(GPT3, seq_len=2048, tp=8, **dict(kw)) / 1e9 for kw in
           ((), (("sp", True),), (("sp", True), ("recompute", "selective")), (("recompute", "selective"),))}
    assert [round(v, 3) for v in got.values()] == [0.579, 0.359, 0.107, 0.327]


@settings(max_examples=60, deadline=None)
@given(s=st.sampled_from([128, 512, 2048, 8192]), b=st.integers(1, 4), h=st.sampled_from([256, 1024, 4096]),
       a=st.sampled_from([8, 16, 32]), t=st.sampled_from([1, 2, 4, 8]), sp=st.booleans(),
       rc=st.sampled_from(A.RECOMPUTE))
def test_terms_sum_to_the_papers_closed_forms(s, b, h, a, t, sp, rc):
    block = A.Block(d_model=h, n_heads=a)
    got = A.layer_bytes(block, seq_len=s, batch_size=b, tp=t, sp=sp, recompute=rc)
    assert got == pytest.approx(A.gpt_formula(seq_len=s, batch_size=b, d_model=h, n_heads=a, tp=t, sp=sp, recompute=rc))


def test_modern_blocks_constants():
    h, s = 1024, 512
    sbh = 2 * s * h  # bytes of one [s, 1, h] bf16 activation
    plain = A.Block(d_model=h, n_heads=16, dropout=False)
    assert A.layer_bytes(plain, seq_len=s) == pytest.approx(16 * sbh + 2 * 16 * s * s * 2 / 2 + 0)  # 32sbh + 2as^2b
    swiglu = A.Block(d_model=h, n_heads=16, dropout=False, mlp="swiglu", d_ff=4 * h, flash=True)
    # 8 (norms, inputs) + 4 (Q, K) + 2 (V) + 2 (out) + 24 (3 x 2sbF, F = 4h) sbh; lse 4as
    assert A.layer_bytes(swiglu, seq_len=s) == pytest.approx(20 * sbh + 4 * 16 * s)
    gqa = A.Block(d_model=h, n_heads=16, n_kv_heads=4, dropout=False, flash=True)
    assert A.layer_bytes(gqa, seq_len=s) == pytest.approx((8 + 2 + 0.5 + 0.5 + 2 + 16) / 2 * sbh + 4 * 16 * s)


def test_in_flight_and_first_stage():
    assert in_flight("gpipe", p=8, m=64) == 64 and in_flight("1f1b", p=8, m=64) == 8
    assert in_flight("interleaved", p=4, m=8, chunks=2) == 5.5   # 11 chunks of half a stage (the runtime's plan)
    assert in_flight("zb-h2", p=4, m=8) == 7 and in_flight("naive", p=4, m=8) == 1
    assert in_flight("zb-h1", p=4, m=4) == 4 and in_flight("dualpipe-v", p=4, m=8, chunks=2) == 4   # 2p half-stage chunks
    with pytest.raises(ConfigError, match="zb-h1 needs microbatches >= stages"):   # as its table refuses
        in_flight("zb-h1", p=4, m=2)
    one = A.layer_bytes(GPT3, seq_len=2048, tp=8, sp=True)
    assert A.first_stage_bytes(GPT3, n_layers=96, seq_len=2048, tp=8, sp=True, pp=8,
                               in_flight=in_flight("1f1b", p=8, m=64)) == pytest.approx(12 * one * 8)
    assert A.first_stage_bytes(GPT3, n_layers=96, seq_len=2048) == A.layer_bytes(GPT3, seq_len=2048) * 96   # one in flight


def test_states_and_zero():
    n = 1e9
    assert S.state_bytes(dense=n, zero=0).total == 16e9
    assert S.state_bytes(dense=n, dp=8, zero=1) == S.States(2e9, 2e9, 1.5e9)
    assert S.state_bytes(dense=n, dp=8, zero=2) == S.States(2e9, 0.25e9, 1.5e9)
    assert S.state_bytes(dense=n, dp=8, zero=3).total == 2e9
    assert S.state_bytes(dense=n, tp=2, pp=2, precision="fp32").total == 4e9
    assert S.state_bytes(dense=0, experts=n, ep=4, dp=8, zero=1).optimizer == 12e9 / 4 / 2


@pytest.mark.parametrize("call,match", [
    (lambda: A.layer_bytes(GPT3, seq_len=2048, recompute="some"), "recompute='some'"),
    (lambda: A.layer_bytes(GPT3, seq_len=2048, cp=3), "seq_len=2048 is not divisible by cp=3"),
    (lambda: A.layer_bytes(GPT3, seq_len=2048, tp=7), "tp=7 splits neither the 96 heads nor the 96 KV heads"),
    (lambda: A.layer_bytes(GPT3, seq_len=2048, tp=192), "tp=192 splits neither"),
    (lambda: A.layer_bytes(GPT3, seq_len=100, tp=8, sp=True), "not divisible by tp x cp = 8"),
    (lambda: A.Block(d_model=96, n_heads=6, n_kv_heads=4), "n_heads=6 is not a multiple of n_kv_heads=4"),
    (lambda: A.Block(d_model=4, n_heads=64), "d_model=4 is not divisible by n_heads=64"),
    (lambda: A.Block(d_model=64, n_heads=8, act_bytes=3), "act_bytes=3: bytes per activation element"),
    (lambda: A.layer_bytes(GPT3, seq_len=10**12), "seq_len=1000000000000 is more than"),
    (lambda: A.gpt_formula(seq_len=-1, batch_size=1, d_model=64, n_heads=8), "seq_len=-1: need at least 1"),
    (lambda: A.gpt_formula(seq_len=8, batch_size=1, d_model=64, n_heads=8, recompute="bad"), "recompute=.bad."),
    (lambda: in_flight("pipedream", p=2, m=2), "unknown schedule 'pipedream'"),
    (lambda: A.first_stage_bytes(GPT3, n_layers=96, seq_len=2048, in_flight=0), "in_flight=0: must be > 0"),
    (lambda: S.state_bytes(dense=1e9, zero=4), "ZeRO stage 0, 1, 2 or 3"),
    (lambda: S.state_bytes(dense=1, experts=1, dp=6, ep=4), "dp=6 is not divisible by ep=4"),
    (lambda: S.state_bytes(dense=-1), "dense=-1: must be >= 0"),
    (lambda: S.state_bytes(dense=float("nan")), "dense=nan is not a real number"),
    (lambda: S.state_bytes(dense=float("inf")), "dense=inf: must be finite"),
    (lambda: S.state_bytes(dense="1e9"), "dense='1e9' is not a real number"),
    (lambda: S.state_bytes(dense=1e9, experts=-5), "experts=-5: must be >= 0"),
    (lambda: S.state_bytes(dense=1e9, zero=1.0), r"zero=1.0: ZeRO stage 0, 1, 2 or 3"),
    (lambda: S.state_bytes(dense=1e9, zero=True), r"zero=True: ZeRO stage 0, 1, 2 or 3"),
])
def test_bad_input(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_kv_heads_past_tp_are_replicated_not_split():
    """With tp above n_kv_heads each device holds one whole KV head (replicated), so K and
    V stay 2sbh/a each per device while Q and the rest keep splitting t ways."""
    gqa = A.Block(d_model=1024, n_heads=16, n_kv_heads=2, d_ff=4096, mlp="swiglu", dropout=False)
    s, b, h, a = 512, 1, 1024, 16
    x, head = 2 * s * b * h, 2 * s * b * h / a
    for tp, kv_devices in ((1, 1), (2, 2), (4, 2), (16, 2)):
        terms = dict(A.breakdown(gqa, seq_len=s, batch_size=b, tp=tp))
        assert terms["V"] == pytest.approx(2 * head / kv_devices)
        assert terms["Q and K"] == pytest.approx(x / tp + 2 * head / kv_devices)
