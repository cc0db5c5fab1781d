"""The fused kernels' tests: on CPU in `make test` (the Pallas kernels interpreted), on GPUs
with JAXPAR_TEST_PLATFORM=gpu, where a test needing more devices than there are skips."""

import jax
import pytest

from jaxpar.kernels import triton_ir


def needs_devices(n: int):
    """Skip, saying why, where there are fewer than n devices (one GPU, say)."""
    have = len(jax.devices())
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, this run has {have} ({jax.default_backend()})")


def triton_modules(fn, *args) -> list[str]:
    """The names of the Triton modules `fn(*args)` lowers to for CUDA from this machine,
    each passed by MLIR's verifier as XLA:GPU requires before compiling it
    (kernels.triton_ir.modules: a module that fails it fails the test)."""
    return [module.name for module in triton_ir.modules(fn, *args)]
