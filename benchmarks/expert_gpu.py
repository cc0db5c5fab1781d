"""One MoE layer's forward + backward on one GPU, implementation by implementation: the
grouped-matmul kernel against the XLA grouped layer and the padded buffer, time and the
compiled program's temporaries.

    PYTHONPATH=. python3 -m benchmarks.expert_gpu --out DIR      ~1 minute on an H200

Rows, at the MoE of benchmarks.gpu (d_model 1024, d_ff 2816, 8 experts top-2, SwiGLU,
bf16, t = 16 x 1024 tokens, so t*k = 32768 routed rows):
  padded        the [E, C, D] buffer, C = t (dispatch, grouped=False): E*t rows
  grouped-xla   expert.grouped's batched einsums: blocks of t*k/2E rows, one weight copy
                per block, at most 1.44 t*k rows
  grouped-pallas  kernels.grouped: 128-row tiles reading each expert's matrix in place, at
                most 1.03 t*k rows
Each row: ms per forward + backward of the layer (router included; mean of 10 after 2
warm-ups), TFLOP/s by the routed count 3 matmuls x 2 t k D F x 3 (forward and two
backward), and the compiled program's temporary bytes. Where no GPU is present it says
so and exits 0 (--cpu runs it anyway at a small size, the kernel interpreted).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks._timing import rows_to, timed_row, without_gpu
from jaxpar import reference
from jaxpar.expert import dispatch
from jaxpar.expert.verify import moe_inputs

SIZES = dict(d_model=1024, d_ff=2816, n_experts=8, top_k=2, tokens=16 * 1024)
SMOKE = dict(d_model=32, d_ff=48, n_experts=4, top_k=2, tokens=256)      # --cpu
IMPLS = {"padded": dict(grouped=False), "grouped-xla": dict(kernel="xla"), "grouped-pallas": dict(kernel="pallas")}


def measure(name: str, sizes: dict, reps: int = 10) -> dict:
    cfg = reference.ModelConfig(n_layers=1, d_model=sizes["d_model"], d_ff=sizes["d_ff"], mlp="swiglu",
                                n_experts=sizes["n_experts"], top_k=sizes["top_k"])
    t = sizes["tokens"]
    p, x, dy = moe_inputs(cfg, 1, t, skew=0.5, dtype=jnp.bfloat16)
    options = dispatch.MoEOptions.of(cfg, **IMPLS[name])
    dispatch.check_kernel(options, 1, d_model=cfg.d_model, d_ff=cfg.d_ff)

    def step(p, x, dy):
        y, vjp = jax.vjp(lambda p, x: dispatch.ep_moe_shard(p, x, axis=None, options=options)[0], p, x)
        return y, vjp(dy)
    flops = 3 * 2 * t * cfg.top_k * cfg.d_model * cfg.d_ff * 3
    return timed_row(step, (p, x[0], dy[0]), reps, flops, impl=name, tokens=t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-bench", help="folder of expert_gpu.json")
    p.add_argument("--cpu", action="store_true", help="run anyway off a GPU (the kernel interpreted; a smoke test)")
    args = p.parse_args(argv)
    if without_gpu("expert_gpu", args.cpu):
        return 0
    kw = dict(reps=1, sizes=SMOKE) if args.cpu else dict(sizes=SIZES)
    rows_to(os.path.join(args.out, "expert_gpu.json"),
            ((dict(impl=name), functools.partial(measure, name, **kw)) for name in IMPLS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
