"""The training step composed as a recipe: the lecture's techniques applied to the model one
at a time, top down, each a short function over one description (`Layers`), as
torchtitan's `parallelize_llama` applies apply_tp, apply_cp, apply_ac, apply_fsdp.

    layers = compose(cfg, spec, seq_len=16, batch_size=8)
    stage_fn, first_fn, loss_fn = shard_fns(layers)           # what each device runs
    local = program(layers, mesh, shapes)                     # the pipeline program around them

`compose` reads as the lecture does: the unsharded model, then
    apply_tensor     §3, §4.4  Megatron's TP over tp (f and g), SP's sequence split
    apply_context    §5        ring or Ulysses attention over cp, this rank's positions
    apply_expert     §6        the MoE: experts over ep, each expert's FFN over tp
    apply_pipeline   §2        the layers in stages over pp, the schedule
    apply_data       §7        ZeRO: what is stored split over dp (ZeRO-3: the weights)
    apply_recompute  §4.3      what F keeps for B
    apply_precision            the dtype the layers run in (mixed precision)
Each sets only its own fields of `Layers`; `shard_fns` assembles the per-shard functions in
one fixed order (block, recompute's checkpoint, ZeRO-3's gather, the stage's layer loop).
The state on the mesh, the gradient reduction and AdamW around them are `step.Trainer`'s.

The weights' split over every axis is the model's own metadata (`model.partition_names`),
the batch's `batch_pspecs` below; both read the axes' roles from `spec.BATCH_AXES`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.context import zigzag
from jaxpar.context.ring import ring_attention_shard
from jaxpar.context.ulysses import ulysses_attention_shard
from jaxpar.data import zero
from jaxpar.errors import ConfigError
from jaxpar.expert.dispatch import MoEOptions, ep_moe_shard
from jaxpar.expert.router import route
from jaxpar.kernels import grouped as grouped_kernel
from jaxpar.kernels.attention import attention as attention_kernel
from jaxpar.kernels.attention import choose, choose_block
from jaxpar.mesh import CP, EP, TP
from jaxpar.pipeline import runtime
from jaxpar.schedules.schedule import Schedule
from jaxpar.tensor.layers import block_shard
from jaxpar.tensor.ops import copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp
from jaxpar.tensor.vocab import embedding_shard, lm_head_loss_shard
from jaxpar.train import balance
from jaxpar.train import model as model_lib
from jaxpar.train.spec import BATCH_AXES, ParallelSpec


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Layers:
    """The model as the techniques leave it: what each shard runs. `compose` builds it, each
    `apply_*` setting its own fields; `shard_fns` and `program` read it."""

    cfg: reference.ModelConfig
    seq_len: int                        # T, the whole sequence
    batch_size: int | None              # sequences per step: the balance loss's weight
    kernel: str = "xla"                 # the attention's kernel: a whole sequence's, or a ring block's (cp > 1)
    expert_kernel: str = "xla"          # what runs the grouped experts' matmuls ("pallas": kernels.grouped)
    pspecs: dict                        # {"blocks": one layer's, "first", "last"}: model.stage_pspecs
    sequence_parallel: bool = False     # tensor: SP's T/tp between the sublayers
    attend: Callable                    # context: attend(q, k, v) on this shard's heads
    positions: Callable                 # context: () -> int[T/cp], this rank's token positions
    ffn: Callable | None = None         # expert: ffn(p, z), the MLP sublayer (None: Megatron's MLP)
    schedule: Schedule                  # pipeline: the order of the stages' passes
    layers_per_stage: tuple | None = None   # pipeline: uneven stages (None: even)
    zero_dims: dict                     # data: ZeRO-3's dimension of each weight split over dp (-1: whole)
    checkpoint_policy: Callable | None = None   # recompute "dots": what jax.checkpoint keeps
    recompute_stages: bool = False      # recompute "full": each stage keeps its input, F runs again in B
    compute_dtype: Any = None           # precision: the layers' dtype (None: the weights')


def compose(cfg: reference.ModelConfig, spec: ParallelSpec, *, seq_len: int, batch_size: int | None = None,
            kernel: str = "xla", expert_kernel: str = "xla", compute_dtype=None) -> Layers:
    """The model `cfg` on `spec`, technique by technique in the lecture's order."""
    if cfg.n_experts and cfg.aux_loss and batch_size is None:
        raise ConfigError(f"aux_loss={cfg.aux_loss}: the balance loss is a mean over the step's sequences; "
                          "give batch_size= (sequences per step)")
    layers = dataclasses.replace(unsharded(cfg, seq_len=seq_len, batch_size=batch_size, kernel=kernel),
                                 expert_kernel=expert_kernel)
    layers = apply_tensor(layers, spec)
    layers = apply_context(layers, spec)
    layers = apply_expert(layers, spec)
    layers = apply_pipeline(layers, spec)
    layers = apply_data(layers, spec)
    layers = apply_recompute(layers, spec)
    return apply_precision(layers, compute_dtype)


