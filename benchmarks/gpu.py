"""jaxpar's trainer on one GPU: ms/step, tokens/s, TFLOP/s, MFU and memory of the models
docs/benchmarks.md quotes, and where the time goes.

    PYTHONPATH=. python3 -m benchmarks.gpu --quick --out DIR     every model, at most ~5 minutes
    PYTHONPATH=. python3 -m benchmarks.gpu --only 1B --kernel xla  one model, XLA attention
    PYTHONPATH=. python3 -m benchmarks.gpu --only 1B --profile 1B  and a jax.profiler trace of 2 steps
    PYTHONPATH=. python3 -m benchmarks.gpu --only MoE --compare-experts MoE   the MoE again, experts by the Pallas kernel

Each model trains on one device (ParallelSpec(): no mesh axis above 1) in mixed
precision (float32 master weights and AdamW, bf16 layers), on the generated corpus.
MFU is PaLM's count (throughput.flops_per_token: 6N + 12 L H d T per token, N the matmul
weights) over the device's dense bf16 peak (throughput.peak_flops: 989 TFLOP/s for an
H100 or H200); a measured 8192^3 bf16 matmul reaches about 790 on an H200, so 80 % is
the ceiling of a program that is all matmul. The step time is the mean of `steps` steps
run back to back after two warm-up steps (compile excluded), blocked once at the end.
Memory: the compiled step's footprint (arguments + temporaries, memory_analysis) and
the allocator's peak since the process started (monotone over the models).

Every model runs in its own try: one that fails (out of memory, say) is a row with its
error, and the rest still run. The JSON (DIR/gpu.json) is rewritten after each model, so
a run cut short keeps what it measured. Where no GPU is present it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._timing import guarded, without_gpu
from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.train import throughput
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

_LLAMA = dict(mlp="swiglu", rope_theta=10000.0, vocab=32000)
# name -> (model, batch_size, seq_len, recompute); the sizes the GPU figures are quoted at
MODELS = {
    "124M": (reference.ModelConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, head_dim=64, d_ff=3072,
                                   mlp="gelu", rope_theta=10000.0, vocab=32000), 16, 1024, "none"),
    "1B": (reference.ModelConfig(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=5632,
                                 **_LLAMA), 8, 2048, "none"),
    "MoE": (reference.ModelConfig(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, head_dim=64, d_ff=2816,
                                  n_experts=8, top_k=2, **_LLAMA), 16, 1024, "none"),
    "1B-T8192": (reference.ModelConfig(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128,
                                       d_ff=5632, **_LLAMA), 1, 8192, "none"),
    "1B-T32768-dots": (reference.ModelConfig(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128,
                                             d_ff=5632, **_LLAMA), 1, 32768, "dots"),
}
QUICK_STEPS = 8


def device_facts() -> dict:
    """The device, driver, versions and date the figures are quoted with."""
    dev = jax.devices()[0]
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"device": dev.device_kind, "platform": dev.platform, "devices": len(jax.devices()), "driver": driver,
            "jax": jax.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": os.environ.get("JAXPAR_COMMIT")}


def _batches(cfg, batch_size: int, seq_len: int, n: int) -> list[np.ndarray]:
    corpus = Corpus(vocab=cfg.vocab)
    return [corpus.batch(i, batch_size=batch_size, seq_len=seq_len) for i in range(n)]


def _peak_gib() -> float | None:
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else round(peak / 2**30, 2)


def trainer_for(name: str, *, kernel: str = "auto", experts: str = "auto") -> Trainer:
    """The trainer of MODELS[name] as the figures time it: one device, mixed precision
    (bf16 layers over float32 weights and AdamW), the benchmark's learning-rate schedule."""
    cfg, batch_size, seq_len, recompute = MODELS[name]
    return Trainer(cfg, ParallelSpec(recompute=recompute), OptimConfig(lr=3e-4, warmup=10, steps=1000),
                   batch_size=batch_size, seq_len=seq_len, devices=jax.devices()[:1], compute_dtype=jnp.bfloat16,
                   attention_kernel=kernel, expert_kernel=experts)


