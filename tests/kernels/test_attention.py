"""kernels.attention: the implementation chosen for each backend, dtype and head size,
and its output and gradients against reference.attention.

On CPU (make test) the entry point runs the XLA path and the choice is checked for every
platform by name; on a GPU (JAXPAR_TEST_PLATFORM=gpu pytest tests/kernels) cuDNN's flash
attention runs and is held to the bfloat16 rule against the float32 reference, and its
compiled backward to the memory model's flash term (no T x T buffer)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.kernels import attention as kernel
from jaxpar.memory import activations
from jaxpar.testing import assert_close, precision_policy, tolerance

GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not GPU, reason="cuDNN's flash attention needs an NVIDIA GPU; this run's backend "
                                              f"is {jax.default_backend()} (JAXPAR_TEST_PLATFORM=gpu on a GPU)")


@pytest.mark.parametrize("platform, dtype, head_dim, expected", [
    ("cpu", jnp.bfloat16, 64, "xla"), ("gpu", jnp.bfloat16, 64, "cudnn"), ("gpu", jnp.float16, 128, "cudnn"),
    ("gpu", jnp.float32, 64, "xla"), ("gpu", jnp.bfloat16, 12, "xla"), ("gpu", jnp.bfloat16, 264, "xla"),
    ("tpu", jnp.bfloat16, 128, "xla")])
def test_auto_takes_cudnn_only_where_it_applies(platform, dtype, head_dim, expected):
    assert kernel.choose("auto", dtype=dtype, head_dim=head_dim, platform=platform) == expected
    assert kernel.choose("xla", dtype=dtype, head_dim=head_dim, platform=platform) == "xla"


@pytest.mark.parametrize("platform, dtype, head_dim, says", [
    ("cpu", jnp.bfloat16, 64, "NVIDIA GPUs"), ("gpu", jnp.float32, 64, "bfloat16 or float16"),
    ("gpu", jnp.bfloat16, 12, "multiple of 8")])
def test_cudnn_where_it_cannot_run_is_refused_with_the_reason(platform, dtype, head_dim, says):
    with pytest.raises(ConfigError, match=says):
        kernel.choose("cudnn", dtype=dtype, head_dim=head_dim, platform=platform)


def test_an_unknown_implementation_is_refused():
    with pytest.raises(ConfigError, match="'auto', 'xla', 'cudnn'"):
        kernel.choose("flash", dtype=jnp.bfloat16, head_dim=64, platform="gpu")


def _qkv(key, *, B=2, T=128, N=8, K=2, H=64, dtype=jnp.float32):
    kq, kk, kv, kd = jax.random.split(key, 4)
    q = jax.random.normal(kq, (B, T, N, H), jnp.float32)
    k = jax.random.normal(kk, (B, T, K, H), jnp.float32)
    v = jax.random.normal(kv, (B, T, K, H), jnp.float32)
    do = jax.random.normal(kd, (B, T, N, H), jnp.float32)
    return tuple(a.astype(dtype) for a in (q, k, v)), do


def _out_and_grads(fn, q, k, v, do):
    o, vjp = jax.vjp(fn, q, k, v)
    return (o, *vjp(do.astype(o.dtype)))


@pytest.mark.parametrize("causal", [True, False])
def test_the_entry_point_equals_the_reference_on_this_backend(causal):
    """float32 through the entry point ("auto": the XLA path on CPU and for float32 on a
    GPU), against reference.attention under the precision policy (outputs and dq, dk, dv),
    and against an implementation that shares no code with it, jax.nn's XLA attention."""
    (q, k, v), do = _qkv(jax.random.key(0))
    with precision_policy():
        got = _out_and_grads(functools.partial(kernel.attention, causal=causal), q, k, v, do)
        want = _out_and_grads(functools.partial(reference.attention, causal=causal), q, k, v, do)
        other = _out_and_grads(functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                                                 implementation="xla"), q, k, v, do)
    for g, w, o in zip(got, want, other):
        assert_close(g, w)
        assert_close(g, o)


@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N, K, H", [(8, 2, 64), (4, 4, 128), (8, 1, 32)])
def test_cudnn_equals_the_float32_reference_in_bfloat16(causal, N, K, H):
    """cuDNN in bf16 against reference.attention in float32 on the same (bf16-rounded)
    inputs: outputs and every input gradient within the bf16 rule, relative to each
    tensor's scale."""
    (q, k, v), do = _qkv(jax.random.key(N * H + causal), T=256, N=N, K=K, H=H, dtype=jnp.bfloat16)
    got = _out_and_grads(functools.partial(kernel.attention, causal=causal, implementation="cudnn"), q, k, v, do)
    up = [a.astype(jnp.float32) for a in (q, k, v)]
    with precision_policy():
        want = _out_and_grads(functools.partial(reference.attention, causal=causal), *up, do)
    rtol, _ = tolerance(jnp.bfloat16)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        g = np.asarray(g, np.float32)
        w = np.asarray(w)
        rel = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert rel < rtol, f"{name}: |cudnn - reference| / |reference| = {rel:.2e} > {rtol}"


