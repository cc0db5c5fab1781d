"""The activation model against the compiled program (`jaxpar verify memory`).

The model counts what Megatron's layer stores (`activations.layer_terms`). Plain JAX
autodiff of `reference.block` stores more (exact GeLU keeps four [s, F] arrays, the
softmax three [a, s, s] and its mask, each RMSNorm two [s, h], and K/V repeated to every
query head), so the check runs the same block with Megatron's storage made explicit:
each term the model counts is named (`checkpoint_name`) and the layer runs under
`jax.checkpoint(policy=save_only_these_names(...))`, so the backward recomputes the rest.
`tagged_block` is that block; it equals `reference.block` (tested), and over tp it is
`tensor.layers`' column/row-parallel block with the pre-gather input saved (Megatron's
re-gather under sequence parallelism).

Measured: the compiled forward+backward's temp bytes (`memory_analysis`) of a scan over
L and 2L layers; their difference over L is one layer's stored activations on one device,
everything else (weights, gradients, the loss) being the same in both. Each is compared
with `layer_bytes` in float32 (act_bytes=4), no dropout.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar import mesh as mesh_lib
from jaxpar.memory import activations as A
from jaxpar.mesh import TP
from jaxpar.pipeline import formulas as pipeline_formulas
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline import runtime
from jaxpar.schedules import schedule as schedule_lib
from jaxpar.tensor.block import TPSpecs
from jaxpar.tensor.layers import column_parallel, row_parallel
from jaxpar.tensor.ops import copy_to_tp
from jaxpar.testing import Result, skipped

SAVED = {"none": ("QKV input (norm output)", "Q and K", "V", "softmax output", "output projection input",
                  "MLP norm input", "MLP input (norm output)", "up projection output", "GeLU output", "gate output",
                  "up output", "gate x up (down projection input)")}
SAVED["selective"] = tuple(n for n in SAVED["none"] if n != "softmax output")
SAVED["full"] = ()


def tagged_block(p: dict, x, cfg: reference.ModelConfig, *, axis: str | None = None, sp: bool = False):
    """reference.block with the tensors the model counts named; the layer's input is the
    "attention norm input" (jax.checkpoint keeps its inputs). With `axis`, one tp shard
    (inside shard_map): x [B, T/t, D] with sp, else [B, T, D]."""
    tag = checkpoint_name
    g1, g2 = p["attn_norm"], p["mlp_norm"]
    if axis and sp:
        g1, g2 = copy_to_tp(g1, axis), copy_to_tp(g2, axis)

    def columns(z, *ws):
        if axis:   # the column layer's input is saved before the gather (SP) or f (TP)
            return column_parallel(z, *ws, axis=axis, sequence_parallel=sp)
        return tuple(jnp.tensordot(z, w, axes=1) for w in ws)

    def rows(h, w):
        return row_parallel(h, w, axis=axis, sequence_parallel=sp) if axis else jnp.tensordot(h, w, axes=w.ndim - 1)

    z = tag(reference.rms_norm(x, g1, cfg.norm_eps), "QKV input (norm output)")
    q, k, v = columns(z, p["wq"], p["wk"], p["wv"])
    q, k, v = tag(q, "Q and K"), tag(k, "Q and K"), tag(v, "V")
    n, kv = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    T = q.shape[1]
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if cfg.causal:
        scores = jnp.where(jnp.arange(T)[:, None] >= jnp.arange(T)[None, :], scores, -jnp.inf)
    w = tag(jax.nn.softmax(scores, axis=-1), "softmax output")
    o = tag(jnp.einsum("bnts,bsnh->btnh", w, v), "output projection input")
    h = tag(x + rows(o, p["wo"]), "MLP norm input")
    z = tag(reference.rms_norm(h, g2, cfg.norm_eps), "MLP input (norm output)")
    if cfg.mlp == "gelu":
        (up,) = columns(z, p["w_up"])
        hidden = tag(jax.nn.gelu(tag(up, "up projection output"), approximate=False), "GeLU output")
    else:
        gate, up = columns(z, p["w_gate"], p["w_up"])
        gate, up = tag(gate, "gate output"), tag(up, "up output")
        hidden = tag(jax.nn.silu(gate) * up, "gate x up (down projection input)")
    return h + rows(hidden, p["w_down"])


def _stack_temp(cfg, n_layers: int, batch_size: int, seq_len: int, *, mesh, tp: int, sp: bool, recompute: str) -> int:
    """Compiled temp bytes per device of jit(grad) of a scan over n_layers tagged blocks."""
    cfg = reference.ModelConfig(**{**vars(cfg), "n_layers": n_layers})
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          reference.init_params(jax.random.key(0), cfg)["blocks"])
    x = jax.ShapeDtypeStruct((batch_size, seq_len, cfg.d_model), jnp.float32)
    axis = TP if tp > 1 else None
    if recompute == "autodiff":      # reference.block as JAX differentiates it, nothing named
        layer = functools.partial(reference.block, cfg=cfg)
    else:
        policy = jax.checkpoint_policies.save_only_these_names(*SAVED[recompute])
        layer = jax.checkpoint(functools.partial(tagged_block, cfg=cfg, axis=axis, sp=sp), policy=policy)

    def loss(p, x):
        y, _ = jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, p)
        return jnp.sum(y * y)

    grad = jax.grad(loss, argnums=(0, 1))
    if tp > 1:
        pspecs = TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=tp).params(
            reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0))
        pspecs = jax.tree.map(lambda s: P(None, *s), pspecs)
        act = P(None, TP) if sp else P()
        grad = jax.shard_map(grad, mesh=mesh, in_specs=(pspecs, act), out_specs=(pspecs, act))
    return jax.jit(grad).lower(params, x).compile().memory_analysis().temp_size_in_bytes


def measured_layer(cfg, *, batch_size: int, seq_len: int, tp: int = 1, sp: bool = False, recompute: str = "none",
                   n_layers: int = 2) -> float:
    """One layer's stored activations per device, from two compiled programs."""
    mesh = mesh_lib.make_mesh(tp=tp, devices=jax.devices()[:tp]) if tp > 1 else None
    kw = dict(mesh=mesh, tp=tp, sp=sp, recompute=recompute)
    return (_stack_temp(cfg, 2 * n_layers, batch_size, seq_len, **kw)
            - _stack_temp(cfg, n_layers, batch_size, seq_len, **kw)) / n_layers