def choose_kernel(requested: str, cfg: reference.ModelConfig, spec: ParallelSpec, *, seq_len: int, dtype,
                  platform: str) -> str:
    """What the layers' attention runs for `requested` ("auto", "xla", "cudnn", "pallas"):
    at cp > 1 under ring attention, what computes each block (kernels.attention.
    choose_block: "pallas" or "xla"); else the whole sequence's (choose). The Pallas
    kernel off a GPU runs in Pallas' interpreter, which cannot run inside the step's
    shard_map (it loses the varying axes its loops carry): refused there."""
    if spec.cp > 1 and spec.attention != "ulysses":
        tokens = seq_len // spec.cp // (2 if spec.layout == "zigzag" else 1)
        kernel = choose_block(requested, dtype=dtype, tq=tokens, tk=tokens, head_dim=cfg.head_dim, platform=platform)
    else:
        kernel = choose(requested, dtype=dtype, head_dim=cfg.head_dim, platform=platform, seq_len=seq_len)
    if kernel == "pallas" and platform not in ("gpu", "cuda"):
        raise ConfigError(f"attention_kernel='pallas' on {platform}: the Pallas kernel compiles for NVIDIA GPUs and "
                          "runs interpreted elsewhere, which the trainer's shard_map cannot hold. Fix: 'auto' or 'xla'")
    return kernel


def choose_expert_kernel(requested: str, cfg: reference.ModelConfig, spec: ParallelSpec, *, platform: str) -> str:
    """What runs the MoE layers' grouped matmuls for `requested` ("auto", "xla", "pallas"):
    kernels.grouped.choose for this device's share of the experts' width (d_ff / tp); the
    trainer's MoE is dropless, so it runs grouped at ep = 1. A dense model has none to run."""
    if not cfg.n_experts:
        if requested == "pallas":
            raise ConfigError("expert_kernel='pallas' with n_experts=0: a dense model has no experts' matmuls. "
                              "Fix: 'auto', or n_experts > 0")
        return "xla"
    return grouped_kernel.choose(requested, d_model=cfg.d_model, d_ff=cfg.d_ff // spec.tp, grouped=spec.ep == 1,
                                 platform=platform)


def unsharded(cfg: reference.ModelConfig, *, seq_len: int, batch_size: int | None, kernel: str) -> Layers:
    """The model on one device: whole sequences, one stage, every weight whole."""
    return Layers(cfg=cfg, seq_len=seq_len, batch_size=batch_size, kernel=kernel,
                  pspecs=_pspecs(cfg, ParallelSpec()),
                  attend=lambda q, k, v: attention_kernel(q, k, v, causal=cfg.causal, implementation=kernel),
                  positions=lambda: jnp.arange(seq_len), schedule=ParallelSpec().make_schedule(),
                  zero_dims=model_lib.zero3_dims(cfg, ParallelSpec()))


def apply_tensor(layers: Layers, spec: ParallelSpec) -> Layers:
    """§3, §4.4: Megatron's layout over tp (heads and d_ff split, f and g around each
    sublayer: `tensor.layers.block_shard`; the vocabulary split: `tensor.vocab`), every
    weight's split as the model's metadata says (`model.partition_names`), and SP's
    sequence split between the sublayers when asked (over tp of one device it splits nothing
    and is left off: `ParallelSpec.ignored`)."""
    return dataclasses.replace(layers, pspecs=_pspecs(layers.cfg, spec),
                               sequence_parallel=spec.sequence_parallel and spec.tp > 1)