@needs_gpu
def test_cudnn_keeps_no_score_matrix():
    """The compiled forward + backward of cuDNN's attention at T = 4096 needs far less
    than one [B, N, T, T] bf16 score matrix (what the XLA path keeps), and its residuals
    equal the memory model's flash term: q, k, v, the output and a float32 statistic per
    query and head."""
    B, T, N, K, H = 1, 4096, 8, 2, 64
    (q, k, v), do = _qkv(jax.random.key(1), B=B, T=T, N=N, K=K, H=H, dtype=jnp.bfloat16)
    fn = functools.partial(kernel.attention, causal=True, implementation="cudnn")
    compiled = jax.jit(lambda q, k, v, do: _out_and_grads(fn, q, k, v, do)).lower(q, k, v, do).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    scores = B * N * T * T * 2
    assert temp < scores / 8, f"temp {temp} bytes: a T x T buffer ({scores} bytes) is being held"
    _, residuals = jax.vjp(fn, q, k, v)
    kept = sum(a.nbytes for a in jax.tree.leaves(residuals) if hasattr(a, "nbytes"))
    block = activations.Block(d_model=N * H, n_heads=N, n_kv_heads=K, flash=True, act_bytes=q.dtype.itemsize)
    terms = {t.name: t.bytes for t in activations.layer_terms(block, seq_len=T, batch_size=B)}
    # the flash model's attention terms: Q and K, V, the output (the projection's input), the lse
    model = sum(terms[n] for n in ("Q and K", "V", "output projection input", "softmax statistics (lse)"))
    assert kept == model, f"cuDNN keeps {kept} bytes for its backward, the flash model {model}"


def test_a_shape_cudnn_refuses_as_it_traces_is_a_config_error(monkeypatch):
    """jax checks what cuDNN takes while tracing (NotImplementedError: head dim, sequence
    lengths): that reaches the user as one ConfigError naming the shapes and the fix."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("The head dim must be <= 256 and a multiple of 8, but got 12.")
    monkeypatch.setattr(kernel, "choose", lambda *a, **k: "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", refuse)
    (q, k, v), _ = _qkv(jax.random.key(0), T=16, H=12, dtype=jnp.bfloat16)
    with pytest.raises(ConfigError, match=r"q \(2, 16, 8, 12\).*multiple of 8.*attention_kernel='xla'"):
        kernel.attention(q, k, v, implementation="cudnn")


_Z = lambda *shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
BAD = [  # (q, k, v), what the ConfigError says
    ((_Z(2, 16, 32), _Z(2, 16, 2, 16), _Z(2, 16, 2, 16)), "expected rank 4"),
    ((_Z(1, 16, 3, 16), _Z(1, 16, 2, 16), _Z(1, 16, 2, 16)), "multiple of KV heads"),
    ((_Z(1, 16, 4, 16), _Z(1, 16, 2, 8), _Z(1, 16, 2, 8)), "with q's batch and head_dim"),
    ((_Z(1, 16, 4, 16), _Z(1, 16, 2, 16), _Z(1, 16, 2, 8)), "one shape"),
    ((_Z(2, 16, 4, 16), _Z(1, 16, 2, 16), _Z(1, 16, 2, 16)), "one shape"),
    ((_Z(1, 16, 4, 16, dtype=jnp.int32),) * 3, "must be floating point"),
    ((_Z(0, 16, 4, 16), _Z(0, 16, 2, 16), _Z(0, 16, 2, 16)), "empty axis"),
    ((_Z(1, 0, 4, 16), _Z(1, 0, 2, 16), _Z(1, 0, 2, 16)), "empty axis"),
    ((_Z(1, 32, 4, 16), _Z(1, 16, 2, 16), _Z(1, 16, 2, 16)), "the first 16 would see no key"),
    (([[1.0]], _Z(1, 16, 2, 16), _Z(1, 16, 2, 16)), "not an array"),
]


@pytest.mark.parametrize("implementation", ["auto", "xla", "pallas", "cudnn"])
@pytest.mark.parametrize("qkv, says", BAD, ids=lambda x: x if isinstance(x, str) else None)
def test_inputs_no_attention_takes_are_refused_before_any_kernel(qkv, says, implementation):
    """Every implementation checks q, k, v as reference.attention does, first: a wrong rank,
    dtype, empty axis, mismatched shape, heads that do not group, or causal queries with no
    key to see is one ConfigError, never an error from inside a kernel."""
    with pytest.raises(ConfigError, match=says):
        jax.eval_shape(functools.partial(kernel.attention, causal=True, implementation=implementation), *qkv)


def test_causal_over_more_keys_than_queries_runs_xla_where_a_kernel_would_misalign(monkeypatch):
    """Causal attention of T queries over S > T keys (the queries the last T positions):
    cuDNN's and the kernel's masks align to the top left, so "auto" runs XLA there, equal
    to the reference exactly, and a kernel asked for by name is refused; over S = T, and
    not causal over S != T, the Pallas kernel equals the reference."""
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (1, 16, 4, 16))
    k, v = (jax.random.normal(key, (1, 32, 2, 16)) for key in ks[1:])
    with pytest.raises(ConfigError, match="T=16 queries over S=32 keys"):
        kernel.attention(q, k, v, causal=True, implementation="pallas")
    monkeypatch.setattr(kernel, "choose", lambda *a, **kw: "pallas")      # as "auto" would on a GPU
    np.testing.assert_array_equal(kernel.attention(q, k, v, causal=True), reference.attention(q, k, v))
    with precision_policy():
        assert_close(kernel.attention(q, k, v, causal=False), reference.attention(q, k, v, causal=False))
        assert_close(kernel.attention(q, k[:, :16], v[:, :16]), reference.attention(q, k[:, :16], v[:, :16]))


def test_mixed_dtypes_reach_a_kernel_promoted_as_xla_promotes_them():
    """q in bfloat16 with k, v in float32: the Pallas kernel computes in and returns the
    promoted dtype, as the reference's einsums do."""
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (1, 16, 4, 16)).astype(jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, 16, 2, 16)) for key in ks[1:])
    got, want = kernel.attention(q, k, v, implementation="pallas"), reference.attention(q, k, v)
    assert got.dtype == want.dtype == jnp.float32
    with precision_policy():
        assert_close(got, want)
