"""Attention through a fused flash kernel where the backend has one: of a whole sequence,
and of one block of a ring.

    choose(implementation, *, dtype, head_dim, platform) -> "cudnn" | "pallas" | "xla"
    attention(q, k, v, *, causal, implementation)        q [B, T, N, H], k, v [B, S, K, H]
    choose_block(implementation, *, dtype, tq, tk, head_dim, platform) -> "pallas" | "xla"

"cudnn" is cuDNN's flash attention (`jax.nn.dot_product_attention(implementation=
"cudnn")`, FlashAttention-2's algorithm): the scores are computed a tile at a time in
on-chip memory and never written out, and the backward keeps only q, k, v, the output
and the softmax statistics (one float32 per query and head), recomputing the scores
tile by tile. The activation memory model's `flash=True` term (memory.activations).
Grouped-query heads are native (K/V are not repeated).

"xla" is `reference.attention`, the plain einsum attention: it forms the [B, N, T, T]
scores and the backward keeps the softmax. It runs everywhere, in every dtype; the
CPU has no fused kernel, so the tests and the tour on CPU compute exactly what they
did before this module existed.

"pallas" is jaxpar's own flash kernel (`kernels.flash`, Pallas: Triton on a GPU, the
interpreter elsewhere, which is how the CPU tests run it), the one a ring's block needs:
it returns the lse in float32 and its backward takes the merged lse and delta of the
whole attention. For a whole sequence it is the same kernel over one block, with its
own lse. It takes power-of-two tiles and head_dim (`flash.fits`), float32 or 16-bit.

"auto" picks cuDNN where it applies: a GPU, 16-bit inputs (cuDNN's flash attention
takes bfloat16 and float16, not float32), head_dim a multiple of 8 up to 256 (128
before Hopper); else the XLA path. For a ring's block (`choose_block`) "auto" is to pick
the Pallas kernel on a GPU for 16-bit inputs it fits once its GPU tests have passed on a
GPU (`PALLAS_AUTO`, below); "pallas" asks for it now; "cudnn" is refused (cuDNN's public
entry returns the lse in bf16 and cannot take the merged one). Asking for a kernel where
it does not apply is a ConfigError naming what is off, before anything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import functools

from jaxpar import errors, reference
from jaxpar.errors import ConfigError
from jaxpar.kernels import flash

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
# Whether "auto" takes the Pallas kernel for a ring's blocks on a GPU. It compiled and ran
# on an H200 (3.2 ms against the XLA blocks' 24.2 ms at T = 8192, benchmarks/attention_gpu.py)
# and matches the blockwise ops and the reference in Pallas' interpreter, but its own tests
# (tests/kernels/test_flash.py, JAXPAR_TEST_PLATFORM=gpu) have not run on a GPU yet: until
# they pass there, "auto" keeps the XLA blocks, the proven path, and "pallas" asks for it.
PALLAS_AUTO = False
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256     # Hopper and later (128 before): jax's check_is_flash_attention


def _platform(platform: str | None) -> str:
    return jax.default_backend() if platform is None else platform


def cudnn_refusal(*, dtype, head_dim: int, platform: str | None = None) -> str | None:
    """Why cuDNN's flash attention cannot run these inputs, or None when it can."""
    platform = _platform(platform)
    if platform not in ("gpu", "cuda"):
        return f"cuDNN runs on NVIDIA GPUs; this backend is {platform!r}"
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"dtype {name}: cuDNN's flash attention takes {' or '.join(CUDNN_DTYPES)} (e.g. --dtype bfloat16)"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return f"head_dim={head_dim}: cuDNN's flash attention needs a multiple of 8 up to {CUDNN_MAX_HEAD_DIM}"
    return None


def pallas_refusal(*, dtype, tq: int, tk: int, head_dim: int) -> str | None:
    """Why the Pallas block kernel cannot run these inputs, or None when it can."""
    name = jnp.dtype(dtype).name
    if name not in ("float32",) + CUDNN_DTYPES:
        return f"dtype {name}: the Pallas kernel computes in float32, from float32 or 16-bit inputs"
    return flash.fits(tq=tq, tk=tk, head_dim=head_dim)


def _refuse(implementation: str, refusal: str):
    raise ConfigError(f"attention_kernel={implementation!r} cannot run here: {refusal}. Fix: 'auto' (a kernel "
                      "where one applies, XLA elsewhere) or 'xla'")


