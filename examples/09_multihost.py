"""Two processes of 4 fake CPU devices each train as one mesh of 8, with the losses of one device.

    python examples/09_multihost.py

Starts 2 processes joined by `jaxpar.mesh.init_distributed` (jax.distributed, gloo on loopback) into
one mesh of 8 devices, tp inside a process (on a cluster, one NVLink node), dp across them. Each
trains dp2 x pp2 x tp2 with `Trainer` + `fit`, reading only its own rows of each batch (global arrays
built by `jax.make_array_from_callback`: `train.loop.global_batch`); the launcher trains the unsharded
model on one device meanwhile and checks every process's losses against it (1e-5 relative; it exits
non-zero if not). On 2 hosts of 4 GPUs, host 0 at 10.0.0.1, one command a host (`jaxpar train` takes
the same flags, or `--distributed auto`: docs/train.md, "Several hosts"):

    host0$ python examples/09_multihost.py --process-id 0 --processes 2 --coordinator 10.0.0.1:12355
    host1$ python examples/09_multihost.py --process-id 1 --processes 2 --coordinator 10.0.0.1:12355
"""

import argparse
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np

# None of these imports starts JAX's backends: init_distributed still can.
from jaxpar import mesh, reference
from jaxpar.train import OptimConfig, ParallelSpec, Trainer, fit, verify

CFG = reference.ModelConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=32, mlp="swiglu",
                            vocab=32, rope_theta=10000.0)      # a small Llama: RoPE, grouped-query attention, SwiGLU
OPTIM, B, T, RTOL = OptimConfig(lr=1e-2, warmup=3, steps=20, clip=0.5), 8, 16, 1e-5


def worker(args) -> None:
    mesh.init_distributed(args.coordinator, num_processes=args.processes, process_id=args.process_id,
                          local_device_count=args.local_devices)   # jax.devices(): every process's from here on
    spec = ParallelSpec(dp=jax.device_count() // 4, pp=2, tp=2, microbatches=2)   # dp=2 on 8 devices
    trainer = Trainer(CFG, spec, OPTIM, batch_size=B, seq_len=T)   # dp outermost: across the processes
    _, history = fit(trainer, steps=args.steps, progress=False)    # the loss: the whole batch's, in every process
    print(f"process {args.process_id}: {jax.local_device_count()} local of {jax.device_count()} devices, train "
          f"{spec.describe()}, {args.processes} processes: losses " + " ".join(f"{v:.7f}" for v in history.losses))


def launch(args) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fake CPU devices only, whatever accelerator this machine has; the counts come from the flags
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))}
    cmd = [sys.executable, __file__, "--processes", str(args.processes), "--local-devices", str(args.local_devices),
           "--steps", str(args.steps), "--coordinator", f"127.0.0.1:{port}"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(args.processes)]
    try:
        with jax.default_device(jax.devices("cpu")[0]):             # meanwhile: reference_trainer's steps, 1 device
            ref = verify.reference_run(CFG, OPTIM, args.steps, B, T)[0]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()                                                 # a no-op on a process that has exited
    print("".join(outs), end="")
    if any(p.returncode for p in procs):
        print(f"exit codes {[p.returncode for p in procs]}")
        return 1
    losses = [np.array(out.split(": losses ")[1].split(), float) for out in outs]
    diff = max(float(np.max(np.abs(l - ref) / np.abs(ref))) if l.shape == ref.shape else np.inf for l in losses)
    print(f"losses of each of {args.processes} processes x {args.local_devices} devices vs the unsharded model on "
          f"1 device: max relative difference {diff:.1e} (tolerance {RTOL:.0e})")
    if not diff <= RTOL:
        print("the losses differ")
        return 1
    print("all processes agree with the reference")
    print(f"{args.steps} training steps: {args.processes} processes = 1 device (reference_trainer)")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--process-id", type=int, help="this process's index (omit to launch all locally)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    ap.add_argument("--local-devices", type=int, default=4, help="fake CPU devices per process")
    ap.add_argument("--steps", type=int, default=10, help="training steps")
    args = ap.parse_args()
    sys.exit(launch(args) if args.process_id is None else worker(args))
