"""The Triton modules jaxpar's Pallas kernels become on an NVIDIA GPU, read on any machine.

    modules(fn, *args) -> [Module(name, asm, num_warps, num_stages)]

Cross-platform lowering (`jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`) makes
Pallas emit each kernel's Triton module without a GPU: nothing runs and nothing compiles.
Pallas does not verify what it emits; XLA:GPU does, before it compiles a module, so a
module MLIR's verifier rejects is a kernel that cannot compile on a GPU. `modules` runs
that verifier on each one and raises with the kernel's name and MLIR's message.

The text (`Module.asm`) is what `benchmarks/triton_sm90.py` compiles
for Hopper with the `triton` package, where it is installed, to read each kernel's shared
memory, registers and spills without a GPU.

This reads one private hook of JAX (`jax._src.pallas.triton`'s call that builds the Triton
module); where a JAX release moves it, `modules` raises saying so rather than checking
nothing.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax

from jaxpar.errors import ConfigError
from jaxpar.kernels import flash

try:
    from jax._src.pallas.triton import pallas_call_registration as _registration
except ImportError:         # a JAX without Pallas' Triton backend: `modules` says so
    _registration = None

TRITON_CALL = "__gpu$xla.gpu.triton"         # the custom call a Pallas kernel lowers to on NVIDIA GPUs
_LAUNCH = re.compile(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


class Module(NamedTuple):
    """One Pallas kernel as Triton receives it: its name, its module as text, and the
    launch Pallas asks for (warps per program, stages of its pipelined loads)."""
    name: str
    asm: str
    num_warps: int
    num_stages: int


def _hook():
    lowering = getattr(_registration, "lowering", None)
    if lowering is None or not hasattr(lowering, "lower_jaxpr_to_triton_module"):
        raise ConfigError(f"jax {jax.__version__} has no jax._src.pallas.triton lowering hook to read Triton "
                          "modules from. Fix: a jax whose Pallas lowers to Triton through it (0.10 and 0.11 do)")
    return lowering


def modules(fn, *args) -> list[Module]:
    """Each Triton module `fn(*args)` lowers to for CUDA, in lowering order, each passed
    by MLIR's verifier (an AssertionError lists those that fail). `fn` may be jitted
    already (its own options are kept); `args` may be ShapeDtypeStructs. While it lowers,
    the kernels take the path they take on a GPU (`flash.interpret_here()` is False), so a
    kernel whose `interpret` is left at its default lowers for Triton."""
    lowering = _hook()
    build = lowering.lower_jaxpr_to_triton_module
    found, errors = [], []

    def verified(*a, **k):
        result = build(*a, **k)
        op = result.module.operation
        name = op.attributes["sym_name"].value
        try:
            op.verify()
        except Exception as e:          # MLIR's verifier raises its own error type
            errors.append(f"{name}: {str(e)[:2000]}")
        found.append((name, op.get_asm(enable_debug_info=False)))
        return result

    lowering.lower_jaxpr_to_triton_module = verified
    here, flash.interpret_here = flash.interpret_here, lambda: False     # the kernels as a GPU runs them
    try:
        jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
        text = jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = build
        flash.interpret_here = here
    assert not errors, "Triton modules MLIR's verifier rejects:\n" + "\n".join(errors)
    launch = {}
    for name, stages, warps in _LAUNCH.findall(text):
        if launch.setdefault(name, (int(warps), int(stages))) != (int(warps), int(stages)):
            raise ConfigError(f"kernel {name} is launched with two settings; name each pallas_call apart")
    missing = sorted({name for name, _ in found} - set(launch))
    if missing:
        raise ConfigError(f"no launch settings found for {missing} in the lowered program: this jax writes "
                          "Pallas' Triton calls in another form. Fix: update triton_ir._LAUNCH")
    return [Module(name, asm, *launch[name]) for name, asm in found]
