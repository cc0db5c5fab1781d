"""How much of the hardware a training run uses: model FLOPs per token, the devices' peak
FLOP/s, and MFU (model FLOPs utilization); and what a profile says of communication.

    flops_per_token(cfg, seq_len)                    # training FLOPs per token (6N + 12·L·N·H·T)
    peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")  # 989e12; None where unknown (CPU)
    mfu(tokens_per_s, cfg, seq_len, n_devices, device_kind, dtype)    # 0.41, or None

The count is PaLM's (Chowdhery et al. 2022, appendix B; the same as Chinchilla's
"6N" rule with attention added): a training step's matmul FLOPs per token are

    6 · N  +  12 · L · N_heads · head_dim · T

N is the number of weights each token multiplies by (a matmul's 2 FLOPs per
multiply-add forward, 4 backward: the gradient for its input and for its weight):
per layer the projections wq, wk, wv, wo (grouped-query: wk and wv have the KV heads'
width), the MLP (w_up, w_down, and SwiGLU's w_gate), and with experts the router plus
the MLPs of the top_k experts a token is sent to (not all of them: MoE MFU counts the
active parameters); once, the output head (D x V). The input embedding is a table
lookup, no matmul, and is not counted. The attention term is the score and
value matmuls, Q·K^T and A·V (2·T·N_heads·head_dim multiply-adds per token per layer,
forward): counted over the whole T x T square, as PaLM counts it, although a causal
mask leaves about half of it unused. Elementwise work (norms, softmax, RoPE, the
loss) is left out: MFU is the model's matmul FLOPs, the definition PaLM gives. (The
package's reference MoE runs every expert on every token to stay simple; the count
is that of a routed model, the computation an MoE is built to do.)

MFU = tokens/s x flops_per_token / (devices x peak FLOP/s per device). The peaks are
the vendors' dense (no sparsity) tensor-core/MXU figures for the dtype; float32
dots run on GPUs at TF32's rate under JAX's default precision, and on TPUs as one
bfloat16 pass, so float32 gets those rates. Where the device is unknown (CPU, any
kind not in `PEAK_FLOPS`) MFU is None: printed as "n/a", never guessed.
"""

from __future__ import annotations

import re

import jax

from jaxpar import comms
from jaxpar.reference import ModelConfig

