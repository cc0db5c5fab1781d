"""MaxText against jaxpar: the same decoder trained on the same meshes, each side in its own process.

    python -m benchmarks.maxtext [--size default|large] [--rounds 2] [--steps 12] [--json]
                                 [--maxtext-venv PATH] [--mesh NAME ...]
    python -m benchmarks.run maxtext

The model is one Llama-style decoder in both (RMSNorm, RoPE, grouped-query attention,
SwiGLU MLP, untied embedding and LM head, float32 weights and math), trained with AdamW
(lr 3e-3, b = (0.9, 0.95), weight decay 0.1, clipping at global norm 1, linear warm-up
over the first tenth of the steps, then cosine decay to a tenth). MaxText runs its
`llama2` decoder block (its default, which is this decoder), `mixtral` for the MoE row;
jaxpar runs `jaxpar.train.Trainer`. Sizes (batch 16 x 128 tokens, vocab as below):

    default  d_model 256, 4 layers, 8 query / 4 KV heads of 32, d_ff 1024, vocab 512:  4.20M params
    large    d_model 512, 4 layers, 8 query / 4 KV heads of 64, d_ff 2048, vocab 1024: 16.78M params
             (every matrix twice as wide on both sides: 4x the parameters)

The MoE row gives every block 8 experts of d_ff (top-2, softmax over the chosen two,
nothing dropped) instead of the dense MLP. MaxText runs it on its dense path (every
expert on every token, 4x top-2's expert math): its grouped-matmul path needs
`ragged-all-to-all`, which XLA:CPU does not implement.

Each side runs `--steps` steps in a fresh process on 8 fake CPU devices (XLA_FLAGS=
--xla_force_host_platform_device_count=8, nothing else), one mesh at a time, MaxText
then jaxpar, repeated `--rounds` times, so the load of a shared machine hits both alike.
MaxText runs from its own virtual environment (`--maxtext-venv`, or MAXTEXT_VENV;
default /work/maxtext-venv), on its synthetic data (one batch, repeated); jaxpar in
this interpreter (`--worker jaxpar`, which prints its step times and losses as JSON),
on one batch of `jaxpar.train.Corpus`, repeated. A step's time is what each side
reports for it (MaxText's `completed step: N, seconds: S` log line: the time between
the returns of two steps' dispatches, one step in flight; jaxpar: the wall time of
`trainer.step` until its loss is on the host); the figure is the median over every
round of the steps after the first two (which compile, or wait on compiling). `--json`
adds the median time between MaxText's step lines (their absl time stamps), a check
on its own figure.
Memory is XLA's `memory_analysis()` of each side's compiled step, per device, as MaxText
itself sums it (arguments + outputs + temporaries - aliased, i.e. donated, buffers);
MaxText logs it in GB to one decimal, so its launcher here also prints the bytes.

A side that fails (MaxText refusing a mesh, say) shows "failed: <its last error line>"
in its cell; the other rows still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

DEFAULT_VENV = "/work/maxtext-venv"
MAXTEXT_VERSION = "0.2.5"
DEVICES = 8
BATCH = 16            # sequences a step (MaxText: per_device_batch_size = BATCH / DEVICES)
SEQ = 128             # tokens a sequence
LR = 3e-3
WARMUP_FRACTION = 0.1  # MaxText's warmup_steps_fraction default; jaxpar's warm-up is set to match
COMPILE_STEPS = 2     # the first steps of each run, left out of the median
RUN_TIMEOUT_S = 1800  # one side, one mesh, one round

SIZES = {
    "default": reference.ModelConfig(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, d_ff=1024,
                                     vocab=512, mlp="swiglu", rope_theta=10000.0),
    "large": reference.ModelConfig(n_layers=4, d_model=512, n_heads=8, n_kv_heads=4, head_dim=64, d_ff=2048,
                                   vocab=1024, mlp="swiglu", rope_theta=10000.0),
}
EXPERTS, TOP_K = 8, 2
# what each side keeps between the forward and the backward: MaxText's remat_policy=minimal
# keeps its projections' outputs by name (query, key, value and out projections, the MLP's
# wi and wo), jaxpar's recompute="dots" every matmul without batch dimensions (the same
# ones) and the collectives' outputs (MaxText's partitioner places its collectives after
# rematerialisation); both recompute norms, attention scores and softmax, activations
REMAT = {"maxtext": "minimal", "jaxpar": "dots"}


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One row: the mesh as jaxpar's ParallelSpec arguments and as MaxText's config keys."""

    name: str
    jaxpar: dict
    maxtext: dict
    moe: bool = False