def block_of(cfg: reference.ModelConfig) -> A.Block:
    return A.Block(d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, mlp=cfg.mlp,
                   dropout=False, act_bytes=4)


CFG = reference.ModelConfig(d_model=256, n_heads=8, n_kv_heads=8, head_dim=32, d_ff=1024, vocab=64)
CASES = [("no parallelism", 1, False, "none"), ("TP t=4", 4, False, "none"), ("TP+SP t=4", 4, True, "none"),
         ("selective recompute", 1, False, "selective"), ("full recompute", 1, False, "full")]


def check_memory(batch_size: int = 2, seq_len: int = 256, cases=CASES) -> list[Result]:
    """The activation model within 10% of the compiled program for each case of `cases`
    (skipped where tp is more devices than there are)."""
    n = len(jax.devices())
    out = []
    for name, tp, sp, rc in cases:
        if tp > n:
            out.append(skipped(f"activation model: {name}", needs=tp, have=n, mesh=f"tp={tp}"))
            continue
        start = time.perf_counter()
        got = measured_layer(CFG, batch_size=batch_size, seq_len=seq_len, tp=tp, sp=sp, recompute=rc)
        model = A.layer_bytes(block_of(CFG), seq_len=seq_len, batch_size=batch_size, tp=tp, sp=sp, recompute=rc)
        rel = abs(got - model) / model
        plain = ""
        if name == "no parallelism":
            autodiff = measured_layer(CFG, batch_size=batch_size, seq_len=seq_len, recompute="autodiff")
            plain = (f"; plain autodiff of reference.block keeps {autodiff / 2**20:.2f} MiB "
                     f"({autodiff / model:.2f}x: see docs/memory.md)")
        out.append(Result(name=f"activation model: {name}", mesh=f"tp={tp}" if tp > 1 else "-",
                          errors={"|compiled - model| / model": rel}, passed=rel <= 0.10,
                          seconds=time.perf_counter() - start,
                          note=f"per layer {got / 2**20:.2f} MiB compiled, {model / 2**20:.2f} MiB model "
                               f"(f32 B={batch_size} T={seq_len} D={CFG.d_model} a={CFG.n_heads}){plain}"))
    return out