def apply_context(layers: Layers, spec: ParallelSpec) -> Layers:
    """§5: over cp each device holds T/cp tokens (contiguous or zigzag: `spec.layout`) and
    attends over the whole sequence by ring attention (K/V blocks sent round cp; through
    all_to_all inside a pipeline stage, `collectives.ring_shift`) or Ulysses (heads and
    sequence swapped by all_to_all, the whole sequence through the attention kernel)."""
    if spec.cp == 1:
        return layers
    cfg, kernel, seq_len, local = layers.cfg, layers.kernel, layers.seq_len, layers.seq_len // spec.cp
    if spec.attention == "ulysses":
        attend = functools.partial(ulysses_attention_shard, axis=CP, causal=cfg.causal, layout=spec.layout,
                                   kernel=kernel)
    else:
        hop = "all_to_all" if spec.pp > 1 else "ppermute"
        attend = functools.partial(ring_attention_shard, axis=CP, causal=cfg.causal, layout=spec.layout, hop=hop,
                                   kernel=kernel)

    def positions():                                                # int[T/cp]
        if spec.layout == "contiguous":      # (a contiguous sequence need not cut into 2 cp halves)
            return jax.lax.axis_index(CP) * local + jnp.arange(local)
        table = jnp.asarray(zigzag.positions(seq_len, spec.cp, spec.layout).reshape(spec.cp, local), jnp.int32)
        return jax.lax.dynamic_index_in_dim(table, jax.lax.axis_index(CP), 0, keepdims=False)
    return dataclasses.replace(layers, attend=attend, positions=positions)


def apply_expert(layers: Layers, spec: ParallelSpec) -> Layers:
    """§6: an MoE model's MLP becomes `_moe`: the tokens enter the tp region (f, or SP's
    all-gather), go over ep to the experts that own them (`expert.dispatch.ep_moe_shard`),
    whose FFN is split over tp, and g (or SP's reduce-scatter) sums the partial outputs;
    with load balancing (`balance.moe_balance`) its loss and statistics ride along."""
    if not layers.cfg.n_experts:
        return layers
    ffn = functools.partial(_moe, cfg=layers.cfg, spec=spec, seq_len=layers.seq_len, batch_size=layers.batch_size,
                            kernel=layers.expert_kernel, sp=layers.sequence_parallel)
    return dataclasses.replace(layers, ffn=ffn)


def apply_pipeline(layers: Layers, spec: ParallelSpec) -> Layers:
    """§2: the layers in pp*chunks stages (`spec.layers_per_stage`: uneven), run in the
    schedule's order (`pipeline.runtime`; one stage: the plain value_and_grad)."""
    uneven = spec.layers_per_stage if spec.pp > 1 else None
    return dataclasses.replace(layers, schedule=spec.make_schedule(), layers_per_stage=uneven)


def apply_data(layers: Layers, spec: ParallelSpec) -> Layers:
    """§7: the batch's rows over the data axes (`batch_pspecs`); under ZeRO-3 each weight
    stored as its dp-th (`model.zero3_dims`) and gathered on entry to its layer. ZeRO-1/2's
    split optimizer state is the Trainer's (`data.zero.plan` of the state on the mesh)."""
    return dataclasses.replace(layers, zero_dims=model_lib.zero3_dims(layers.cfg, spec))


def apply_recompute(layers: Layers, spec: ParallelSpec) -> Layers:
    """§4.3: True keeps each stage's input and runs F again in B (`pipeline.passes`);
    "dots" keeps the matmuls' and collectives' outputs (`model.keep_dots`)."""
    policy = model_lib.keep_dots if spec.recompute == "dots" else None
    return dataclasses.replace(layers, checkpoint_policy=policy, recompute_stages=spec.recompute == "full")


def apply_precision(layers: Layers, compute_dtype) -> Layers:
    """Mixed precision: the layers run in compute_dtype (the Trainer casts the weights before
    any layer, and the gradients back); None: in the weights' dtype."""
    return dataclasses.replace(layers, compute_dtype=compute_dtype)


