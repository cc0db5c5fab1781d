"""Eight fake CPU devices for the whole test session, set before JAX starts its backends.

The tests run on the CPU backend even where an accelerator exists (they need 8 devices of
one kind); the GPU checks are `jaxpar tour` and the benchmarks (benchmarks/all_backends.sh).
"""

import jax
import pytest

from jaxpar import mesh

jax.config.update("jax_platforms", "cpu")

N_DEVICES = mesh.use_cpu_devices(8)  # XLA_FLAGS=--xla_force_host_platform_device_count wins


@pytest.fixture
def x64():
    """Run the test body with float64 enabled (jax_enable_x64), restoring it after."""
    with jax.enable_x64(True):
        yield
