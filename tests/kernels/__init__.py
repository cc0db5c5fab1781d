"""The fused kernels' tests: on CPU in `make test` (the Pallas kernels interpreted), on GPUs
with JAXPAR_TEST_PLATFORM=gpu, where a test needing more devices than there are skips."""

import jax
import pytest


def needs_devices(n: int):
    """Skip, saying why, where there are fewer than n devices (one GPU, say)."""
    have = len(jax.devices())
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, this run has {have} ({jax.default_backend()})")