# (device_kind substring, lower case) -> {dtype name: dense peak FLOP/s of one device}, first match wins.
# NVIDIA: the data sheets' dense tensor-core figures (bf16; float32 at TF32's rate).
# TPU: Google Cloud's per-chip bf16 peaks (float32 dots run as one bf16 pass by default).
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h100 pcie", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12}),     # SXM
    ("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12}),     # the H100 SXM's core
    ("gh200", {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12}),
    ("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("tpu v4", {"bfloat16": 275e12, "float32": 275e12}),
    ("tpu v5 lite", {"bfloat16": 197e12, "float32": 197e12}),                     # v5e
    ("tpu v5e", {"bfloat16": 197e12, "float32": 197e12}),
    ("tpu v5p", {"bfloat16": 459e12, "float32": 459e12}),
    ("tpu v5", {"bfloat16": 459e12, "float32": 459e12}),                          # v5p reports "TPU v5"
    ("tpu v6 lite", {"bfloat16": 918e12, "float32": 918e12}),                     # v6e (Trillium)
)


def matmul_params(cfg: ModelConfig) -> int:
    """N: the weights one token is multiplied by in the forward pass (see the module
    docstring): attention projections, the MLP (top_k experts' and the router with
    experts) per layer, and the output head; not the input embedding."""
    heads = cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.d_model * heads + 2 * cfg.d_model * kv + heads * cfg.d_model
    one_mlp = (3 if cfg.mlp == "swiglu" else 2) * cfg.d_model * cfg.d_ff
    if cfg.n_experts:
        mlp = cfg.top_k * one_mlp + cfg.d_model * cfg.n_experts
    else:
        mlp = one_mlp
    return cfg.n_layers * (attention + mlp) + cfg.d_model * cfg.vocab


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Forward FLOPs per token of Q·K^T and A·V: 4 · L · N_heads · head_dim · T."""
    return 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """2 · N + 4 · L · N_heads · head_dim · T: the forward pass's matmul FLOPs per token."""
    return 2 * matmul_params(cfg) + attention_flops_per_token(cfg, seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """6 · N + 12 · L · N_heads · head_dim · T: a training step's matmul FLOPs per token
    (forward, and backward twice the forward)."""
    return 3 * forward_flops_per_token(cfg, seq_len)


def peak_flops(device_kind: str, dtype) -> float | None:
    """Dense peak FLOP/s of one device of `device_kind` (jax's `Device.device_kind`) for
    matmuls in `dtype`; None where not known (CPU, an unlisted device or dtype)."""
    kind = str(device_kind).lower()
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    for key, peaks in PEAK_FLOPS:
        if key in kind:
            return peaks.get(str(name))
    return None


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, n_devices: int, device_kind: str,
        dtype) -> float | None:
    """Model FLOPs utilization: tokens_per_s x flops_per_token / (n_devices x peak);
    None where the peak is unknown."""
    peak = peak_flops(device_kind, dtype)
    if peak is None or n_devices < 1:
        return None
    return tokens_per_s * flops_per_token(cfg, seq_len) / (n_devices * peak)


def format_mfu(value: float | None) -> str:
    """'41.2%' or 'n/a'."""
    return "n/a" if value is None else f"{100 * value:.1f}%"


# ---- what a profile says ------------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^)]*\)|\S+)\s+([\w\-]+)\(", re.M)


def instruction_kinds(hlo: str) -> dict[str, str]:
    """{instruction name: opcode} of every instruction in an optimised HLO module's text."""
    return {name: opcode for name, opcode in _INSTRUCTION.findall(hlo)}


def is_collective(opcode: str) -> bool:
    """Whether an HLO opcode is a collective (all-reduce, all-gather, reduce-scatter,
    all-to-all, collective-permute, or an asynchronous one's -start / -done)."""
    return opcode.removesuffix("-start").removesuffix("-done") in comms.KINDS


# the line of a GPU's or TPU's plane in a trace that holds one event per HLO instruction
# run (its other lines hold kernels, modules, steps); CPU traces have none: their op
# events are on the threads that ran them
DEVICE_OPS_LINE = "XLA Ops"


def collective_time(profile_file: str, hlo: str) -> dict[str, float] | None:
    """{"collective_s", "op_s", "fraction"} from a profile (`jax.profiler.trace`'s
    .xplane.pb) of runs of the program whose HLO is `hlo`: the summed durations of the
    events named after the program's instructions, over every device (the devices'
    "XLA Ops" lines; on CPU, every thread that ran one), and the part of it in
    collectives (waiting for the rest of the group included). Only innermost events
    count: a loop's or a branch's event holds its body's, which count themselves. None
    when no event of the program is in the file."""
    kinds = instruction_kinds(hlo)
    lines = [line for plane in jax.profiler.ProfileData.from_file(profile_file).planes for line in plane.lines]
    device_ops = [line for line in lines if line.name == DEVICE_OPS_LINE]
    collective = total = 0
    for line in device_ops or lines:
        for start, end, opcode in _innermost(line, kinds):
            total += end - start
            if is_collective(opcode):
                collective += end - start
    if not total:
        return None
    return {"collective_s": collective * 1e-9, "op_s": total * 1e-9, "fraction": collective / total}


def _innermost(line, kinds: dict[str, str]) -> list[tuple[int, int, str]]:
    """(start ns, end ns, opcode) of the events on one line of a trace named after an
    instruction in `kinds`, leaving out each that encloses the next (one line runs one op
    at a time, so an event that overlaps the next holds it: a loop, a branch)."""
    ops = sorted(((event.start_ns, event.end_ns, kinds[event.name]) for event in line.events
                  if event.name in kinds), key=_start_then_longest)
    return [op for k, op in enumerate(ops) if not (k + 1 < len(ops) and ops[k + 1][0] < op[1])]


def _start_then_longest(op: tuple[int, int, str]) -> tuple[int, int]:
    return op[0], -op[1]


def collective_bytes(collectives: dict) -> float:
    """Bytes of collectives per step on one device, from `summary.collectives`' counts of
    the compiled step: the pipeline sends, the all-reduces outside the pipeline loop,
    ZeRO-1's reduce-scatter and all-gather, and the collectives inside the stages of the
    busiest pp rank. Counted, not timed: what a profile cannot give, the program can."""
    stages = max((sum(b for _, b in got.values()) for got in collectives["stages"].values()), default=0)
    return (sum(b for _, b in collectives["sends"].values()) + sum(collectives["reductions"].values())
            + sum(collectives["zero"].values()) + stages)
