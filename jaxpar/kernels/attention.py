"""Attention of a whole sequence through a fused flash kernel where the backend has one.

    choose(implementation, *, dtype, head_dim, platform) -> "cudnn" | "xla"
    attention(q, k, v, *, causal, implementation)        q [B, T, N, H], k, v [B, T, K, H]

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

"auto" picks cuDNN where it applies: a GPU, 16-bit inputs (cuDNN's flash attention
takes bfloat16 and float16, not float32), head_dim a multiple of 8 up to 256 (128
before Hopper); else the XLA path. Asking for "cudnn" where it does not apply is a
ConfigError naming what is off, before anything compiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar import errors, reference
from jaxpar.errors import ConfigError

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
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


def choose(implementation: str = "auto", *, dtype, head_dim: int, platform: str | None = None) -> str:
    """The implementation that runs: "cudnn" or "xla". implementation="auto" takes cuDNN
    where it applies (`cudnn_refusal` is None); "cudnn" where it does not applies is a
    ConfigError saying why; "xla" always runs."""
    errors.one_of("attention_kernel", implementation, IMPLEMENTATIONS)
    if implementation == "xla":
        return "xla"
    refusal = cudnn_refusal(dtype=dtype, head_dim=head_dim, platform=platform)
    if implementation == "cudnn" and refusal:
        raise ConfigError(f"attention_kernel='cudnn' cannot run here: {refusal}. Fix: 'auto' (cuDNN where it "
                          "applies, XLA elsewhere) or 'xla'")
    return "xla" if refusal else "cudnn"


def describe(implementation: str) -> str:
    """One line for a summary: which attention ran and what it keeps."""
    return {"cudnn": "cudnn flash attention (no T x T scores)",
            "xla": "xla attention (T x T scores)"}[implementation]


def attention(q, k, v, *, causal: bool = True, implementation: str = "auto"):
    """Softmax attention of q [B, T, N, H] over k, v [B, T, K, H] (K divides N), 1/sqrt(H)
    scaled, causal or not: [B, T, N, H] in q's dtype. implementation: see `choose`."""
    impl = choose(implementation, dtype=q.dtype, head_dim=int(q.shape[-1]))
    if impl == "xla":
        return reference.attention(q, k, v, causal=causal)
    try:        # jax checks the shapes cuDNN takes as it traces: a refusal comes before compiling
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    except (NotImplementedError, ValueError, TypeError) as e:
        raise ConfigError(f"cuDNN's flash attention does not take q {tuple(q.shape)}, k {tuple(k.shape)} "
                          f"{jnp.dtype(q.dtype).name}: {str(e).splitlines()[0]}. Fix: attention_kernel='xla'") from e
