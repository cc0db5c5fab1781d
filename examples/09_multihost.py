"""The same tensor-parallel block, and the whole composed model's training, across two processes.

    python examples/09_multihost.py

Starts 2 processes on this machine, each with 4 fake CPU devices, joined through
`jaxpar.mesh.init_distributed` (jax.distributed, gloo collectives over loopback).
Together they form one mesh of 8 devices, with the tp groups inside one process each (tp
innermost, as on a real cluster, where a tp group is one NVLink node) and dp across the
processes. Each process

  1. runs the very `tensor.tp_block` that the single-process tests check on dp=2 x tp=4,
     takes the gradient, gathers the sharded results and compares them with
     `reference.block` run locally: output and every parameter gradient;
  2. trains the composed model (`train.Trainer`, dp=2 x pp=2 x tp=2, 1F1B over 2
     microbatches) for 10 steps with `train.fit`: every process feeds the same host batch,
     each device gets its part (`Trainer.put`), the dp gradient reduction crosses the
     processes. Process 0 prints the losses.

Meanwhile one more process trains the same spec alone on 8 fake CPU devices (`--single`);
the launcher checks that both runs' losses agree to 1e-6 relative and exits non-zero if not.

On a GPU cluster the same script runs one copy per host with real devices (no fake CPU
devices, no launcher): here 2 hosts of 4 GPUs each (CUDA_VISIBLE_DEVICES=0,1,2,3 on
8-GPU hosts), host 0 reachable as 10.0.0.1:

    host0$ python examples/09_multihost.py --process-id 0 --processes 2 --coordinator 10.0.0.1:12355
    host1$ python examples/09_multihost.py --process-id 1 --processes 2 --coordinator 10.0.0.1:12355

(`--local-devices` only sets fake CPU devices; it is ignored where GPUs are present.)
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

# None of these imports starts JAX's backends: init_distributed and use_cpu_devices still can.
from jaxpar import mesh
from jaxpar.train import verify
from jaxpar.train.loop import fit
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

RTOL = 1e-6   # the 2-process losses against the 1-process ones


def train(steps: int) -> tuple[str, list[float]]:
    """`steps` steps of the composed model on dp x pp=2 x tp=2 over every device (dp=2 on 8)."""
    spec = ParallelSpec(dp=jax.device_count() // 4, pp=2, tp=2, microbatches=2)
    trainer = Trainer(verify.DENSE, spec, verify.OPTIM, batch_size=8, seq_len=16)
    _, history = fit(trainer, steps=steps, progress=False)
    return spec.describe(), history.losses


def report(name: str, processes: int, losses: list[float], losses_out: str | None) -> None:
    print(f"train {name}, {processes} process{'es' if processes > 1 else ''}: losses "
          + " ".join(f"{v:.4f}" for v in losses), flush=True)
    if losses_out:
        Path(losses_out).write_text(json.dumps(losses))


def worker(process_id: int, processes: int, coordinator: str, local_devices: int, steps: int,
           losses_out: str | None) -> None:
    mesh.init_distributed(coordinator, num_processes=processes, process_id=process_id,
                          local_device_count=local_devices)

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

    name, losses = train(steps)
    if process_id == 0:
        report(name, processes, losses, losses_out)


def single(devices: int, steps: int, losses_out: str | None) -> None:
    """The same training in one process with `devices` fake CPU devices."""
    mesh.use_cpu_devices(devices)
    name, losses = train(steps)
    report(name, 1, losses, losses_out)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30), initial=0.0))


def launch(processes: int, local_devices: int, steps: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fake CPU devices only, whatever accelerator this machine has; the counts come from the flags
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))}
    tmp = tempfile.TemporaryDirectory()
    multi_out, single_out = Path(tmp.name, "multi.json"), Path(tmp.name, "single.json")
    cmd = [sys.executable, __file__, "--processes", str(processes), "--local-devices", str(local_devices),
           "--steps", str(steps)]
    procs = [subprocess.Popen(cmd + ["--coordinator", f"127.0.0.1:{port}", "--process-id", str(i)]
                              + (["--losses-out", str(multi_out)] if i == 0 else []), env=env)
             for i in range(processes)]
    procs.append(subprocess.Popen(cmd + ["--single", "--losses-out", str(single_out)], env=env))
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        print(f"exit codes {codes} (the last: the single process)")
        tmp.cleanup()
        return max(codes)
    print("all processes agree with the reference")
    multi, one = json.loads(multi_out.read_text()), json.loads(single_out.read_text())
    tmp.cleanup()
    diff = max_rel_diff(multi, one)
    n = processes * local_devices
    print(f"losses of {processes} processes x {local_devices} devices vs 1 process x {n} devices: "
          f"max relative difference {diff:.1e} (tolerance {RTOL:.0e})")
    if not diff <= RTOL:
        print("the losses differ")
        return 1
    print(f"{steps} training steps: {processes} processes = 1 process")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, help="this process's index (omit to launch all locally)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    ap.add_argument("--local-devices", type=int, default=4, help="fake CPU devices per process")
    ap.add_argument("--steps", type=int, default=10, help="training steps")
    ap.add_argument("--losses-out", default=None, help="process 0 (or --single) writes the losses here, JSON")
    ap.add_argument("--single", action="store_true",
                    help="train alone on processes x local-devices fake CPU devices (the comparison)")
    args = ap.parse_args()
    if args.single:
        single(args.processes * args.local_devices, args.steps, args.losses_out)
    elif args.process_id is None:
        sys.exit(launch(args.processes, args.local_devices, args.steps))
    else:
        worker(args.process_id, args.processes, args.coordinator, args.local_devices, args.steps,
               args.losses_out)
