"""Devices and meshes: fake CPU devices, named mesh axes, multi-host start-up.

One axis name per parallelism, used everywhere (pspecs, docs, CLI):

    DP  data parallel        PP  pipeline stages      CP  context (sequence) parallel
    EP  expert parallel      TP  tensor parallel (sequence parallelism runs on TP too)
    UCP the second context axis of 2-D context parallelism: Ulysses all-to-all over
        UCP inside, the ring over CP outside (context.hybrid_attention)

`make_mesh` lays the axes out in the order dp, pp, cp, ucp, ep, tp, so tp is innermost:
tensor-parallel peers are neighbouring devices (one NVLink island on a GPU node), as
Megatron and Llama 3 order them. Axes are *Auto*-typed (jax.make_mesh now defaults to
Explicit), so `shard_map` and `jit` accept unsharded inputs and reshard them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxpar.errors import ConfigError, is_whole, whole

DP, PP, CP, UCP, EP, TP = "dp", "pp", "cp", "ucp", "ep", "tp"
AXIS_ORDER: tuple[str, ...] = (DP, PP, CP, UCP, EP, TP)

MAX_DEVICES = 1 << 16  # more than any machine or job has: a larger count is a typo
_XLA_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def _backends_started() -> bool:
    """Whether JAX has started its backends (at the first jax.devices() or computation),
    told without starting them: `jax_num_cpu_devices` may change only before, and its
    validator refuses a new value after. So a change to it, undone at once, is the test;
    it uses the public config alone."""
    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


def use_cpu_devices(n: int, *, threads_per_device: int = 8) -> int:
    """Ask for `n` fake CPU devices. Must run before JAX starts its backends.

    threads_per_device sizes XLA:CPU's thread pool (`_enough_threads`): 8 leaves room for
    a pipeline's concurrent collectives; a program without a pipeline (pp = 1) needs 2,
    and a larger pool only costs it time (idle threads contending for the cores).

    A count already set through XLA_FLAGS (--xla_force_host_platform_device_count=K)
    is respected: it wins over `n`, and K is returned. Calling this after JAX has
    started raises a ConfigError that says how to fix it, unless the running CPU
    backend already has the count asked for.

    Only the CPU backend is affected: on a GPU/TPU machine `jax.devices()` still
    returns the accelerators.
    """
    n = whole("n", n, maximum=MAX_DEVICES,
              fix="n must be >= 1, the number of fake CPU devices, e.g. use_cpu_devices(8)")
    flags = _XLA_COUNT.search(os.environ.get("XLA_FLAGS", ""))
    wanted = int(flags.group(1)) if flags else n
    if _backends_started():
        have = len(jax.devices("cpu"))
        if have == wanted:
            return have
        raise ConfigError(
            f"use_cpu_devices({n}) was called after JAX started its backends with {have} CPU "
            f"device(s); the count can no longer change. Fix: call jaxpar.mesh.use_cpu_devices({n}) "
            "before anything touches jax.devices() or runs a computation (first thing in your "
            f"script), or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before Python starts."
        )
    if not flags:
        jax.config.update("jax_num_cpu_devices", n)
    _enough_threads(wanted, whole("threads_per_device", threads_per_device, maximum=64))
    return wanted


def _enough_threads(devices: int, per_device: int = 8) -> None:
    """Give XLA:CPU's thread pool room for every fake device's blocked collectives.

    XLA:CPU runs the independent operations of a program concurrently on one pool of
    threads (as many as cores, or NPROC), and a collective holds its thread until every
    member of its group arrives. With 8 fake devices on 2 cores, two ready collectives
    per device (a pipeline send and the next stage's tp all-reduce) can take every thread
    while their partners wait for one: the program hangs. So the pool gets at least
    `per_device` threads per device (8 by default; NPROC, read by XLA's CPU client when it
    starts); a value the user set is kept. Other backends are unaffected."""
    if "NPROC" not in os.environ:
        os.environ["NPROC"] = str(max(os.cpu_count() or 1, per_device * devices))


def make_mesh(*, devices: Sequence[jax.Device] | None = None, **sizes: int) -> Mesh:
    """A mesh with the named axes, in the order dp, pp, cp, ucp, ep, tp (tp innermost).

    make_mesh(dp=2, tp=4) -> Mesh(('dp', 'tp'), shape (2, 4)) over all devices.
    Axes not named are left out (size 1 axes are kept if named). The product of the
    sizes must equal the number of devices (all of jax.devices(), or `devices`).
    """
    unknown = [a for a in sizes if a not in AXIS_ORDER]
    if unknown:
        raise ConfigError(f"unknown mesh axis {unknown}; known axes are {', '.join(AXIS_ORDER)}")
    for name, size in sizes.items():
        if not is_whole(size) or size < 1:
            raise ConfigError(f"mesh axis {name}={size!r} must be a positive integer, e.g. {name}=2")
    if not sizes:
        raise ConfigError("make_mesh needs at least one axis, e.g. make_mesh(dp=8)")
    if devices is not None and (not isinstance(devices, (list, tuple)) or not devices
                                or not all(isinstance(d, jax.Device) for d in devices)):
        raise ConfigError(f"devices={devices!r}: give a non-empty list of jax devices, e.g. "
                          "devices=jax.devices()[:4]")
    devices = list(jax.devices() if devices is None else devices)
    names = tuple(a for a in AXIS_ORDER if a in sizes)
    shape = tuple(int(sizes[a]) for a in names)
    total = math.prod(shape)
    if total != len(devices):
        desc = " x ".join(f"{a}={s}" for a, s in zip(names, shape))
        raise ConfigError(
            f"mesh {desc} needs {total} devices but {len(devices)} are available; "
            f"choose sizes whose product is {len(devices)}, pass devices= with {total} devices, "
            f"or start with {total} fake CPU devices (jaxpar.mesh.use_cpu_devices({total}) before JAX "
            f"starts, or XLA_FLAGS=--xla_force_host_platform_device_count={total})"
        )
    # jax.make_mesh orders devices for the physical topology (ICI/NVLink) when it can.
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def describe(mesh: Mesh) -> str:
    """'dp=2 tp=4' for a mesh."""
    return " ".join(f"{a}={s}" for a, s in mesh.shape.items())


def without_unit_axes(mesh: Mesh) -> Mesh:
    """`mesh` without its axes of one device: the same devices in the same order, so an
    array laid out on one is laid out alike on the other. A shard_map over it has no
    axis it leaves automatic and none of one device (make_mesh(dp=2, ep=1) -> dp=2)."""
    keep = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1) or mesh.axis_names[:1]
    return Mesh(mesh.devices.reshape([mesh.shape[a] for a in keep]), keep,
                axis_types=(AxisType.Auto,) * len(keep))


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of axis `name` of `mesh`, 1 when the mesh has no such axis."""
    return int(mesh.shape.get(name, 1))


def pspec_axes(pspec: PartitionSpec | None) -> set[str]:
    """The mesh axes a PartitionSpec names (P(("dp", "ep"), "tp") -> {"dp", "ep", "tp"})."""
    out: set[str] = set()
    for entry in pspec or ():
        out.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return out


def require_mesh(mesh, *, axes: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                 needed_by: str) -> Mesh:
    """Refuse anything that is not a jax Mesh, a mesh without each of `axes`, and (with
    `only`) a mesh splitting an axis outside `only` over more than one device."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"mesh={mesh!r} is a {type(mesh).__name__}, not a jax.sharding.Mesh: build one "
                          f"with jaxpar.mesh.make_mesh({', '.join(f'{a}=...' for a in axes) or 'dp=...'})")
    for axis in axes:
        if axis not in mesh.shape:
            raise ConfigError(f"{needed_by} needs a mesh with a {axis!r} axis; got axes {dict(mesh.shape)}. "
                              f"Fix: jaxpar.mesh.make_mesh({axis}=..., ...)")
    if only is not None:
        extra = {a: n for a, n in mesh.shape.items() if a not in only and n > 1}
        if extra:
            raise ConfigError(f"mesh axes {extra}: {needed_by} splits over {', '.join(map(repr, only))} only; "
                              "give the other axes size 1 (or leave them out)")
    return mesh


def require_divisible(what: str, size: int, mesh: Mesh, axes: tuple[str, ...], *, why: str) -> int:
    """Refuse `size` (called `what`) unless the product of the sizes of `axes` in `mesh`
    divides it; return that product."""
    n = 1
    for a in axes:
        n *= axis_size(mesh, a)
    if size % n:
        over = " x ".join(f"{a}={axis_size(mesh, a)}" for a in axes) + (f" = {n}" if len(axes) > 1 else "")
        raise ConfigError(f"{what}={size} is not divisible by {over}: {why}. Fix: use a {what.split()[0]} that is "
                          f"a multiple of {n}, or a mesh whose {' x '.join(axes)} divides {size}")
    return n


def init_distributed(
    coordinator: str,
    *,
    num_processes: int,
    process_id: int,
    local_device_count: int | None = None,
) -> None:
    """Join a multi-process JAX job (jax.distributed.initialize).

    On CPU, collectives across processes go through gloo; `local_device_count` fake
    CPU devices per process (set before the backend starts). On GPU/TPU the same call
    joins the accelerators of every process; `local_device_count` is then ignored.
    """
    if not isinstance(coordinator, str) or not re.fullmatch(r"[\w.\-\[\]:]+:\d+", coordinator):
        raise ConfigError(f"coordinator={coordinator!r}: give 'host:port' of process 0, e.g. '127.0.0.1:12355'")
    num_processes = whole("num_processes", num_processes, maximum=MAX_DEVICES)
    process_id = whole("process_id", process_id, minimum=0)
    if process_id >= num_processes:
        raise ConfigError(f"process_id={process_id} with num_processes={num_processes}: ids run from 0 to "
                          f"{num_processes - 1}")
    if local_device_count is not None:
        use_cpu_devices(local_device_count)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
