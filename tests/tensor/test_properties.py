"""Property test: the TP/SP block equals reference.block for model shapes and meshes drawn
at random, not only the hand-picked ones of test_tensor.py.

Drawn: heads N, KV heads K (split when tp | K, replicated when K | tp), head dim, FFN
width, GeLU/SwiGLU, causal or not, dp x tp over the 8 devices with tp > 1, TP or SP, batch and
sequence (multiples of dp and, for SP, tp). Checked: output, input gradient and every
parameter gradient within the float32 tolerance, and the forward's and backward's collectives equal
to tensor.tp_block_collectives. Each example compiles two programs, so the count is small.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.tensor.verify import run_block
from jaxpar.testing import assert_close


@st.composite
def tp_cases(draw):
    tp = draw(st.sampled_from([2, 4, 8]))   # tp = 1 (nothing split) is test_tensor.py's (8, 1) case
    dp = 8 // tp
    n_heads = tp * draw(st.sampled_from([1, 2]))
    # K divides N, and either tp | K (split) or K | tp (replicated)
    kv = draw(st.sampled_from([k for k in range(1, n_heads + 1)
                               if n_heads % k == 0 and (k % tp == 0 or tp % k == 0)]))
    cfg = reference.ModelConfig(
        n_layers=1, vocab=8, n_heads=n_heads, n_kv_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])), d_model=draw(st.sampled_from([8, 16])),
        d_ff=tp * draw(st.sampled_from([2, 3])), mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        causal=draw(st.booleans()))
    sp = draw(st.booleans())
    batch = dp * draw(st.sampled_from([1, 2]))
    seq = (tp if sp else 1) * draw(st.sampled_from([3, 4]))
    return cfg, dp, tp, sp, batch, seq


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(tp_cases())
def test_tp_block_matches_reference_for_drawn_shapes(case):
    cfg, dp, tp, sp, batch, seq = case
    run = run_block(cfg, mesh_lib.make_mesh(dp=dp, tp=tp), sequence_parallel=sp, batch_size=batch, seq_len=seq)
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward
    # Backward bytes always; counts too, except where tp_block_collectives documents that
    # XLA's combiner decides the grouping (dp > 1 with replicated KV heads).
    bytes_of = lambda stats: {k: b for k, (_, b) in stats.items()}
    assert bytes_of(run.backward) == bytes_of(run.formula_backward)
    if not (dp > 1 and tp > 1 and cfg.n_kv_heads % tp):
        assert run.backward == run.formula_backward
