"""jaxpar's Pallas kernels compiled for Hopper (sm_90) on a machine with no GPU: does each
one compile, and what does it hold per program (shared memory, registers, spills)?

    pip install triton                                   # once, beside jax (any machine)
    PYTHONPATH=. python -m benchmarks.triton_sm90 --out DIR    ~1 minute on 2 CPU cores

Each kernel is lowered for CUDA from this machine (kernels.triton_ir.modules: Pallas emits
its Triton module, MLIR's verifier passes it), then compiled by the `triton` package from
PyPI for sm_90 with the launch Pallas asks for (warps, stages), through PTX to a cubin:
the shared memory Triton allots (an H100 or H200 gives a program at most 227 KiB), and,
from `cuobjdump -res-usage` of the cubin, the registers per thread and the stack (bytes
spilled from registers; 0 is none); and from its SASS (`cuobjdump -sass`), how the
matmuls run: HGMMA counts Hopper's asynchronous tensor-core MMAs, FFMA float32
multiply-adds (a dot computed without tensor cores), LDL/STL the loads and stores of
spilled registers.

This is the triton package's compiler, not the one XLA:GPU carries inside jaxlib: a
kernel it compiles is Triton-valid for Hopper and its figures are those of that Triton
release; what XLA's pinned Triton does may differ by a release's changes. A GPU run
(benchmarks/gpu_check.sh) is the proof; this is what a machine without one can check.

Rows (the shapes benchmarks.gpu and benchmarks.attention_gpu run):
  grouped   the MoE's forward, dh and dW (kernels.grouped) at d_model 1024, d_ff 2816,
            8 experts, t*k = 32768 rows, in bfloat16 and float32
  flash     one ring block's forward, dK/dV and dQ (kernels.flash), heads of 64 and 128,
            T = 2048, causal, in bfloat16 and float32
Where the triton package is missing it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from benchmarks._timing import guarded
from jaxpar.kernels import flash, grouped, triton_ir

HOPPER_SHARED = 227 * 1024           # the most shared memory one program gets on an H100 / H200


def _grouped_case(dtype, d_model=1024, d_ff=2816, experts=8, rows=32768):
    n_tiles = (rows + experts * (grouped.TILE_ROWS - 1)) // grouped.TILE_ROWS
    t = grouped.tiles(jnp.full((experts,), rows // experts), n_tiles)

    def step(h, w):
        y, vjp = jax.vjp(lambda h, w: grouped.grouped_matmul(h, w, t), h, w)
        return y, vjp(y)
    return step, (jax.ShapeDtypeStruct((n_tiles * grouped.TILE_ROWS, d_model), dtype),
                  jax.ShapeDtypeStruct((experts, d_model, d_ff), dtype))


def _flash_case(dtype, head_dim, tokens=2048):
    scale = head_dim ** -0.5

    def step(q, k, v):
        o, lse = flash.block_forward(q, k, v, scale=scale, causal=True)
        return flash.block_backward(q, k, v, o.astype(q.dtype), lse, lse, scale=scale, causal=True)
    q = jax.ShapeDtypeStruct((1, 8, 2, tokens, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, 8, tokens, head_dim), dtype)
    return step, (q, k, k)


CASES = {
    **{f"grouped {jnp.dtype(d).name}": (lambda d=d: _grouped_case(d)) for d in (jnp.bfloat16, jnp.float32)},
    **{f"flash h{h} {jnp.dtype(d).name}": (lambda d=d, h=h: _flash_case(d, h))
       for h in (64, 128) for d in (jnp.bfloat16, jnp.float32)},
}


def _resources(cuobjdump: str, cubin: bytes) -> dict:
    """The cubin's one kernel: registers per thread and stack bytes (`-res-usage`), and in
    its SASS the Hopper tensor-core MMAs (HGMMA), float32 FMAs (FFMA) and local-memory
    loads and stores (LDL / STL: spilled registers read back)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = lambda flag: subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True,
                                          timeout=120).stdout
        usage, sass = run("-res-usage"), run("-sass")
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    counts = {"hgmma": len(re.findall(r"\bHGMMA\b", sass)), "ffma": len(re.findall(r"\bFFMA\b", sass)),
              "local_ldst": len(re.findall(r"\b(?:LDL|STL)\b", sass))}
    return {"registers": int(found["REG"]), "stack_bytes": int(found["STACK"]), **counts} if found else counts


def compile_case(name: str, triton, work: str) -> list[dict]:
    """One case's rows: each of its kernels compiled for sm_90."""
    from triton.backends.compiler import GPUTarget
    fn, args = CASES[name]()
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    rows = []
    for i, module in enumerate(triton_ir.modules(fn, *args)):
        path = os.path.join(work, f"{name.replace(' ', '_')}_{i}_{module.name}.ttir")
        with open(path, "w") as f:
            f.write(module.asm)
        identity = {"case": name, "kernel": module.name, "num_warps": module.num_warps,
                    "num_stages": module.num_stages}

        def measure(path=path, module=module, identity=identity):
            kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": module.num_warps, "num_stages": module.num_stages})
            shared = int(kernel.metadata.shared)
            return {**identity, "shared_bytes": shared, "fits_hopper": shared <= HOPPER_SHARED,
                    **_resources(cuobjdump, kernel.asm["cubin"])}
        rows.append(guarded(measure, **identity))
    return rows


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['case']:<20} {r['kernel']:<28} ERROR {r['error']}"
    return (f"{r['case']:<20} {r['kernel']:<28} {r['num_warps']:>5} {r['num_stages']:>6} "
            f"{r['shared_bytes'] / 1024:>9.1f} {str(r['fits_hopper']):>6} {r.get('registers', '?'):>5} "
            f"{r.get('stack_bytes', '?'):>6} {r['hgmma']:>6} {r['ffma']:>6} {r['local_ldst']:>6}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write DIR/triton_sm90.json")
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # Triton's default; set to keep it quiet
    try:
        import triton
    except ImportError:
        print("benchmarks.triton_sm90: skipped: the triton package is not installed here (pip install triton)")
        return 0
    names = args.only.split(",") if args.only else list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"benchmarks.triton_sm90: unknown case(s) {unknown}; the cases are {sorted(CASES)}")
        return 2
    print(f"triton {triton.__version__}, jax {jax.__version__}, target sm_90; shared memory limit "
          f"{HOPPER_SHARED // 1024} KiB per program")
    print(f"{'case':<20} {'kernel':<28} {'warps':>5} {'stages':>6} {'shared KiB':>9} {'fits':>6} {'regs':>5} "
          f"{'stack':>6} {'HGMMA':>6} {'FFMA':>6} {'LDL/STL':>7}")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            for row in compile_case(name, triton, work):
                rows.append(row)
                print(_line(row), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "triton_sm90.json"), "w") as f:
            json.dump({"triton": triton.__version__, "jax": jax.__version__, "rows": rows}, f, indent=1)
    failed = [r for r in rows if "error" in r or not r["fits_hopper"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
