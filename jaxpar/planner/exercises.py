"""The lecture's exercises 1, 3, 7 and 8, answered from jaxpar's formulas (`jaxpar exercise N`)."""

from __future__ import annotations

import math

from jaxpar import errors
from jaxpar.errors import ConfigError
from jaxpar.expert import formulas as expert_formulas
from jaxpar.pipeline import formulas as pipeline_formulas
from jaxpar.planner import catalog
from jaxpar.planner.estimate import Candidate, Cluster, tp_wire_bytes
from jaxpar.planner.search import evaluate


def exercise_1(p: int = 8, max_bubble: float = 0.10, microbatch_size: int = 4, seq_len: int = 4096) -> dict:
    """The fewest microbatches with a 1F1B bubble of at most max_bubble, and the tokens
    of one pipeline's batch: m >= 63 and about 1.03 M tokens for p = 8, 10%. From the
    bubble (p - 1)/(m + p - 1) <= max_bubble: m >= (p - 1)(1 - max_bubble)/max_bubble."""
    errors.whole("p", p)
    errors.whole("microbatch_size", microbatch_size)
    errors.whole("seq_len", seq_len)
    if not isinstance(max_bubble, (int, float)) or isinstance(max_bubble, bool) or not 0 < max_bubble < 1:
        raise ConfigError(f"max_bubble={max_bubble!r}: a fraction of the step in (0, 1), e.g. 0.1 (with p > 1 no "
                          "number of microbatches reaches a bubble of 0)")
    m = max(1, math.ceil((p - 1) * (1 - max_bubble) / max_bubble - 1e-9))
    while pipeline_formulas.bubble("1f1b", p, m) > max_bubble + 1e-12:   # the float rounding of the ceil
        m += 1
    return {"microbatches": m, "bubble": pipeline_formulas.bubble("1f1b", p, m),
            "tokens": m * microbatch_size * seq_len}


def exercise_3(b: int = 1, s: int = 8192, h: int = 8192, t: int = 8) -> dict:
    """One layer under TP t in bf16: bytes each GPU sends per step (forward + backward),
    NVLink and InfiniBand times, and the layer's compute per GPU on an H100 at 50% MFU.
    The layer has 64 heads: t divides them, h is 64 heads' width."""
    for name, value in (("b", b), ("s", s), ("h", h), ("t", t)):
        errors.whole(name, value)
    errors.divisible("n_heads", 64, "t", t, why="tensor parallelism splits whole heads",
                     fix="t = 1, 2, 4, 8, 16, 32 or 64")
    errors.divisible("h", h, "its 64 heads", 64, why="each head is h/64 wide", fix="a multiple of 64, e.g. 8192")
    h100 = catalog.accelerator("h100")
    model = catalog.Model(name="exercise-3", n_layers=1, d_model=h, n_heads=64, n_kv_heads=64, d_ff=4 * h, vocab=1,
                          params=12 * h * h, mlp="gelu")
    sent = tp_wire_bytes(model, tokens=b * s, tp=t)
    compute = 24 * b * s * h * h * 3 / t / (h100.flops * 0.5)
    return {"bytes": sent, "nvlink_s": sent / h100.intra, "compute_s": compute, "share": sent / h100.intra / compute,
            "infiniband_s": sent / h100.inter}


def exercise_7() -> dict:
    """DeepSeek-V3's MoE layer, 4096 tokens per GPU, k = 8, D = 7168, EP = 64, bf16."""
    one = expert_formulas.dispatch_bytes(tokens=4096, top_k=8, d_model=7168, ep=64, dtype="float16")
    return {"dispatch": one, "forward": 2 * one, "forward_and_backward": 4 * one}


def exercise_8(tokens: float = 32 * 2**20) -> dict:
    """Llama 3 405B on 16384 H100 at (tp, pp, dp) = (8, 16, 128) with a 32 M-token batch:
    m = 32 microbatches per pipeline, bubble 15/47."""
    est = evaluate(catalog.model("llama3-405b"), Cluster(gpu=catalog.accelerator("h100"), gpus=16384),
                   Candidate(tp=8, pp=16, dp=128, recompute="full"), tokens=tokens, seq_len=8192)
    return {"microbatches": est.microbatches, "bubble": est.bubble}