def measure(name: str, *, steps: int, kernel: str = "auto", experts: str = "auto",
            profile_dir: str | None = None) -> dict:
    """One model's row: build, compile, two warm-up steps, `steps` timed steps."""
    cfg, batch_size, seq_len, recompute = MODELS[name]
    start = time.perf_counter()
    trainer = trainer_for(name, kernel=kernel, experts=experts)
    compiled = trainer.compiled
    compile_s = time.perf_counter() - start
    state = trainer.init()
    batches = [trainer.put(b) for b in _batches(cfg, batch_size, seq_len, 4)]
    losses = []
    for i in range(2):
        state, metrics = trainer.step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = trainer.step(state, batches[i % len(batches)])
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / steps
    if profile_dir is not None:
        with jax.profiler.trace(profile_dir):
            for i in range(2):
                state, metrics = trainer.step(state, batches[i % len(batches)])
            jax.block_until_ready(state)
    tokens_s = batch_size * seq_len / step_s
    flops = throughput.flops_per_token(cfg, seq_len) * tokens_s
    mem = compiled.memory_analysis()
    footprint = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes \
        - mem.alias_size_in_bytes
    return {"model": name, "batch_size": batch_size, "seq_len": seq_len, "recompute": recompute,
            "attention": trainer.kernel, "experts": trainer.expert_matmuls if cfg.n_experts else None,
            "compile_s": round(compile_s, 1), "ms_per_step": round(1e3 * step_s, 2),
            "tokens_per_s": round(tokens_s), "tflops": round(flops / 1e12, 1),
            "mfu": throughput.mfu(tokens_s, cfg, seq_len, 1, jax.devices()[0].device_kind, jnp.bfloat16),
            "params": int(sum(np.prod(a.shape) for a in jax.tree.leaves(trainer.shapes))),
            "matmul_params": throughput.matmul_params(cfg), "footprint_gib": round(footprint / 2**30, 2),
            "temp_gib": round(mem.temp_size_in_bytes / 2**30, 2),
            "peak_gib": _peak_gib(),
            "losses": [float(x) for x in losses]}


def _row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['model']:<16} FAILED: {r['error'][:160]}"
    mfu = throughput.format_mfu(r["mfu"])
    experts = f" experts {r['experts']}" if r.get("experts") else ""
    return (f"{r['model']:<16} {r['attention']:<6}{experts} B{r['batch_size']:<3} T{r['seq_len']:<6} {r['ms_per_step']:>8.1f} ms "
            f"{r['tokens_per_s']:>9} tok/s {r['tflops']:>6.1f} TFLOP/s MFU {mfu:>6} "
            f"footprint {r['footprint_gib']:.1f} GiB compile {r['compile_s']:.0f}s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"every model, {QUICK_STEPS} timed steps each")
    p.add_argument("--only", default=None, help=f"comma-separated models of {', '.join(MODELS)}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per model (default 20; --quick 8)")
    p.add_argument("--kernel", default="auto", help="attention kernel: auto, xla or cudnn")
    p.add_argument("--compare-xla", default="", help="models to run again with --kernel xla, comma-separated")
    p.add_argument("--expert-kernel", default="auto", help="the MoE's grouped matmuls: auto, xla or pallas")
    p.add_argument("--compare-experts", default="",
                   help="MoE models to run again with --expert-kernel pallas, comma-separated")
    p.add_argument("--profile", default="", help="models to trace (2 steps, jax.profiler) into DIR/trace-NAME")
    p.add_argument("--out", default="gpu-bench", help="folder of gpu.json")
    p.add_argument("--cpu", action="store_true", help="run on CPU anyway (tiny steps count; a smoke test)")
    args = p.parse_args(argv)
    if without_gpu("gpu", args.cpu):
        return 0
    names = list(MODELS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ConfigError(f"--only {unknown}: models are {', '.join(MODELS)}")
    steps = args.steps or (QUICK_STEPS if args.quick else 20)
    os.makedirs(args.out, exist_ok=True)
    report = {"facts": device_facts(), "rows": []}
    runs = [(n, args.kernel, args.expert_kernel) for n in names] \
        + [(n, "xla", args.expert_kernel) for n in filter(None, args.compare_xla.split(","))] \
        + [(n, args.kernel, "pallas") for n in filter(None, args.compare_experts.split(","))]
    for name, kernel, experts in runs:
        first = (kernel, experts) == (args.kernel, args.expert_kernel)
        prof = os.path.join(args.out, f"trace-{name}") if name in args.profile.split(",") and first else None
        row = guarded(functools.partial(measure, name, steps=steps, kernel=kernel, experts=experts,
                                        profile_dir=prof), model=name, attention=kernel, experts=experts)
        report["rows"].append(row)
        print(_row_line(row), flush=True)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
    return 0


def run() -> list[dict]:
    """benchmarks.run's entry (`python -m benchmarks.run gpu`): the --quick rows, or one
    row saying why nothing ran where there is no GPU."""
    if jax.default_backend() != "gpu":
        return [{"skipped": f"no GPU (backend {jax.default_backend()})"}]
    out = "gpu-bench"
    main(["--quick", "--out", out])
    with open(os.path.join(out, "gpu.json")) as f:
        return [{k: v for k, v in r.items() if k != "losses"} for r in json.load(f)["rows"]]


if __name__ == "__main__":
    sys.exit(main())