def _ici(data=1, fsdp=1, tensor=1, pipeline=1, context=1, expert=1) -> dict:
    """MaxText's in-slice mesh keys (every axis given: fsdp's default, -1, would take the rest)."""
    return {"ici_data_parallelism": data, "ici_fsdp_parallelism": fsdp, "ici_tensor_parallelism": tensor,
            "ici_pipeline_parallelism": pipeline, "ici_context_parallelism": context,
            "ici_expert_parallelism": expert}


MESHES = (
    Mesh("dp8", dict(dp=8), _ici(data=8)),
    Mesh("fsdp8 / ZeRO-3", dict(dp=8, zero=3), _ici(fsdp=8)),
    Mesh("dp2 x tp4", dict(dp=2, tp=4), _ici(data=2, tensor=4)),
    # the same placement on both sides. Round-robin: 4 layers over 2 stages of 1 layer each,
    # MaxText's circular pipeline of 2 repeats, jaxpar's interleaved 1F1B with 2 chunks per
    # device. Contiguous: 2 layers per stage, MaxText's pipeline without repeats, jaxpar's 1F1B.
    Mesh("dp2 x pp2 x tp2, m=4, round-robin", dict(dp=2, pp=2, tp=2, microbatches=4, schedule="interleaved", chunks=2),
         {**_ici(data=2, pipeline=2, tensor=2), "num_pipeline_microbatches": 4, "num_layers_per_pipeline_stage": 1}),
    Mesh("dp2 x pp2 x tp2, m=4, contiguous", dict(dp=2, pp=2, tp=2, microbatches=4, schedule="1f1b"),
         {**_ici(data=2, pipeline=2, tensor=2), "num_pipeline_microbatches": 4, "num_layers_per_pipeline_stage": 2}),
    Mesh("dp4 x cp2", dict(dp=4, cp=2), _ici(data=4, context=2)),
    Mesh("dp2 x ep4, MoE 8 experts top-2", dict(dp=2, ep=4), _ici(data=2, expert=4), moe=True),
)
BY_NAME = {m.name: m for m in MESHES}


# ---- the model and optimizer on each side ----------------------------------------------------

def model_config(size: str, moe: bool) -> reference.ModelConfig:
    """jaxpar's model for a size (with EXPERTS experts of d_ff, top TOP_K, when moe)."""
    cfg = SIZES[size]
    return dataclasses.replace(cfg, n_experts=EXPERTS, top_k=TOP_K) if moe else cfg


def optim_config(steps: int) -> OptimConfig:
    """jaxpar's AdamW with MaxText's schedule over `steps`: warm-up over the first tenth."""
    return OptimConfig(lr=LR, warmup=int(steps * WARMUP_FRACTION), steps=steps)


def maxtext_model_keys(cfg: reference.ModelConfig) -> dict:
    """MaxText config keys for jaxpar's model `cfg` (its llama2 block; mixtral with experts)."""
    keys = {"decoder_block": "mixtral" if cfg.n_experts else "llama2",
            "base_emb_dim": cfg.d_model, "base_num_query_heads": cfg.n_heads, "base_num_kv_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "base_mlp_dim": cfg.d_ff, "base_num_decoder_layers": cfg.n_layers,
            "vocab_size": cfg.vocab, "logits_via_embedding": "false",
            "normalization_layer_epsilon": cfg.norm_eps, "rope_max_timescale": int(cfg.rope_theta)}
    if cfg.n_experts:
        # every block an MoE of experts as wide as the dense MLP. MaxText's dense path: its
        # grouped-matmul path (sparse_matmul) does not run on XLA:CPU with ep > 1 (its
        # ragged-all-to-all is unimplemented there; use_ring_of_experts fails in
        # jax.lax.ragged_dot), so every expert runs on every token; capacity_factor -1:
        # nothing dropped, as in jaxpar
        keys |= {"num_experts": cfg.n_experts, "num_experts_per_tok": cfg.top_k, "base_moe_mlp_dim": cfg.d_ff,
                 "sparse_matmul": "false", "capacity_factor": -1.0}
    return keys


