"""The fused kernels' tests: on CPU in `make test` (the Pallas kernels interpreted), on GPUs
with JAXPAR_TEST_PLATFORM=gpu, where a test needing more devices than there are skips."""

import jax
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration


def needs_devices(n: int):
    """Skip, saying why, where there are fewer than n devices (one GPU, say)."""
    have = len(jax.devices())
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, this run has {have} ({jax.default_backend()})")


def triton_modules(fn, *args) -> list[str]:
    """Lower `fn` for CUDA from this machine (cross-platform lowering: Pallas emits its
    Triton kernels, nothing runs) and run MLIR's verifier on each kernel's Triton module,
    as XLA:GPU does before it compiles one. Pallas does not verify what it emits: a
    module that fails here fails to compile on a GPU. Returns the modules' names."""
    names, errors = [], []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def verified(*a, **k):
        result = lower(*a, **k)
        op = result.module.operation
        names.append(op.attributes["sym_name"].value)
        try:
            op.verify()
        except Exception as e:          # MLIR's verifier raises its own error type
            errors.append(f"{names[-1]}: {str(e)[:2000]}")
        return result
    registration.lowering.lower_jaxpr_to_triton_module = verified
    try:
        jitted = fn if hasattr(fn, "trace") else jax.jit(fn)       # the trainer's step is jitted with its options
        jitted.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    assert not errors, "\n".join(errors)
    return names
