"""Property test: ring, Ulysses and 2-D attention equal reference.attention (output, dQ,
dK, dV) and their compiled collectives equal the formulas, for shapes and meshes drawn at
random, not only the hand-picked ones of test_ring.py and test_ulysses.py.

Drawn: the method; cp (and ucp) with dp filling the 8 devices; layout; causal or not;
heads N, KV heads K (any divisor of N the method accepts), head dim, batch, sequence
length (a multiple of what the layout needs, odd chunks included); natural or layout
order in; keys per chunk. Each example compiles a forward, a backward and the reference, so few are drawn."""

import jax
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar import mesh as mesh_lib
from jaxpar.context.verify import AttentionCase, run_attention
from jaxpar.testing import assert_close


@st.composite
def cases(draw):
    method = draw(st.sampled_from(["ring", "ulysses", "hybrid"]))
    # cp > 1: cp = 1 (nothing split) is test_ring.py's and test_ulysses.py's (8, 1) case
    if method == "hybrid":
        cp, ucp = draw(st.sampled_from([(2, 2), (2, 4), (4, 2), (1, 2), (2, 1)]))
    else:
        cp, ucp = draw(st.sampled_from([2, 4, 8])), 1
    u = cp if method == "ulysses" else ucp
    dp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if d * cp * ucp <= 8]))
    layout = "contiguous" if method == "ulysses" else draw(st.sampled_from(["contiguous", "zigzag"]))
    ring_cp = 1 if method == "ulysses" else cp
    n_heads = u * draw(st.sampled_from([1, 2, 3]))
    kv = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0 and (k % u == 0 or u % k == 0)]))
    pieces = (2 * ring_cp if layout == "zigzag" else ring_cp) * u
    seq = pieces * draw(st.sampled_from([2, 3, 1]))
    sizes = dict(dp=dp, cp=cp) | (dict(ucp=ucp) if method == "hybrid" else {})
    return dict(method=method, sizes=sizes, layout=layout, causal=draw(st.booleans()),
                relayout=draw(st.booleans()), batch_size=dp * draw(st.sampled_from([1, 2])), seq_len=seq,
                n_heads=n_heads, n_kv_heads=kv, head_dim=draw(st.sampled_from([2, 4, 8])),
                seed=draw(st.integers(0, 100)), chunk=draw(st.sampled_from([1, 2, 3, 128])))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_context_attention_matches_reference_for_drawn_shapes(case):
    sizes = case.pop("sizes")
    devices = jax.devices()[:sizes["dp"] * sizes["cp"] * sizes.get("ucp", 1)]
    run = run_attention(case.pop("method"), mesh_lib.make_mesh(**sizes, devices=devices), AttentionCase(**case))
    assert_close(run.out, run.ref)
    assert run.forward == run.formula_forward
    assert run.backward == run.formula_backward