def maxtext_args(mesh: Mesh, size: str, steps: int, run_name: str, output_dir: str) -> list[str]:
    """MaxText's key=value arguments (after base.yml) for one run."""
    fixed = {"hardware": "cpu", "skip_jax_distributed_system": "true", "dataset_type": "synthetic",
             "enable_checkpointing": "false", "jax_cache_dir": "", "log_period": 1, "enable_tensorboard": "false",
             "dtype": "float32", "weight_dtype": "float32", "remat_policy": REMAT["maxtext"], "packing": "false",
             "attention": "dot_product", "enable_dropout": "false", "run_name": run_name,
             "base_output_directory": output_dir, "max_target_length": SEQ,
             "per_device_batch_size": BATCH // DEVICES, "steps": steps, "learning_rate": LR,
             "warmup_steps_fraction": WARMUP_FRACTION, "learning_rate_final_fraction": 0.1,
             "adam_b1": 0.9, "adam_b2": 0.95, "adam_eps": 1e-8, "adam_weight_decay": 0.1,
             "gradient_clipping_threshold": 1.0}
    keys = fixed | maxtext_model_keys(model_config(size, mesh.moe)) | mesh.maxtext
    return [f"{k}={v}" for k, v in keys.items()]


# ---- reading what each side printed -----------------------------------------------------------

_STEP = re.compile(r"completed step: (\d+), seconds: ([0-9.]+),.*?(?:^|[ ,])loss: ([-+0-9.eEnaif]+)")
_BYTES = re.compile(r"compiled memory \[train\]: (\d+) bytes")
_GB = re.compile(r"\[train\] Total estimated memory size: ([0-9.]+) GB")
_STAMP = re.compile(r"[IWEF]\d{4} (\d\d):(\d\d):(\d\d(?:\.\d+)?) ")      # absl: I1202 06:49:28.583349
_ERROR = re.compile(r"(Error|Exception|error:|FAILED|Traceback)")


def parse_maxtext_log(text: str) -> dict:
    """{"seconds": [per step], "losses": [per step], "logged_at": [per step], "memory_bytes":
    int or None} from MaxText's log: the `completed step` lines in step order (logged_at:
    the absl time stamp of each line, in seconds since midnight; None without one), and
    the train step's compiled memory (exact bytes from this launcher's line, else
    MaxText's own GB figure)."""
    steps = {}
    for line in text.splitlines():
        match = _STEP.search(line)
        if match:
            stamp = _STAMP.match(line)
            logged_at = None if stamp is None else (
                3600 * int(stamp.group(1)) + 60 * int(stamp.group(2)) + float(stamp.group(3)))
            steps[int(match.group(1))] = (float(match.group(2)), float(match.group(3)), logged_at)
    memory = _BYTES.search(text)
    if memory:
        memory_bytes = int(memory.group(1))
    else:
        gb = _GB.search(text)
        memory_bytes = round(float(gb.group(1)) * 2 ** 30) if gb else None
    order = sorted(steps)
    return {"seconds": [steps[s][0] for s in order], "losses": [steps[s][1] for s in order],
            "logged_at": [steps[s][2] for s in order], "memory_bytes": memory_bytes}


def log_intervals(logged_at: list) -> list[float]:
    """Seconds between consecutive `completed step` lines (the first entry: 0.0, as the
    first line has nothing before it); empty when a line has no time stamp."""
    if not logged_at or None in logged_at:
        return []
    return [0.0] + [(after - before) % 86400 for before, after in zip(logged_at, logged_at[1:])]


