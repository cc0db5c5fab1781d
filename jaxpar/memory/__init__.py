"""The memory model (lecture sections 4.2-4.5): pure Python, no JAX.

    activations  bytes of one layer's activations (Korthikanti et al. 2022), term by term,
                 for no parallelism, TP, TP+SP, selective and full recompute, and modern
                 blocks; the first pipeline stage's whole model under each schedule
    states       parameter, gradient and optimizer-state bytes, mixed precision, ZeRO 0-3
    verify       the model against the compiled program (`jaxpar verify memory`)
"""
