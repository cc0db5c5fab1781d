"""How the model is split: one `ParallelSpec`, checked against the model and the batch.

    spec = ParallelSpec(dp=2, pp=2, tp=2, schedule="1f1b", microbatches=4)
    spec.check(cfg, batch_size=16, seq_len=32)    # ConfigError listing EVERY violation
    mesh = spec.mesh()                            # dp x pp x cp x ep x tp (tp innermost)

The mesh has every axis of the spec (size-1 axes too, so one step serves every spec).
Expert parallelism shares the data-parallel devices' role: the batch is split over
(dp, ep), expert weights over ep, every other weight replicated over ep, so a device
count is dp x pp x cp x ep x tp. `parse("dp=2,pp=2,tp=2")` reads the CLI's --mesh.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxpar import errors, reference
from jaxpar import mesh as mesh_lib
from jaxpar.errors import ConfigError, is_whole
from jaxpar.pipeline import stage_layers
from jaxpar.schedules import orders
from jaxpar.schedules import schedule as schedule_lib

# The trainer's axes and what each splits: the one table the rest reads. The batch's rows
# (`recipe.batch_pspecs`, the gradient reduction over the batch axes), the layers (the
# pipeline), the sequence (context), the heads and d_ff (tensor). Mesh order (tp innermost)
# is mesh.AXIS_ORDER's.
SPLITS = {mesh_lib.DP: "rows", mesh_lib.PP: "layers", mesh_lib.CP: "sequence", mesh_lib.EP: "rows",
          mesh_lib.TP: "heads"}
AXES = tuple(a for a in mesh_lib.AXIS_ORDER if a in SPLITS)
BATCH_AXES = tuple(a for a in AXES if SPLITS[a] == "rows")      # (dp, ep): the batch's rows
ATTENTION = ("ring", "ulysses")
LAYOUTS = ("contiguous", "zigzag")
FLOAT32_MAX = float(np.finfo(np.float32).max)     # a weight past it (aux_loss=1e300) is inf in a float32 step
# What B runs again of F: the glossary's words (memory.activations counts "selective" too)
RECOMPUTE = ("none", "full", "dots")
ZERO = (0, 1, 2, 3)           # ZeRO stages: what is sharded over dp (data.zero)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """dp, pp, tp, cp, ep: the mesh. schedule, chunks (model chunks per device; None:
    the schedule's own), microbatches: the pipeline. sequence_parallel: Megatron's SP on
    the tp axis. recompute (RECOMPUTE): "none" (keep every residual of F for B), "full"
    (keep only each stage's input, run F again in B) or "dots" (keep the outputs of the matmuls without
    batch dimensions and of the collectives, recompute the rest in B: MaxText's
    remat_policy=minimal, with no collective run again). zero: 0, 1
    (ZeRO-1: optimizer state sharded over dp), 2 (ZeRO-2: and the gradients; in one
    compiled step the same program as 1) or 3 (ZeRO-3 / FSDP: and the weights, gathered
    layer by layer; not with recompute or a split backward). attention: ring or ulysses
    over cp; layout: the ring's token order (zigzag balances causal work).
    layers_per_stage: uneven stages, the layers of each of the pp*chunks model stages in
    model order, e.g. (1, 2, 2, 1) (the first and last stages also run the embedding and
    the LM head); None: n_layers / (pp*chunks) each."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    chunks: int | None = None
    microbatches: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    zero: int = 0
    attention: str = "ring"
    layout: str = "contiguous"
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.layers_per_stage, list):        # a list reads as the tuple (a spec is hashed)
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        problems = []
        for name in AXES + ("microbatches",):
            value = getattr(self, name)
            if not is_whole(value) or not 1 <= value <= mesh_lib.MAX_DEVICES:
                problems.append(f"{name}={value!r} must be a whole number in 1..{mesh_lib.MAX_DEVICES}")
        if self.chunks is not None and (not is_whole(self.chunks) or not 1 <= self.chunks <= 64):
            problems.append(f"chunks={self.chunks!r} must be None (the schedule's own) or a whole number in 1..64")
        if not isinstance(self.sequence_parallel, bool):
            problems.append(f"sequence_parallel={self.sequence_parallel!r} must be True or False")
        if isinstance(self.recompute, bool):           # the words before the glossary's, read as they meant
            object.__setattr__(self, "recompute", "full" if self.recompute else "none")
        if self.recompute not in RECOMPUTE:
            problems.append(f"recompute={self.recompute!r} must be 'none' (keep every residual), 'full' (keep each "
                            "stage's input, run F again in B) or 'dots' (keep the matmuls' and collectives' "
                            "outputs, recompute the rest)")
        if self.zero not in ZERO or isinstance(self.zero, bool):
            problems.append(f"zero={self.zero!r} must be one of {', '.join(map(str, ZERO))}: 0 (replicated "
                            "optimizer state), 1 (ZeRO-1: the optimizer state sharded over dp), 2 (ZeRO-2: and "
                            "the gradients), 3 (ZeRO-3 / FSDP: and the weights, gathered layer by layer)")
        problems += self._uneven_problems()
        if self.attention not in ATTENTION:
            problems.append(f"attention={self.attention!r} must be one of {', '.join(ATTENTION)}")
        if self.layout not in LAYOUTS:
            problems.append(f"layout={self.layout!r} must be one of {', '.join(LAYOUTS)}")
        if not isinstance(self.schedule, str) or self.schedule not in orders.REGISTRY:
            problems.append(f"schedule={self.schedule!r} must be one of {', '.join(orders.REGISTRY)}")
        _raise(problems, "ParallelSpec")

    def _uneven_problems(self) -> list[str]:
        """What uneven stages (layers_per_stage) cannot be combined with, each with its reason."""
        counts = self.layers_per_stage
        if counts is None:
            return []
        if not isinstance(counts, tuple) or not all(is_whole(c) and c >= 1 for c in counts):
            return [f"layers_per_stage={counts!r} must be None or a tuple of whole numbers >= 1, one per model "
                    "stage (pp*chunks), e.g. (1, 2, 2, 1)"]
        if len(set(counts)) <= 1:
            return []
        out = []
        if self.pp == 1:
            out.append(f"layers_per_stage={counts} with pp=1: one device runs every layer, there is no stage to "
                       "balance. Fix: pp > 1, or layers_per_stage=None")
        return out

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def describe(self) -> str:
        parts = [f"{a}{n}" for a, n in self.sizes.items() if n > 1] or ["1 device"]
        extra = [self.schedule if self.pp > 1 else None,
                 "layers " + "/".join(map(str, self.layers_per_stage)) if self.uneven else None,
                 "sp" if self.sequence_parallel and self.tp > 1 else None,
                 f"zero{self.zero}" if self.zero else None, self.attention if self.cp > 1 else None,
                 self.layout if self.cp > 1 and self.layout != "contiguous" else None,
                 {"full": "recompute", "dots": "recompute dots"}.get(self.recompute)]
        return " x ".join(parts) + "".join(f" {e}" for e in extra if e)

    def ignored(self) -> list[str]:
        """The options this mesh leaves with nothing to do, each with why: accepted (one spec serves
        every mesh, and each runs as the spec without it would), and said in the run's summary."""
        out = []
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel=True with tp=1: one tp device holds the whole sequence, SP is off")
        context = [f"{k}={v!r}" for k, v in (("attention", self.attention), ("layout", self.layout))
                   if v not in ("ring", "contiguous")]
        if self.cp == 1 and context:
            out.append(f"{' and '.join(context)} with cp=1: no context parallelism, each device attends over its "
                       "whole sequence")
        if self.pp == 1 and self.schedule != "1f1b":
            out.append(f"schedule={self.schedule!r} with pp=1: one stage, no pipeline schedule runs")
        if self.zero and self.dp == 1:
            out.append(f"zero={self.zero} with dp=1: nothing is split over one data-parallel device")
        return out

    def make_schedule(self) -> schedule_lib.Schedule:
        return schedule_lib.make(self.schedule, stages=self.pp, microbatches=self.microbatches,
                                 chunks=self.chunks)

    @property
    def uneven(self) -> bool:
        """Whether the stages hold different numbers of layers (`layers_per_stage`)."""
        return self.layers_per_stage is not None and len(set(self.layers_per_stage)) > 1

    @property
    def resolved_chunks(self) -> int:
        """`chunks` with None resolved: the chunks per device the schedule runs."""
        return orders.lookup(self.schedule).chunks if self.chunks is None else self.chunks

    def mesh(self, devices=None):
        """The mesh of this spec over `devices` (default: all of jax.devices())."""
        devices = device_list(devices)
        if len(devices) != self.devices:
            raise ConfigError(f"{self.describe()} needs {self.devices} devices, {len(devices)} are available: "
                              f"choose sizes whose product is {len(devices)} (or start {self.devices} fake CPU "
                              f"devices: XLA_FLAGS=--xla_force_host_platform_device_count={self.devices})")
        return mesh_lib.make_mesh(devices=devices, **self.sizes)

    def problems(self, cfg: reference.ModelConfig, *, batch_size: int, seq_len: int,
                 n_devices: int | None = None) -> list[str]:
        """Every constraint this spec, `cfg` and a batch [batch_size, seq_len + 1] of token
        ids violate, each naming the values and a fix (empty: it fits): the device count,
        the layers over the stages, the model's sizes over tp and ep, the batch and the
        sequence over the mesh, and the schedule."""
        if not isinstance(cfg, reference.ModelConfig):
            return [f"cfg is a {type(cfg).__name__}, not a reference.ModelConfig"]
        out = [f"{name}={value!r} must be a whole number >= 1"
               for name, value in (("batch_size", batch_size), ("seq_len", seq_len)) if not is_whole(value) or value < 1]
        if out:
            return out
        if n_devices is not None and n_devices != self.devices:
            out.append(f"the mesh needs {'*'.join(AXES)} = {self.devices} devices, {n_devices} are available: "
                       f"choose sizes whose product is {n_devices}")
        out += [f"{name}={getattr(cfg, name)} is not finite in float32 (at most {FLOAT32_MAX:.4g}), the dtype the "
                "step computes in: give a smaller one"
                for name in ("aux_loss", "bias_rate", "rope_theta", "norm_eps") if getattr(cfg, name) > FLOAT32_MAX]
        out += self._layer_problems(cfg) + self._model_problems(cfg) + self._batch_problems(cfg, batch_size, seq_len)
        try:
            self.make_schedule()
        except ConfigError as e:
            out.append(f"schedule: {e}")
        return out

    def _layer_problems(self, cfg: reference.ModelConfig) -> list[str]:
        """The layers over the pp*chunks model stages: evenly, or as layers_per_stage says."""
        out = []
        stages = self.pp * self.resolved_chunks
        if self.layers_per_stage is not None:
            try:
                stage_layers.layer_split(self.layers_per_stage, cfg.n_layers, stages)
            except ConfigError as e:
                out.append(f"{e} (pp*chunks = {self.pp}*{self.resolved_chunks} model stages, n_layers={cfg.n_layers})")
        elif cfg.n_layers % stages:
            out.append(f"n_layers={cfg.n_layers} does not split into pp*chunks = {self.pp}*{self.resolved_chunks} "
                       f"= {stages} stages: use pp*chunks in ({errors.divisors(cfg.n_layers)}), or give "
                       f"layers_per_stage, e.g. {stage_layers.even_or_near(cfg.n_layers, stages) if cfg.n_layers >= stages else '(...)'}")
        return out

    def _model_problems(self, cfg: reference.ModelConfig) -> list[str]:
        """The model's sizes over tp (heads, KV heads, vocabulary, d_ff) and ep (experts)."""
        out = []
        tp = self.tp
        for name in ("n_heads", "vocab", "d_ff"):
            if getattr(cfg, name) % tp:
                out.append(f"{name}={getattr(cfg, name)} is not divisible by tp={tp}: each tp device holds "
                           f"{name}/tp of it. Fix: tp in ({errors.divisors(getattr(cfg, name))})")
        if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
            out.append(f"n_kv_heads={cfg.n_kv_heads} and tp={tp}: one must divide the other (KV heads split over "
                       f"tp, or each replicated over tp/K devices). Fix: tp in ({errors.divisors(cfg.n_kv_heads)}) "
                       f"or a multiple of {cfg.n_kv_heads}")
        if self.ep > 1 and not cfg.n_experts:
            out.append(f"ep={self.ep} but the model is dense (n_experts=0): expert parallelism splits experts. "
                       f"Fix: ep=1, or n_experts={self.ep} or more")
        if cfg.n_experts and cfg.n_experts % self.ep:
            out.append(f"n_experts={cfg.n_experts} is not divisible by ep={self.ep}: each ep device owns E/ep "
                       f"whole experts. Fix: ep in ({errors.divisors(cfg.n_experts)})")
        return out

    def _batch_problems(self, cfg: reference.ModelConfig, batch_size: int, seq_len: int) -> list[str]:
        """The batch over the batch axes (dp*ep) and the microbatches, the sequence over cp (zigzag) and SP's tp, and
        Ulysses' heads over cp."""
        out = []
        tp = self.tp
        splits = [*(getattr(self, a) for a in BATCH_AXES), self.microbatches]     # the batch's rows
        rows = math.prod(splits)
        if batch_size % rows:
            out.append(f"batch_size={batch_size} does not split into {'*'.join(BATCH_AXES)}*microbatches = "
                       f"{'*'.join(map(str, splits))} = {rows}: use a multiple of {rows}")
        per = self.cp * (2 if self.layout == "zigzag" and self.cp > 1 else 1) * (tp if self.sequence_parallel else 1)
        if seq_len % per:
            why = " x ".join(w for w in (f"cp={self.cp}", "2 (zigzag: two chunks per rank)" if per % 2 == 0 and
                                         self.layout == "zigzag" and self.cp > 1 else "",
                                         f"tp={tp} (sequence parallel)" if self.sequence_parallel else "") if w)
            out.append(f"seq_len={seq_len} is not divisible by {why} = {per}: use a multiple of {per}")
        if self.attention == "ulysses" and self.cp > 1:
            heads, kv = cfg.n_heads // tp, max(cfg.n_kv_heads // tp, 1)      # per tp device (KV: 1 when tp > K)
            if heads % self.cp:
                out.append(f"Ulysses over cp={self.cp} splits each tp device's n_heads/tp = {heads} heads: "
                           f"use cp dividing {heads}, or attention='ring'")
            if kv % self.cp and self.cp % kv:
                out.append(f"Ulysses over cp={self.cp} splits each tp device's {kv} KV heads cp ways or repeats "
                           f"each cp/{kv} times, so one of cp and {kv} must divide the other: use cp in "
                           f"({errors.divisors(kv)}) or a multiple of {kv}, or attention='ring'")
        return out

    def check(self, cfg: reference.ModelConfig, *, batch_size: int, seq_len: int, n_devices: int | None = None):
        """Raise one ConfigError listing every violated constraint (see `problems`)."""
        _raise(self.problems(cfg, batch_size=batch_size, seq_len=seq_len, n_devices=n_devices),
               f"{self.describe()} does not fit the model")
        return self


