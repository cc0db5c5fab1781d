"""Fused GPU kernels behind one entry point each, the plain XLA path elsewhere.

    attention   attention.attention: flash attention (cuDNN) for a layer's whole sequence; `choose` says
                which implementation runs for a dtype, head size and platform
    flash       one block of attention as a Pallas kernel (a ring's blocks: attention.choose_block)
    grouped     the MoE's grouped matmuls as a Pallas kernel (grouped.choose; expert.grouped runs it)
    triton_ir   the Triton modules the Pallas kernels lower to for CUDA, read and verified on any machine

Below the techniques: the layers and the trainer call these; the reference never does
(the oracle shares no code with what it checks).
"""

from jaxpar.kernels import attention

__all__ = ["attention"]