def schedule_temp(s: schedule_lib.Schedule, *, cfg, microbatch_size: int, seq_len: int) -> tuple[int, object]:
    """Compiled temp bytes per device of the runtime's step for schedule `s`, with tagged
    blocks as the stage's layers (the model's storage), and the plan."""
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          reference.init_params(jax.random.key(0), cfg)["blocks"])
    layer = jax.checkpoint(functools.partial(tagged_block, cfg=cfg),
                           policy=jax.checkpoint_policies.save_only_these_names(*SAVED["none"]))
    x = jax.ShapeDtypeStruct((microbatch_size * s.microbatches, seq_len, cfg.d_model), jnp.float32)
    pipe = runtime.pipeline(s, runtime.layers(layer), params, (x, x), mesh=mesh_lib.make_mesh(
        pp=s.stages, devices=jax.devices()[:s.stages]), input_grads=False)
    staged = jax.eval_shape(lambda q: runtime.to_stages(q, s), params)
    return pipe.step.lower(staged, x, x, None, None).compile().memory_analysis().temp_size_in_bytes, pipe.plan


@functools.cache
def named_schedule_temp(name: str, p: int, m: int, *, cfg, microbatch_size: int, seq_len: int) -> tuple[int, object]:
    """schedule_temp of the named schedule (schedule.make(name, p, m)), compiled once per
    process: the in-flight checks of the named and of searched schedules share GPipe's."""
    return schedule_temp(schedule_lib.make(name, stages=p, microbatches=m), cfg=cfg,
                         microbatch_size=microbatch_size, seq_len=seq_len)


def check_pipeline_memory(p: int = 2, m: int = 8, microbatch_size: int = 2, seq_len: int = 128) -> list[Result]:
    """The microbatches in flight on the first stage (pipeline.formulas.in_flight) against the
    runtime's compiled temp memory. GPipe at m and 2m gives the cost of one more in
    flight (a stage's activations and its waiting gradient); 1F1B and ZB-H2 at m then
    hold (temp - GPipe's at m) / that + m in flight: p and 2p - 1 (ZB-H2's buffer of each
    layer's output gradient, kept for W, subtracted first). Interleaved's and DualPipe-V's
    residual slots are the plan's, in chunks: in_flight x v. One skipped row on fewer
    than p devices."""
    if len(jax.devices()) < p:
        return [skipped("pipeline memory: microbatches in flight", needs=p, have=len(jax.devices()), mesh=f"pp={p}")]
    cfg = reference.ModelConfig(**{**vars(CFG), "n_layers": 2 * p})
    start = time.perf_counter()
    temp = lambda name, mm: named_schedule_temp(name, p, mm, cfg=cfg, microbatch_size=microbatch_size, seq_len=seq_len)
    (g1, _), (g2, _) = temp("gpipe", m), temp("gpipe", 2 * m)
    per = (g2 - g1) / m
    model = (2 * A.layer_bytes(block_of(cfg), seq_len=seq_len, batch_size=microbatch_size)
             + microbatch_size * seq_len * cfg.d_model * 4)
    out = [Result(name="pipeline memory: one more microbatch in flight", mesh=f"pp={p}",
                  errors={"|compiled - model| / model": abs(per - model) / model},
                  passed=abs(per - model) <= 0.10 * model, seconds=time.perf_counter() - start,
                  note=f"GPipe m={m} -> {2 * m}: {per / 2**20:.2f} MiB each, model {model / 2**20:.2f} MiB "
                       "(2 layers' activations + the waiting output gradient)")]
    act = microbatch_size * seq_len * cfg.d_model * 4
    for name in ("1f1b", "zb-h2"):
        t, plan = temp(name, m)
        kept = (plan.n_res + 1) * 2 * act if plan.schedule.split_backward else 0   # output gradients for W
        held = m - (g1 - (t - kept)) / per
        expect = pipeline_formulas.in_flight(name, p=p, m=m)
        out.append(Result(name=f"pipeline memory: {name} in flight", mesh=f"pp={p}",
                          errors={"|compiled - model| / model": abs(held - expect) / expect},
                          passed=abs(held - expect) <= 0.10 * expect and plan.n_res == expect,
                          note=f"compiled temp holds {held:.2f} microbatches, model {expect:g}, plan slots "
                               f"{plan.n_res}"))
    for name in ("interleaved", "dualpipe-v"):
        s = schedule_lib.make(name, stages=p, microbatches=m)
        slots = plan_lib.plan(s).n_res
        expect = pipeline_formulas.in_flight(name, p=p, m=m, chunks=s.chunks)
        out.append(Result(name=f"pipeline memory: {name} in flight", mesh=f"pp={p}",
                          errors={"|plan slots / v - model|": abs(slots / s.chunks - expect)},
                          passed=slots / s.chunks == expect,
                          note=f"{slots} residual slots of 1/{s.chunks} stage = {slots / s.chunks:g} stages, "
                               f"model {expect:g}"))
    return out


def check() -> list[Result]:
    """`jaxpar verify memory`."""
    return check_memory() + check_pipeline_memory()