def choose(implementation: str = "auto", *, dtype, head_dim: int, platform: str | None = None,
           seq_len: int | None = None) -> str:
    """The implementation that runs: "cudnn", "pallas" or "xla". implementation="auto"
    takes cuDNN where it applies (`cudnn_refusal` is None); a kernel asked for where it
    does not apply is a ConfigError saying why (for "pallas", `seq_len` is checked when
    given); "xla" always runs."""
    errors.one_of("attention_kernel", implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        return "xla"
    if implementation == "pallas":
        refusal = pallas_refusal(dtype=dtype, tq=seq_len or 16, tk=seq_len or 16, head_dim=head_dim)
        if refusal:
            _refuse(implementation, refusal)
        return "pallas"
    refusal = cudnn_refusal(dtype=dtype, head_dim=head_dim, platform=platform)
    if implementation == "cudnn" and refusal:
        _refuse(implementation, refusal)
    return "xla" if refusal else "cudnn"


def choose_block(implementation: str = "auto", *, dtype, tq: int, tk: int, head_dim: int,
                 platform: str | None = None) -> str:
    """What computes one block of a ring (tq queries over tk keys): "pallas" or "xla".
    "auto" takes the Pallas kernel on a GPU for 16-bit inputs it fits (where PALLAS_AUTO
    says its GPU tests have passed; else "xla"); "cudnn" is refused
    (its public entry returns the lse in the input dtype and its backward recomputes from
    its own lse, so it cannot merge); "pallas" where it does not fit is a ConfigError."""
    errors.one_of("attention_kernel", implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        return "xla"
    if implementation == "cudnn":
        _refuse(implementation, "a ring's blocks need their lse in float32 and a backward from the merged lse; "
                "cuDNN's public entry returns it in the input dtype and recomputes from its own (use 'pallas')")
    refusal = pallas_refusal(dtype=dtype, tq=tq, tk=tk, head_dim=head_dim)
    if implementation == "pallas":
        if refusal:
            _refuse(implementation, refusal)
        return "pallas"
    gpu = _platform(platform) in ("gpu", "cuda")
    fused = PALLAS_AUTO and gpu and refusal is None and jnp.dtype(dtype).name in CUDNN_DTYPES
    return "pallas" if fused else "xla"



def describe(implementation: str) -> str:
    """One line for a summary: which attention ran and what it keeps."""
    return {"cudnn": "cudnn flash attention (no T x T scores)",
            "pallas": "pallas flash attention (no T x T scores)",
            "xla": "xla attention (T x T scores; a ring's blocks key chunk by key chunk)"}[implementation]


def attention(q, k, v, *, causal: bool = True, implementation: str = "auto"):
    """Softmax attention of q [B, T, N, H] over k, v [B, S, K, H] (K divides N), 1/sqrt(H)
    scaled, causal or not: [B, T, N, H] in the inputs' promoted dtype (q's when they agree).
    implementation: see `choose`.

    Causal with S != T, the queries are the last T positions (reference.attention's mask,
    aligned to the bottom right); cuDNN's and the Pallas kernel's causal masks align to the
    top left, so there "auto" runs XLA and a kernel asked for by name is a ConfigError."""
    _, T, _, H, S, _ = reference.attention_shapes(q, k, v, causal=causal)
    dtype = jnp.result_type(q, k, v)          # mixed inputs: the kernels see what XLA's einsums would
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    impl = choose(implementation, dtype=dtype, head_dim=H, seq_len=T)
    if impl != "xla" and causal and S != T:
        if implementation != "auto":
            _refuse(implementation, f"causal attention of T={T} queries over S={S} keys: the kernel's mask "
                    "aligns the queries with the first keys, the reference's with the last")
        impl = "xla"
    if impl == "pallas" and S != T:
        refusal = pallas_refusal(dtype=dtype, tq=T, tk=S, head_dim=H)
        if refusal:
            _refuse(implementation, refusal)
    if impl == "xla":
        return reference.attention(q, k, v, causal=causal)
    if impl == "pallas":
        B, T, N, H = q.shape
        K = k.shape[2]
        grouped = q.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)       # [B, K, G, T, H]
        o = _pallas(grouped, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal)
        return o.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
    try:        # jax checks the shapes cuDNN takes as it traces: a refusal comes before compiling
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ConfigError(f"cuDNN's flash attention does not take q {tuple(q.shape)}, k {tuple(k.shape)} "
                          f"{jnp.dtype(q.dtype).name}: {str(e).splitlines()[0]}. Fix: attention_kernel='xla'") from e


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas(q, k, v, causal):
    """The Pallas kernel over the whole sequence as one block: [B, K, G, T, H] in q's dtype."""
    return _pallas_fwd(q, k, v, causal)[0]


def _pallas_fwd(q, k, v, causal):
    scale = q.shape[-1] ** -0.5
    o, lse = flash.block_forward(q, k, v, scale=scale, causal=causal)
    o = o.astype(q.dtype)
    return o, (q, k, v, o, lse)


def _pallas_bwd(causal, res, do):
    q, k, v, o, lse = res
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    dq, dk, dv = flash.block_backward(q, k, v, do, lse, delta, scale=q.shape[-1] ** -0.5, causal=causal)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)
