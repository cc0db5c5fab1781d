"""The device options of `jaxpar tour` and `jaxpar verify`, and starting JAX with them."""

from __future__ import annotations

import argparse

from jaxpar.errors import ConfigError


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=8,
                   help="fake CPU devices to start when running on CPU (default 8; "
                        "XLA_FLAGS=--xla_force_host_platform_device_count wins)")
    p.add_argument("--platform", choices=["cpu", "default"], default="default",
                   help="'cpu' forces the CPU backend even where an accelerator exists")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def start(args) -> list:
    """Start JAX with the options asked for; return its devices."""
    import jax

    from jaxpar import mesh

    if not 1 <= args.devices <= mesh.MAX_DEVICES:
        raise ConfigError(f"--devices {args.devices}: give 1 to {mesh.MAX_DEVICES} devices, e.g. --devices 8")
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    mesh.use_cpu_devices(args.devices)
    return jax.devices()