def last_error_line(text: str, limit: int = 160) -> str:
    """The last line of a failed run's output that names an error (else its last line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR.search(line) and not line.startswith("Traceback")]
    line = (errors or lines or ["no output"])[-1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def steady_ms(runs: list[list[float]]) -> float | None:
    """The median step time in ms over every run's steps after its first COMPILE_STEPS."""
    steady = [s for run in runs for s in run[COMPILE_STEPS:]]
    return 1e3 * statistics.median(steady) if steady else None


# ---- running each side ------------------------------------------------------------------------

def device_env() -> dict:
    """The environment both sides run in: 8 fake CPU devices and no other XLA flag."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu",
               DECOUPLE_GCLOUD="TRUE")
    return env


def maxtext_base_config(venv: str) -> str | None:
    """MaxText's configs/base.yml inside the package installed in `venv` (None: not installed)."""
    found = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "maxtext", "configs", "base.yml")))
    return found[-1] if found and os.access(os.path.join(venv, "bin", "python"), os.X_OK) else None


# Runs MaxText's pre-training entry point as `python -m maxtext.trainers.pre_train.train`
# does, after one addition: MaxText prints the compiled step's memory in GB to one decimal
# (0.0 GB at these sizes), so its printer also prints the same sum in bytes first.
_LAUNCHER = """
import sys
from absl import app
from maxtext.utils import max_utils
_print_gb = max_utils.print_compiled_memory_stats
def _print_bytes(stats, prefix=""):
    if stats is not None:
        total = (stats.output_size_in_bytes + stats.temp_size_in_bytes + stats.argument_size_in_bytes
                 - stats.alias_size_in_bytes)
        print(f"compiled memory [{prefix}]: {total} bytes", flush=True)
    return _print_gb(stats, prefix=prefix)
max_utils.print_compiled_memory_stats = _print_bytes
from maxtext.trainers.pre_train import train
app.run(train.main, argv=sys.argv)
"""


@dataclasses.dataclass
class Run:
    """One side's run of one mesh: per-step seconds and losses, memory, or the error."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    memory_bytes: int | None = None
    error: str | None = None
    wall_s: float = 0.0
    intervals: list[float] = dataclasses.field(default_factory=list)   # MaxText: between its step lines


def run_maxtext(mesh: Mesh, size: str, steps: int, venv: str, workdir: str, round_index: int) -> Run:
    """MaxText on `mesh` for `steps` steps, in its venv; its log kept in `workdir`."""
    base = maxtext_base_config(venv)
    name = f"{_slug(mesh.name)}-{size}-r{round_index}"
    command = [os.path.join(venv, "bin", "python"), "-c", _LAUNCHER, base,
               *maxtext_args(mesh, size, steps, run_name=name, output_dir=os.path.join(workdir, "out"))]
    text, code, wall = _run_logged(command, os.path.join(workdir, f"maxtext-{name}.log"), cwd=workdir)
    parsed = parse_maxtext_log(text)
    run = Run(seconds=parsed["seconds"], losses=parsed["losses"], memory_bytes=parsed["memory_bytes"], wall_s=wall,
              intervals=log_intervals(parsed["logged_at"]))
    if code != 0 or len(run.seconds) < steps:
        run.error = last_error_line(text) if code != 0 else f"logged {len(run.seconds)} of {steps} steps"
    return run


def run_jaxpar(mesh: Mesh, size: str, steps: int, workdir: str, round_index: int) -> Run:
    """jaxpar on `mesh`: this file's --worker mode in a fresh process of this interpreter."""
    unavailable = jaxpar_unavailable(mesh)
    if unavailable:
        return Run(error=unavailable)
    name = f"{_slug(mesh.name)}-{size}-r{round_index}"
    command = [sys.executable, "-m", "benchmarks.maxtext", "--worker", "jaxpar", "--mesh", mesh.name,
               "--size", size, "--steps", str(steps), "--json"]
    repo = str(Path(__file__).resolve().parent.parent)
    text, code, wall = _run_logged(command, os.path.join(workdir, f"jaxpar-{name}.log"), cwd=repo)
    result = _last_json(text)
    if code != 0 or result is None:
        return Run(error=last_error_line(text), wall_s=wall)
    return Run(seconds=result["seconds"], losses=result["losses"], memory_bytes=result["memory_bytes"],
               error=result.get("error"), wall_s=wall)


