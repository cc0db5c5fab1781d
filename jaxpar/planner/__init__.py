"""The 3D/4D parallelism planner (lecture section 7): pure Python, no JAX.

    catalog  models (GPT-3 175B, Llama 3 8B/70B/405B, DeepSeek-V3, a Mixtral-like MoE),
             accelerators (A100, H100, H800, H200, B200, TPU v5p) and the published
             parallel configurations of real trainings
    estimate what one configuration costs: memory per GPU, bubble, compute and
             communication time; with uneven stages, per-stage costs and the balanced split
    search   enumerate (tp, pp, dp, cp, ep, chunks, microbatch, recompute), reject the
             impossible with their reason, rank the rest by modelled step time
"""
