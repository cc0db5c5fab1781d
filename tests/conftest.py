"""Eight fake CPU devices for the whole test session, set before JAX starts its backends."""

import pytest

from jaxpar import mesh

N_DEVICES = mesh.use_cpu_devices(8)  # XLA_FLAGS=--xla_force_host_platform_device_count wins

import jax  # noqa: E402


@pytest.fixture
def x64():
    """Run the test body with float64 enabled (jax_enable_x64), restoring it after."""
    with jax.enable_x64(True):
        yield