def jaxpar_unavailable(mesh: Mesh) -> str | None:
    """Why jaxpar cannot run `mesh`'s spec here (None: it can), found without compiling:
    "failed: " and the ConfigError's message."""
    try:
        ParallelSpec(**mesh.jaxpar, recompute=REMAT["jaxpar"])
    except ConfigError as error:
        return f"failed: {error}"
    return None


def _run_logged(command: list[str], log_path: str, cwd: str) -> tuple[str, int, float]:
    """(output, exit code, seconds) of `command`, stdout and stderr together, also kept at log_path."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=device_env(), cwd=cwd,
                                  timeout=RUN_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\nTimeoutError: no result after {RUN_TIMEOUT_S} s\n")
            code = -1
    return Path(log_path).read_text(errors="replace"), code, time.perf_counter() - start


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# ---- the jaxpar worker (runs in its own process) -----------------------------------------------

def jaxpar_worker(mesh: Mesh, size: str, steps: int) -> dict:
    """{"seconds", "losses", "memory_bytes"}: `steps` steps of the Trainer on one repeated
    batch, each timed until its loss is on the host; memory from the compiled step."""
    cfg = model_config(size, mesh.moe)
    trainer = Trainer(cfg, ParallelSpec(**mesh.jaxpar, recompute=REMAT["jaxpar"]), optim_config(steps),
                      batch_size=BATCH, seq_len=SEQ)
    stats = trainer.compiled.memory_analysis()
    memory_bytes = int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
                       - stats.alias_size_in_bytes)
    tokens = trainer.put(Corpus(vocab=cfg.vocab).batch(0, batch_size=BATCH, seq_len=SEQ))
    state = trainer.init(jax.random.key(0))
    seconds, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer.step(state, tokens)
        losses.append(float(metrics["loss"]))
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds, "losses": losses, "memory_bytes": memory_bytes}


# ---- the comparison ----------------------------------------------------------------------------

def compare(meshes, size: str, steps: int, rounds: int, venv: str, workdir: str, progress=None) -> list[dict]:
    """One row per mesh (see `row`), MaxText and jaxpar alternated mesh by mesh, `rounds` times."""
    runs = {m.name: {"maxtext": [], "jaxpar": []} for m in meshes}
    for round_index in range(rounds):
        for mesh in meshes:
            for side in ("maxtext", "jaxpar"):
                if side == "maxtext":
                    run = run_maxtext(mesh, size, steps, venv, workdir, round_index)
                else:
                    run = run_jaxpar(mesh, size, steps, workdir, round_index)
                runs[mesh.name][side].append(run)
                if progress:
                    progress(f"round {round_index + 1}/{rounds} {mesh.name} {side}: "
                             + (run.error or f"{steady_ms([run.seconds]) or float('nan'):.1f} ms") +
                             f" ({run.wall_s:.0f} s)")
    return [row(m.name, runs[m.name]["maxtext"], runs[m.name]["jaxpar"]) for m in meshes]


def row(mesh_name: str, maxtext_runs: list[Run], jaxpar_runs: list[Run]) -> dict:
    """The table's row of one mesh from each side's runs (a side with an error in any round
    shows the first error instead of a time)."""
    sides = {}
    for side, runs in (("MaxText", maxtext_runs), ("jaxpar", jaxpar_runs)):
        failed = next((r.error for r in runs if r.error), None)
        ms = None if failed else steady_ms([r.seconds for r in runs])
        first_loss = next((r.losses[0] for r in runs if r.losses), None)
        memory = next((r.memory_bytes for r in runs if r.memory_bytes is not None), None)
        shown = failed if failed and failed.startswith("failed:") else (
            f"failed: {failed}" if failed else ms)
        sides[side] = {"ms": shown, "first_loss": first_loss, "memory_bytes": memory}
    mt, jp = sides["MaxText"]["ms"], sides["jaxpar"]["ms"]
    ratio = jp / mt if isinstance(mt, float) and isinstance(jp, float) else None
    intervals = [r.intervals for r in maxtext_runs if not r.error and r.intervals]
    return {"mesh": mesh_name, "MaxText ms": mt, "jaxpar ms": jp, "jaxpar / MaxText": ratio,
            "MaxText ms between step lines": steady_ms(intervals) if intervals else None,
            "first loss MaxText": sides["MaxText"]["first_loss"], "first loss jaxpar": sides["jaxpar"]["first_loss"],
            "memory MaxText bytes": sides["MaxText"]["memory_bytes"],
            "memory jaxpar bytes": sides["jaxpar"]["memory_bytes"]}


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table: mesh | MaxText ms | jaxpar ms | ratio | first losses | memory."""
    lines = ["| mesh | MaxText ms | jaxpar ms | jaxpar / MaxText | first loss (MaxText / jaxpar) "
             "| memory per device, MiB (MaxText / jaxpar) |", "|---|---|---|---|---|---|"]
    for r in rows:
        losses = f"{_num(r['first loss MaxText'], '.3f')} / {_num(r['first loss jaxpar'], '.3f')}"
        memory = f"{_mib(r['memory MaxText bytes'])} / {_mib(r['memory jaxpar bytes'])}"
        lines.append(f"| {r['mesh']} | {_num(r['MaxText ms'], '.1f')} | {_num(r['jaxpar ms'], '.1f')} | "
                     f"{_num(r['jaxpar / MaxText'], '.2f')} | {losses} | {memory} |")
    return "\n".join(lines)


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt) if isinstance(value, float) else str(value).replace("|", "/")


