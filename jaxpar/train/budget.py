"""Does the step fit its devices? Read from the compiled program before any buffer exists.

XLA's `memory_analysis()` of the compiled step gives what one device holds while the step
runs: its arguments (weights, optimizer state, the batch), outputs and temporaries, less
the donated buffers the outputs reuse. `fit` compares that with the device's memory and
refuses a step that cannot fit as a ConfigError, before `init` allocates a weight: a model
past the machine otherwise ends in XLA's RESOURCE_EXHAUSTED, a traceback from inside the
allocator, possibly after minutes of compiling and initialising.

A device's memory: its allocator's limit where it reports one (`memory_stats()`'s
bytes_limit: a GPU's pool); the host's physical memory shared by its CPU devices on a CPU
(fake devices share one host); unknown elsewhere (then nothing is checked).
"""

from __future__ import annotations

import os

import jax

from jaxpar.comms import human_bytes
from jaxpar.errors import ConfigError


def step_bytes(compiled) -> int:
    """Bytes one device holds while the compiled step runs: arguments + outputs +
    temporaries - the donated arguments the outputs alias."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def device_bytes(device) -> int | None:
    """The memory `device` may use: its allocator's limit, or on a CPU the host's physical
    memory over the host's CPU devices; None where neither is known."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        return host // max(1, len(jax.local_devices(backend="cpu")))
    return None


def check(trainer) -> None:
    """ConfigError if the trainer's compiled step needs more memory than one of its devices
    has (`step_bytes` against `device_bytes`), naming both and what would shrink it."""
    device = next(d for d in trainer.mesh.devices.flat if d.process_index == jax.process_index())   # one of ours
    limit = device_bytes(device)
    if limit is None:
        return
    need = step_bytes(trainer.compiled)
    if need > limit:
        raise ConfigError(
            f"the step needs {human_bytes(need)} per device (XLA's memory analysis of the compiled step: weights, "
            f"optimizer state, batch and temporaries), more than the {human_bytes(limit)} a "
            f"{device.platform} device has here; fix: a smaller model or batch, more pp or tp "
            "devices, zero=3, or recompute")