def layer_dtype(compute_dtype, dtype) -> np.dtype:
    """The dtype the trainer's layers run in: compute_dtype (None: dtype), refused unless
    float32 or bfloat16 (or float64 under jax_enable_x64)."""
    if compute_dtype is None:
        return jnp.dtype(dtype)
    allowed = ("float32", "bfloat16") + (("float64",) if jax.config.jax_enable_x64 else ())
    try:
        name = jnp.dtype(compute_dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in allowed:
        x64 = "" if jax.config.jax_enable_x64 else " (float64 with jax_enable_x64)"
        raise ConfigError(f"compute_dtype={compute_dtype!r}: the layers run in one of {', '.join(allowed)}{x64}. "
                          "Fix: compute_dtype=jnp.bfloat16 (mixed precision: float32 weights and AdamW, bf16 "
                          "layers) or None (compute in dtype)")
    return jnp.dtype(name)


# ---- assembly ------------------------------------------------------------------------------

def shard_fns(layers: Layers):
    """(stage_fn, first_fn, loss_fn) per shard: the block (`block_shard` with the context's
    attention and the expert's MLP), inside recompute's checkpoint, inside ZeRO-3's gather
    (one flat all-gather per function: FSDP's flat parameter; its backward gathers again
    and reduce-scatters), looped over a stage's layers; the embedding; the head and loss."""
    block = functools.partial(_block, layers=layers)
    if layers.checkpoint_policy is not None:       # inside the gather: B gathers the weights again
        block = jax.checkpoint(block, policy=layers.checkpoint_policy)
    dims, sp = layers.zero_dims, layers.sequence_parallel
    stage = runtime.layers(zero.gathered(block, dims["blocks"], fuse=True))
    embed = functools.partial(_embed, sp=sp)
    head = functools.partial(_head, eps=layers.cfg.norm_eps, sp=sp)
    return stage, zero.gathered(embed, dims["first"], fuse=True), zero.gathered(head, dims["last"], fuse=True)


def program(layers: Layers, spec: ParallelSpec, mesh, shapes: dict) -> runtime.Local:
    """The pipeline program (`pipeline.runtime.local`) of `layers` on `mesh`, for weights
    shaped `shapes` ({"blocks": [L, ...], "first", "last"}) and `batch_pspecs`'s batch."""
    stage_fn, first_fn, loss_fn = shard_fns(layers)
    ids = jax.ShapeDtypeStruct((layers.batch_size, layers.seq_len), jnp.int32)
    pspecs = layers.pspecs
    return runtime.local(
        layers.schedule, stage_fn, shapes["blocks"], (ids, ids), mesh=mesh, loss_fn=loss_fn,
        recompute="full" if layers.recompute_stages else "none", input_grads=False, param_pspecs=pspecs["blocks"],
        batch_pspec=batch_pspecs(spec)[1], first_fn=first_fn, first_params=shapes["first"],
        first_pspecs=pspecs["first"], last_params=shapes["last"], last_pspecs=pspecs["last"],
        layers_per_stage=layers.layers_per_stage)


def batch_pspecs(spec: ParallelSpec) -> tuple[P, P]:
    """The batch's pspecs, the one place they are written: (the tokens int[B_(dp ep), T+1]
    as the step takes them, rows split over the batch axes (`spec.BATCH_AXES`), each
    sequence whole; the inputs and targets int[B_(dp ep), T_cp] the step cuts from them
    (`model.to_layout`) and its shard_map takes, the sequence also split over cp). Only
    axes of more than one device are named (over one, a value is whole)."""
    axes = tuple(a for a in BATCH_AXES if spec.sizes[a] > 1)
    rows = axes if len(axes) > 1 else axes[0] if axes else None
    return (P(rows) if rows else P()), P(rows, CP if spec.cp > 1 else None)


def _pspecs(cfg: reference.ModelConfig, spec: ParallelSpec) -> dict:
    return dict(zip(("blocks", "first", "last"), model_lib.stage_pspecs(cfg, spec)))


# ---- per shard ------------------------------------------------------------------------------

def _block(p, x, *, layers: Layers):
    return block_shard(p, x, cfg=layers.cfg, axis=TP, sequence_parallel=layers.sequence_parallel,
                       positions=layers.positions(), attend=layers.attend, ffn=layers.ffn)


def _moe(p, z, *, cfg: reference.ModelConfig, spec: ParallelSpec, seq_len: int, batch_size: int | None,
         kernel: str, sp: bool):
    """The MoE on this device's tokens z [mb, T', D]: experts over ep, their FFN over tp."""
    zg = gather_from_sp(z, TP, 1) if sp else copy_to_tp(z, TP)                    # [mb, Tc, D]
    B, T, D = zg.shape
    experts = {k: p[k] for k in ("router", "w_up", "w_gate", "w_down") if k in p}
    x = zg.reshape(B * T, D)
    r = route(p["router"], x, top_k=cfg.top_k, scoring=cfg.router, renormalize=cfg.moe_renormalize,
              bias=p.get("router_bias"))
    y, _, _ = ep_moe_shard(experts, x, axis=EP if spec.ep > 1 else None, options=MoEOptions.of(cfg, kernel=kernel),
                           routing=r)
    if balance.enabled(cfg):
        y = balance.moe_balance(y, p, r, cfg=cfg, sizes=spec.sizes, sequences=B, seq_len=seq_len,
                                batch_size=batch_size)
    y = y.reshape(B, T, D)                                                         # partial sums over tp
    return reduce_scatter_to_sp(y, TP, 1) if sp else reduce_from_tp(y, TP)


def _embed(first: dict, tokens, *, sp: bool):
    return embedding_shard(first["embed"], tokens, axis=TP, sequence_parallel=sp)


def _head(last: dict, y, targets, *, eps: float, sp: bool):
    return lm_head_loss_shard(y, last["final_norm"], last["unembed"], targets, eps=eps, axis=TP,
                              sequence_parallel=sp)
