"""The same tensor-parallel block, unchanged, across two processes (jax.distributed).

    python examples/09_multihost.py

Starts 2 processes on this machine, each with 4 fake CPU devices, joined through
`jaxpar.mesh.init_distributed` (gloo collectives over loopback). Together they form one
dp=2 x tp=4 mesh of 8 devices, with the tp groups inside one process each (tp innermost,
as on a real cluster, where a tp group is one NVLink node) and dp across the processes.
Each process runs the very `tensor.tp_block` that the single-process tests check, takes
the gradient, gathers the sharded results and compares them with `reference.block` run
locally: output and every parameter gradient. On a real cluster, run one copy per host
with `--process-id`, `--processes` and `--coordinator HOST:PORT` instead.
"""

import argparse
import socket
import subprocess
import sys

import numpy as np

from jaxpar import mesh


def worker(process_id: int, processes: int, coordinator: str, local_devices: int) -> None:
    mesh.init_distributed(coordinator, num_processes=processes, process_id=process_id,
                          local_device_count=local_devices)

    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding

    from jaxpar import reference, tensor
    from jaxpar.testing import max_abs_diff

    n = jax.device_count()
    m = mesh.make_mesh(dp=2, tp=n // 2)
    cfg = reference.ModelConfig(n_layers=1, n_kv_heads=2, mlp="swiglu")
    params = reference.layer_params(reference.init_params(jax.random.PRNGKey(0), cfg), 0)
    params = jax.tree.map(np.asarray, params)                    # the same host data everywhere
    x = np.random.default_rng(1).normal(size=(4, 16, cfg.d_model)).astype(np.float32)
    dy = np.random.default_rng(2).normal(size=x.shape).astype(np.float32) / x.size

    # Global arrays over all 8 devices: each process supplies only its devices' blocks.
    specs = tensor.TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=m.shape[mesh.TP], data_axis=mesh.DP)
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(m, spec), lambda i: a[i])
    gp = {k: put(a, specs.params(params)[k]) for k, a in params.items()}
    gx, gdy = put(x, specs.act_btd), put(dy, specs.act_btd)

    def loss(p, x, dy):
        return jnp.sum(tensor.tp_block(p, x, mesh=m, cfg=cfg) * dy)

    y = jax.jit(lambda p, x: tensor.tp_block(p, x, mesh=m, cfg=cfg))(gp, gx)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(gp, gx, gdy)
    y, grads = multihost_utils.process_allgather((y, grads), tiled=True)

    ref_loss = lambda p, x: jnp.sum(reference.block(p, x, cfg) * dy)
    ref_y = reference.block(params, x, cfg)
    ref_grads = jax.grad(ref_loss, argnums=(0, 1))(params, x)
    errors = {"output": max_abs_diff(y, ref_y), "input grad": max_abs_diff(grads[1], ref_grads[1]),
              "param grads": max_abs_diff(grads[0], ref_grads[0])}
    print(f"process {process_id}/{processes}: {jax.local_device_count()} local of {n} devices, "
          f"mesh {mesh.describe(m)}, max |diff| vs reference: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    if max(errors.values()) > 1e-5:
        sys.exit(f"process {process_id}: mismatch with the reference")


def launch(processes: int, local_devices: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}", "--processes", str(processes),
           "--local-devices", str(local_devices)]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)]) for i in range(processes)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print("all processes agree with the reference" if not any(codes) else f"exit codes {codes}")
    return max(codes)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, help="this process's index (omit to launch all locally)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    ap.add_argument("--local-devices", type=int, default=4, help="fake CPU devices per process")
    args = ap.parse_args()
    if args.process_id is None:
        sys.exit(launch(args.processes, args.local_devices))
    worker(args.process_id, args.processes, args.coordinator, args.local_devices)
