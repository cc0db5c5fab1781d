"""Techniques composed (docs/train.md): the only package that imports several.

    spec        ParallelSpec: how the model is split; every violated constraint at once
    model       the model's parameters and how each is split (partition_names, zero3_dims)
    recipe      the step composed top down: one apply_* per technique (TP/SP, ring or Ulysses
                over cp, the MoE over ep, the pipeline, ZeRO, recompute, precision) on one
                description (Layers), assembled into what each device runs
    nnx_model   LanguageModel: the same parameters as a flax NNX module with that layout as
                partition metadata (a view for NNX users; the trainer runs plain dicts)
    step        Trainer: ONE jitted step, one shard_map over every axis (pipeline, one
                gradient reduction or ZeRO-1/2/3, global-norm clipping, AdamW), built by the recipe
    cache       TrainerCache: Trainers kept by their arguments, by whoever reuses them
    unsharded   the same step on one device, plain jit: what every parity check compares with
    balance     MoE load balancing: the per-sequence balance loss inside the stages, the
                loads for DeepSeek-V3's router bias
    optim       OptimConfig: optax AdamW, warm-up + cosine, the true global norm
    data        Corpus: the generated training text
    text        real text: prepare (byte-level BPE, train/val split), TokenData (memory-mapped)
    checkpoint  Checkpoints: orbax, canonical layout, restorable on any mesh
    loop        fit: the loop, progress line (tqdm), validation loss, resume, each
                process reading only its own rows of a batch
    throughput  model FLOPs per token, peak FLOP/s by device, MFU
    summary     a run's loss curve, tokens/s, memory, collectives against the formulas
    stages      the reference model as pipeline stages over dp x pp x tp (`pp_tp_loss`)
    verify      against the unsharded model (`jaxpar verify pp-tp`, `jaxpar verify train`)
"""

from jaxpar import lazy

_EXPORTS = {
    "spec": ("ParallelSpec", "parse"),
    "nnx_model": ("LanguageModel",),
    "step": ("Trainer", "TrainState"),
    "cache": ("TrainerCache",),
    "unsharded": ("reference_trainer", "reference_parts"),
    "optim": ("OptimConfig",),
    "data": ("Corpus",),
    "text": ("TokenData", "prepare", "check_vocab"),
    "checkpoint": ("CheckpointError", "Checkpoints"),
    "loop": ("History", "Profiling", "Validation", "fit"),
}
__getattr__, __dir__, __all__ = lazy.exports(__name__, _EXPORTS)