def device_list(devices) -> list:
    """`devices` as a list (None: all of jax.devices()), refused unless each is a jax.Device."""
    if devices is None:
        return list(jax.devices())
    found = None if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__") else list(devices)
    if found is None or not all(isinstance(d, jax.Device) for d in found):
        raise ConfigError(f"devices={devices!r:.80} is not a list of devices: pass jax.devices()[:n], or None (all)")
    return found


def _raise(problems: list[str], what: str) -> None:
    if problems:
        lines = "; ".join(f"({i + 1}) {p}" for i, p in enumerate(problems))
        raise ConfigError(f"{what}: {len(problems)} problem{'s' if len(problems) > 1 else ''}: {lines}")


def parse(text: str, **options) -> ParallelSpec:
    """'dp=2,pp=2,tp=2' (the CLI's --mesh) -> ParallelSpec(dp=2, pp=2, tp=2, **options)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--mesh {text!r}: give sizes like dp=2,pp=2,tp=2 (axes {', '.join(AXES)})")
    sizes = {}
    for part in text.replace(" ", "").split(","):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit():
            raise ConfigError(f"--mesh {text!r}: {part!r} is not axis=size with an axis in {', '.join(AXES)} "
                              "and a whole size, e.g. dp=2,pp=2,tp=2")
        if name in sizes:
            raise ConfigError(f"--mesh {text!r}: axis {name} given twice")
        sizes[name] = int(value)
    return ParallelSpec(**sizes, **options)

