"""Is the program benchmarks.gpu timed on a GPU still the program this commit builds?
Answered on any machine: each model's training step lowered for CUDA (cuDNN attention,
as on an H100 / H200), counted op by op.

    PYTHONPATH=. python -m benchmarks.gpu_program --out DIR                 DIR/gpu_program.json
    PYTHONPATH=. python -m benchmarks.gpu_program --against OLD.json        what changed since OLD

A step's census is its StableHLO for CUDA with names and locations dropped: each line
(an op with its operand and result types) and how often it occurs. Two commits whose
censuses agree run the same computation (the same matmuls, the same attention calls,
the same collectives) up to the order of the text, so a figure measured at one holds for
the other; `--against` lists the lines whose counts differ, per model. Nothing runs:
cross-platform lowering builds the program (about 10 s per model on 2 CPU cores).

To lower cuDNN's attention without a GPU, the two checks JAX makes at trace time (cuDNN
is installed; the device's compute capability) are answered as an H200 would answer
them: cuDNN 9.15, compute capability 9.0. They are JAX internals; where a release moves
them this says so. On a GPU nothing is stood in, and benchmarks/gpu_check.sh writes the
census of the commit it times beside its figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys

import jax
from jax._src.cudnn import fused_attention_stablehlo as cudnn    # JAX's own checks, answered below

from benchmarks.gpu import MODELS, trainer_for
from jaxpar.kernels import attention

CUDNN_VERSION = 91500                # what the H200 machine's jax reports (cuDNN 9.15)
COMPUTE_CAPABILITY = (9, 0)          # Hopper


@contextlib.contextmanager
def as_on_a_hopper_gpu():
    """Within: the attention chooses, and JAX lowers, cuDNN's flash attention as on an H200
    (on a GPU, as that GPU does: nothing is stood in)."""
    if jax.default_backend() == "gpu":
        yield
        return
    answers = {"check_cudnn_version": lambda: CUDNN_VERSION,
               "check_compute_capability": lambda c: COMPUTE_CAPABILITY >= tuple(int(x) for x in c.split(".")),
               "is_cuda_compute_capability_equal": lambda c: tuple(int(x) for x in c.split(".")) == COMPUTE_CAPABILITY}
    missing = [name for name in answers if not hasattr(cudnn, name)]
    if missing:
        raise SystemExit(f"benchmarks.gpu_program: jax {jax.__version__} has no {missing} in its cuDNN module; "
                         "this check needs updating for it")
    saved = {name: getattr(cudnn, name) for name in answers} | {"_platform": attention._platform}
    for name, answer in answers.items():
        setattr(cudnn, name, answer)
    attention._platform = lambda platform=None: "gpu"
    try:
        yield
    finally:
        attention._platform = saved.pop("_platform")
        for name, original in saved.items():
            setattr(cudnn, name, original)


def census(text: str) -> dict[str, int]:
    """Each line of the StableHLO text, with its count: SSA names, function names and locations
    dropped (custom calls keep their targets: cuDNN's attention, a Triton kernel)."""
    lines = collections.Counter()
    for line in text.splitlines():
        if line.startswith("#loc"):
            continue
        line = re.sub(r" loc\([^)]*\)", "", line.strip())
        line = re.sub(r"%[\w#.:]+", "%", line)
        # a function's own name (its definition, a call of it), not a custom call's target
        line = re.sub(r"(?<![\w.])((?:call|func\.func(?: public| private)?) )@[\w.$-]+", r"\1@f", line)
        lines[line] += 1
    return dict(lines)


def step_census(name: str) -> dict[str, int]:
    """benchmarks.gpu's model `name`, the trainer its figures time (gpu.trainer_for), lowered for CUDA."""
    trainer = trainer_for(name)
    return census(trainer._step.trace(*trainer.abstract_inputs()).lower(lowering_platforms=("cuda",)).as_text())


def differences(old: dict[str, int], new: dict[str, int]) -> list[str]:
    """The lines whose counts differ, as '+N line' (N more in new) or '-N line'."""
    return [f"{new.get(line, 0) - old.get(line, 0):+d} {line[:200]}" for line in sorted(set(old) | set(new))
            if new.get(line, 0) != old.get(line, 0)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write DIR/gpu_program.json")
    ap.add_argument("--against", default=None, help="a gpu_program.json written at another commit")
    ap.add_argument("--only", default=None, help="comma-separated models of benchmarks.gpu.MODELS")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(MODELS)
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        print(f"benchmarks.gpu_program: unknown model(s) {unknown}; the models are {sorted(MODELS)}")
        return 2
    with as_on_a_hopper_gpu():
        models = {name: step_census(name) for name in names}
        cudnn_version = cudnn.check_cudnn_version()
    result = {"commit": os.environ.get("JAXPAR_COMMIT"), "jax": jax.__version__, "backend": jax.default_backend(),
              "cudnn": cudnn_version, "models": models}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_program.json"), "w") as f:
            json.dump(result, f)
    against = json.load(open(args.against)) if args.against else None
    for name, lines in result["models"].items():
        ops = sum(lines.values())
        if against is None:
            print(f"{name:<16} {ops} lines")
            continue
        old = against["models"].get(name)
        if old is None:
            print(f"{name:<16} {ops} lines; not in {against.get('commit') or args.against}'s census")
            continue
        diff = differences(old, lines)
        print(f"{name:<16} {ops} lines; against {against.get('commit') or args.against}: "
              f"{'the same' if not diff else f'{len(diff)} lines differ in count'}")
        for line in diff[:12] + ([f"... {len(diff) - 12} more"] if len(diff) > 12 else []):
            print("    " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
