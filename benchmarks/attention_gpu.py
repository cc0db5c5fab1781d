"""Attention's forward + backward on one GPU, implementation by implementation: the
fused kernels against the XLA paths, time and the compiled program's temporaries.

    PYTHONPATH=. python3 -m benchmarks.attention_gpu --out DIR      ~1 minute on an H200

Rows, at B=1, N=16 query heads of 128, K=8 KV heads, causal, bf16, for T = 2048 and 8192:
  whole-xla    reference.attention: the [B, N, T, T] scores (T = 2048 only: 8192 would
               hold 4 GiB of float32 scores per call)
  whole-cudnn  cuDNN's flash attention (kernels.attention, "cudnn")
  whole-pallas jaxpar's Pallas kernel over one block (kernels.attention, "pallas")
  ring-xla     ring attention at cp = 1, its block in XLA ops (keys 128 at a time)
  ring-pallas  ring attention at cp = 1, its block through the Pallas kernel: what every
               block of a ring at cp > 1 runs on GPUs
Each row: ms per forward + backward (mean of 10 after 2 warm-ups), TFLOP/s by the causal
count 4 B N T^2 H x 3.5 / 2 (forward 2 matmuls, backward 5, half the pairs), and the
compiled program's temporary bytes. Where no GPU is present it says so and exits 0
(--cpu runs it anyway: cuDNN's rows are then rows with their error).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import rows_to, timed_row, without_gpu
from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context import ring
from jaxpar.kernels import attention as kernel

B, N, K, H = 1, 16, 8, 128
SMOKE = (4, 2, 16)       # --cpu: heads and width small enough for the interpreter


def _impls(T: int) -> dict:
    one = mesh_lib.make_mesh(cp=1, devices=jax.devices()[:1])
    rows = {"whole-cudnn": functools.partial(kernel.attention, implementation="cudnn"),
            "whole-pallas": functools.partial(kernel.attention, implementation="pallas"),
            "ring-xla": functools.partial(ring.ring_attention, mesh=one, kernel="xla"),
            "ring-pallas": functools.partial(ring.ring_attention, mesh=one, kernel="pallas")}
    if T <= 2048:
        rows = {"whole-xla": functools.partial(reference.attention, causal=True), **rows}
    return rows


def measure(name: str, fn, T: int, reps: int = 10, heads: tuple[int, int, int] = (N, K, H)) -> dict:
    n, kv, h = heads
    keys = jax.random.split(jax.random.key(T), 4)
    q, do = (jax.random.normal(k, (B, T, n, h), jnp.bfloat16) for k in keys[:2])
    k_, v = (jax.random.normal(k, (B, T, kv, h), jnp.bfloat16) for k in keys[2:])

    def step(q, k, v, do):
        o, vjp = jax.vjp(fn, q, k, v)
        return o, *vjp(do)
    flops = 4 * B * n * T * T * h * 3.5 / 2
    return timed_row(step, (q, k_, v, do), reps, flops, impl=name, seq_len=T)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-bench", help="folder of attention_gpu.json")
    p.add_argument("--seq", default="2048,8192", help="sequence lengths, comma-separated")
    p.add_argument("--cpu", action="store_true", help="run anyway off a GPU (the kernel interpreted; a smoke test)")
    args = p.parse_args(argv)
    if without_gpu("attention_gpu", args.cpu):
        return 0
    kw = dict(reps=1, heads=SMOKE) if args.cpu else {}
    rows_to(os.path.join(args.out, "attention_gpu.json"),
            ((dict(impl=name, seq_len=T), functools.partial(measure, name, fn, T, **kw))
             for T in (int(t) for t in args.seq.split(",")) for name, fn in _impls(T).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