def _mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2 ** 20:.1f}"


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def not_installed_message(venv: str) -> str:
    return (f"MaxText is not installed in {venv}: skipped. Install it with `python3.12 -m venv {venv} && "
            f"{venv}/bin/pip install \"maxtext[tpu]=={MAXTEXT_VERSION}\"`, or point --maxtext-venv (or "
            "MAXTEXT_VENV) at a venv that has it.")


def run() -> list[dict]:
    """`python -m benchmarks.run maxtext`: the default comparison (one row saying why, when skipped)."""
    venv = os.environ.get("MAXTEXT_VENV", DEFAULT_VENV)
    if maxtext_base_config(venv) is None:
        return [{"skipped": not_installed_message(venv)}]
    with tempfile.TemporaryDirectory(prefix="maxtext-bench-") as workdir:
        return compare(MESHES, "default", steps=12, rounds=2, venv=venv, workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.maxtext", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side per mesh, alternated (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="steps per run; the first 2 are left out (default 12)")
    parser.add_argument("--mesh", action="append", choices=list(BY_NAME), help="only these meshes (repeatable)")
    parser.add_argument("--maxtext-venv", default=os.environ.get("MAXTEXT_VENV", DEFAULT_VENV),
                        help=f"the venv MaxText is installed in (default $MAXTEXT_VENV or {DEFAULT_VENV})")
    parser.add_argument("--logs", help="keep every run's log in this folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--worker", choices=["jaxpar"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= COMPILE_STEPS or args.rounds < 1:
        parser.error(f"--steps must be more than {COMPILE_STEPS} (the compile steps left out) and --rounds >= 1")
    meshes = [BY_NAME[name] for name in args.mesh] if args.mesh else list(MESHES)
    if args.worker:
        print(json.dumps(jaxpar_worker(meshes[0], args.size, args.steps)))
        return 0
    if maxtext_base_config(args.maxtext_venv) is None:
        print(not_installed_message(args.maxtext_venv))
        return 0
    progress = None if args.json else _print_progress
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        rows = compare(meshes, args.size, args.steps, args.rounds, args.maxtext_venv, args.logs, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="maxtext-bench-") as workdir:
            rows = compare(meshes, args.size, args.steps, args.rounds, args.maxtext_venv, workdir, progress)
    if args.json:
        print(json.dumps({"size": args.size, "steps": args.steps, "rounds": args.rounds, "rows": rows}, indent=2))
    else:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
