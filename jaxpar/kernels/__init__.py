"""Fused GPU kernels behind one entry point each, the plain XLA path elsewhere.

    attention   attention.attention: flash attention (cuDNN) for a layer's whole sequence; `choose` says
                which implementation runs for a dtype, head size and platform

Below the techniques: the layers and the trainer call these; the reference never does
(the oracle shares no code with what it checks).
"""

from jaxpar.kernels import attention

__all__ = ["attention"]
