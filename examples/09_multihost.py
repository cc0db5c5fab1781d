"""The same tensor-parallel block, and the whole composed model's training, across two processes.

    python examples/09_multihost.py

Starts 2 processes on this machine, each with 4 fake CPU devices, joined through
`jaxpar.mesh.init_distributed` (jax.distributed, gloo collectives over loopback).
Together they form one mesh of 8 devices, with the tp groups inside one process each (tp
innermost, as on a real cluster, where a tp group is one NVLink node) and dp across the
processes. Each process

  1. builds global arrays of which it supplies only its own devices' blocks
     (`jax.make_array_from_callback`), runs the very `tensor.tp_block` that the
     single-process tests check on dp=2 x tp=4 and its gradient, and compares the shards
     it holds (`addressable_shards`) with the same slices of `reference.block` run
     locally: output, input gradient and every parameter gradient;
  2. trains the composed model (`train.Trainer`, dp=2 x pp=2 x tp=2, 1F1B over 2
     microbatches) for 10 steps with `train.fit`: each process reads only the rows of
     every batch its own devices hold (`train.loop.global_batch`: process 0 the first dp
     half, process 1 the second), the dp gradient reduction crosses the processes.
     Process 0 prints the losses.

Meanwhile the launcher trains the same model on one device (`train.reference_trainer`,
the unsharded model and the same AdamW on the same batches) and checks that the two
processes' losses agree with it to 1e-5 relative; it exits non-zero if not.

On a GPU cluster the same script runs one copy per host with real devices (no fake CPU
devices, no launcher): here 2 hosts of 4 GPUs each (CUDA_VISIBLE_DEVICES=0,1,2,3 on
8-GPU hosts), host 0 reachable as 10.0.0.1:

    host0$ python examples/09_multihost.py --process-id 0 --processes 2 --coordinator 10.0.0.1:12355
    host1$ python examples/09_multihost.py --process-id 1 --processes 2 --coordinator 10.0.0.1:12355

(`--local-devices` only sets fake CPU devices; it is ignored where GPUs are present.)

The command line trains the same way, one command per process (`--devices`: each
process's fake CPU devices; process 0 prints the summary, `--json` its losses):

    host0$ jaxpar train --mesh dp=2,pp=2,tp=2 --coordinator 10.0.0.1:12355 --processes 2 --process-id 0
    host1$ jaxpar train --mesh dp=2,pp=2,tp=2 --coordinator 10.0.0.1:12355 --processes 2 --process-id 1
    $ srun -N 2 jaxpar train --mesh dp=2,pp=2,tp=2 --distributed auto     # SLURM names the ranks

(tests/cli/test_train_multihost.py runs it as 2 processes x 4 CPU devices on loopback.)
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

# None of these imports starts JAX's backends: init_distributed still can.
from jaxpar import mesh, reference, tensor
from jaxpar.testing import max_abs_diff
from jaxpar.train import Corpus, OptimConfig, ParallelSpec, Trainer, fit, reference_trainer

RTOL = 1e-5   # the 2-process losses against the unsharded model's, float32
# the model both train: a small Llama-style decoder (RoPE, grouped-query attention, SwiGLU)
CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32, rope_theta=10000.0)
OPTIM = OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5)
B, T = 8, 16


def block_and_grads(block, p, x, dy):
    """(block(p, x), its gradients (dp, dx) for the cotangent dy)."""
    y, vjp = jax.vjp(block, p, x)
    return y, vjp(dy)


def layer_params(cfg: reference.ModelConfig, rng) -> dict:
    """One layer's weights as reference.layer_params names and shapes them, drawn with
    numpy: weights ~ N(0, 1/fan_in), norm gains near 1."""
    shapes = jax.eval_shape(lambda: reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0))

    def draw(shape):
        return rng.normal(size=shape) / np.sqrt(shape[0]) if len(shape) > 1 else 1 + 0.1 * rng.normal(size=shape)
    return {name: draw(a.shape).astype(np.float32) for name, a in shapes.items()}


def local_error(ours, full) -> float:
    """max |diff| between the shards of the global arrays `ours` that this process holds
    and the same slices of the arrays `full` (a tree of the same structure)."""
    pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(full))
    return max(max_abs_diff(shard.data, whole[shard.index]) for array, whole in pairs for shard in array.addressable_shards)


def check_block(process_id: int) -> None:
    """tensor.tp_block over all 8 devices of both processes against reference.block: each
    process checks the shards it holds."""
    m = mesh.make_mesh(dp=2, tp=jax.device_count() // 2)        # tp inside a process, dp across the two
    cfg = reference.ModelConfig(n_layers=1, n_kv_heads=2, mlp="swiglu")
    rng = np.random.default_rng(0)                              # the same host data in every process
    params = layer_params(cfg, rng)
    x = rng.normal(size=(4, 16, cfg.d_model)).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32) / x.size

    # global arrays over all 8 devices: each process supplies only its own devices' blocks
    specs = tensor.TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=m.shape[mesh.TP], data_axis=mesh.DP)
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(m, spec), lambda index: a[index])
    gp = {k: put(a, specs.params(params)[k]) for k, a in params.items()}
    gx, gdy = put(x, specs.act_btd), put(dy, specs.act_btd)
    y, (dparams, dx) = jax.jit(partial(block_and_grads, partial(tensor.tp_block, mesh=m, cfg=cfg)))(gp, gx, gdy)
    ref_y, (ref_dparams, ref_dx) = jax.device_get(jax.jit(partial(block_and_grads, partial(reference.block, cfg=cfg)))(
        params, x, dy))                                         # the whole block, on one local device
    errors = {"output": local_error(y, ref_y), "input grad": local_error(dx, ref_dx),
              "param grads": local_error(dparams, ref_dparams)}
    print(f"process {process_id}: {jax.local_device_count()} local of {jax.device_count()} devices, "
          f"mesh {mesh.describe(m)}, max |diff| vs reference: "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    if max(errors.values()) > 1e-5:
        sys.exit(f"process {process_id}: mismatch with the reference")


def worker(process_id: int, processes: int, coordinator: str, local_devices: int, steps: int,
           losses_out: str | None) -> None:
    mesh.init_distributed(coordinator, num_processes=processes, process_id=process_id,
                          local_device_count=local_devices)
    check_block(process_id)
    spec = ParallelSpec(dp=jax.device_count() // 4, pp=2, tp=2, microbatches=2)   # dp=2 on 8 devices
    trainer = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)
    _, history = fit(trainer, steps=steps, progress=False)      # each step: trainer.put(batch), trainer.step
    if process_id == 0:
        print(f"train {spec.describe()}, {processes} processes: losses "
              + " ".join(f"{v:.4f}" for v in history.losses), flush=True)
        if losses_out:
            Path(losses_out).write_text(json.dumps(history.losses))


def reference_losses(steps: int) -> list[float]:
    """The unsharded model's losses on one CPU device, on the batches fit feeds."""
    with jax.default_device(jax.devices("cpu")[0]):
        tx, step = reference_trainer(CFG, OPTIM)
        params = reference.init_params(jax.random.key(0), CFG)     # what Trainer.init lays out
        opt, corpus, losses = tx.init(params), Corpus(vocab=CFG.vocab), []
        for i in range(steps):
            params, opt, loss, _ = step(params, opt, jnp.asarray(corpus.batch(i, batch_size=B, seq_len=T)))
            losses.append(float(loss))
    return losses


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
    multi_out = Path(tmp.name, "multi.json")
    cmd = [sys.executable, __file__, "--processes", str(processes), "--local-devices", str(local_devices),
           "--steps", str(steps), "--coordinator", f"127.0.0.1:{port}"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)] + (["--losses-out", str(multi_out)] if i == 0 else []),
                              env=env) for i in range(processes)]
    try:
        reference = reference_losses(steps)                      # meanwhile, here
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        print(f"exit codes {codes}")
        tmp.cleanup()
        return max(codes)
    print("all processes agree with the reference")
    multi = json.loads(multi_out.read_text())
    tmp.cleanup()
    diff = max_rel_diff(multi, reference)
    print(f"losses of {processes} processes x {local_devices} devices vs the unsharded model on 1 device: "
          f"max relative difference {diff:.1e} (tolerance {RTOL:.0e})")
    if not diff <= RTOL:
        print("the losses differ")
        return 1
    print(f"{steps} training steps: {processes} processes = 1 device (reference_trainer)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, help="this process's index (omit to launch all locally)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    ap.add_argument("--local-devices", type=int, default=4, help="fake CPU devices per process")
    ap.add_argument("--steps", type=int, default=10, help="training steps")
    ap.add_argument("--losses-out", default=None, help="process 0 writes the losses here, JSON")
    args = ap.parse_args()
    if args.process_id is None:
        sys.exit(launch(args.processes, args.local_devices, args.steps))
    worker(args.process_id, args.processes, args.coordinator, args.local_devices, args.steps, args.losses_out)
