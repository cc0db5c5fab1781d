"""ZeRO-2 and ZeRO-3 in the trainer. ZeRO-2 compiles to ZeRO-1's program. ZeRO-3 stores
every weight as its dp-th, gathers it inside the layer that uses it and again in that
layer's backward, and reduce-scatters its gradient there: it trains like the unsharded
model (3 steps, 1e-5 in float32, 1e-12 in float64) on meshes with tp, sp, pp (the
pipeline program and the one-stage program), cp and ep, and each compiled step's
gathers and reduce-scatters over dp equal `data.formulas.zero3_bytes` on every pp rank."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import comms, reference
from jaxpar.data import zero
from jaxpar.errors import ConfigError
from jaxpar.train import model, summary, verify
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec

OPTIM = OptimConfig(lr=1e-2, warmup=1, steps=3, clip=0.5)
MESHES = {
    "dp2 tp2 sp (one stage)": (ParallelSpec(dp=2, tp=2, sequence_parallel=True, zero=3), verify.DENSE),
    "dp4 m2 (one stage, microbatch loop)": (ParallelSpec(dp=4, microbatches=2, zero=3), verify.DENSE),
    "dp2 pp2 tp2 1f1b": (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2, zero=3), verify.DENSE),
    "dp2 pp2 cp2 interleaved zigzag": (ParallelSpec(dp=2, pp=2, cp=2, microbatches=2, schedule="interleaved",
                                                    layout="zigzag", zero=3), verify.DENSE),
    "dp2 ep2 tp2 MoE": (ParallelSpec(dp=2, ep=2, tp=2, zero=3), verify.MOE),
    "dp2 pp2 ep2 MoE, balance loss and bias": (
        ParallelSpec(dp=2, pp=2, ep=2, microbatches=2, zero=3),
        dataclasses.replace(verify.MOE, router="sigmoid", aux_loss=0.01, bias_rate=1e-3)),
    # recompute="full": B reruns each stage's forward, gathering every layer's weights once more
    "dp4 tp2 m2 recompute (one stage)": (ParallelSpec(dp=4, tp=2, microbatches=2, zero=3, recompute="full"),
                                         verify.DENSE),
    "dp2 pp2 tp2 1f1b recompute": (ParallelSpec(dp=2, pp=2, tp=2, microbatches=2, zero=3, recompute="full"),
                                   verify.DENSE),
    # a split backward: the layers' reduce-scatters in W, the embedding's in B, and W's
    # pullback gathers again what it reads (and reruns the forward under recompute)
    "dp2 pp2 tp2 zb-h2": (ParallelSpec(dp=2, pp=2, tp=2, microbatches=4, zero=3, schedule="zb-h2"), verify.DENSE),
    "dp2 pp2 cp2 zb-h1 recompute": (ParallelSpec(dp=2, pp=2, cp=2, microbatches=2, zero=3, schedule="zb-h1",
                                                 recompute="full"), verify.DENSE),
}


def _trainer(cache, spec, cfg, dtype=jnp.float32):
    return cache(cfg, spec, OPTIM, batch_size=8, seq_len=16, devices=jax.devices()[:spec.devices], dtype=dtype)


@pytest.mark.parametrize("name", list(MESHES))
def test_zero3_trains_like_the_unsharded_model_and_runs_the_formula(name, trainer_cache):
    spec, cfg = MESHES[name]
    r = verify.parity(spec, cfg, steps=3, optim=OPTIM, trainers=trainer_cache)
    assert r.passed, r.errors
    trainer = _trainer(trainer_cache, spec, cfg)                     # parity's, from the cache
    c = summary.collectives(trainer, trainer.compiled)
    assert summary.matches(c), {k: c[k] for k in ("zero", "expected_zero", "zero_by_rank", "expected_zero_by_rank",
                                                  "reductions", "expected_reductions")}
    for d, got in c["zero_by_rank"].items():     # per pp rank, exactly
        assert got == c["expected_zero_by_rank"][d], (d, got, c["expected_zero_by_rank"][d])
    assert c["zero"]["all-gather"] > c["zero"]["reduce-scatter"] > 0       # gathered again in the backward


def test_zero3_stores_a_dp_th_of_every_weight_and_of_its_state(trainer_cache):
    spec, cfg = MESHES["dp2 pp2 tp2 1f1b"]
    trainer = _trainer(trainer_cache, spec, cfg)
    state = trainer.init()
    plain = _trainer(trainer_cache, dataclasses.replace(spec, zero=0), cfg).init()
    for kind in ("blocks", "first", "last"):
        for name, a in state.params[kind].items():
            b, d = plain.params[kind][name], trainer.zero_dims[kind][name]
            # dp=2 divides a dimension of each; a vector (a norm's gain) stays whole
            vector = a.ndim - (3 if kind == "blocks" else 0) == 1           # blocks: [pp, chunks, Lc, ...]
            assert (d == -1) if vector else (d >= 0), (kind, name, d)
            assert a.shape == b.shape                                     # the same global arrays
            local, whole = a.addressable_shards[0].data.shape, b.addressable_shards[0].data.shape
            if d >= 0:
                assert local[d] * 2 == whole[d] and local[:d] + local[d + 1:] == whole[:d] + whole[d + 1:]
            else:
                assert local == whole
    mu, mu_plain = state.opt[0].mu, plain.opt[0].mu
    for a, b, d in zip(jax.tree.leaves(mu), jax.tree.leaves(mu_plain), jax.tree.leaves(trainer.zero_dims)):
        assert a.addressable_shards[0].data.size * (2 if d >= 0 else 1) == b.addressable_shards[0].data.size
    # the compiled step's arguments (weights and AdamW state, 3 weights' bytes): all a dp-th,
    # where ZeRO-1 keeps the weights whole: (3 / 2) / (1 + 2 / 2) of it at dp = 2
    arguments = lambda t: t.compiled.memory_analysis().argument_size_in_bytes
    zero1 = _trainer(trainer_cache, dataclasses.replace(spec, zero=1), cfg)
    assert arguments(trainer) < 0.8 * arguments(zero1)


# What each function's backward gathers again, by hand: the matrices its pullback reads
# (dL/dx = dL/dy W^T; the router's too, dL/dx through the gates' logits); not the
# embedding (a lookup's pullback reads no table), nor a norm's gain or the router's bias
# (vectors, kept whole: never gathered at all). Under tp the router, replicated over tp,
# enters its matmul marked varying over tp (shard_map's implicit pvary: a copy), and the
# pullback keeps that copy as any residual: its D x E elements stay whole from F to B.
MATRICES = {"wq", "wk", "wv", "wo", "w_up", "w_gate", "w_down"}
REGATHERED = {
    "dense": {"blocks": MATRICES, "first": set(), "last": {"unembed"}},
    "MoE": {"blocks": MATRICES | {"router"}, "first": set(), "last": {"unembed"}},
    "MoE under tp": {"blocks": MATRICES, "first": set(), "last": {"unembed"}},
}
WHOLE = {"attn_norm", "mlp_norm", "final_norm", "router_bias"}


@pytest.mark.parametrize("name,model_name", [("dp4 m2 (one stage, microbatch loop)", "dense"),
                                             ("dp2 ep2 tp2 MoE", "MoE under tp"),
                                             ("dp2 pp2 ep2 MoE, balance loss and bias", "MoE")])
def test_zero3_regathers_in_the_backward_what_its_pullback_reads(name, model_name, trainer_cache):
    spec, cfg = MESHES[name]
    trainer = _trainer(trainer_cache, spec, cfg)
    trainer.compiled                                    # traced: each function's last trace is known
    req = trainer.local.request
    functions = {"blocks": req.stage_fn.layer_fn, "first": req.first_fn, "last": req.loss_fn}
    for kind, fn in functions.items():
        assert zero.regathered(fn) == REGATHERED[model_name][kind], kind
        stored = {n for n, d in trainer.zero_dims[kind].items() if d >= 0}
        assert stored == set(trainer.shapes[kind]) - WHOLE, kind


def test_zero3_gathers_inside_the_layers_and_never_after_the_update(trainer_cache):
    """Every all-gather and reduce-scatter of the step (dp only: no tp, no SP) sits in
    data.zero.SCOPE, inside a layer's function or its backward: no all-gather of the
    updated weights (ZeRO-1's). The forward's gathers run once (XLA hoists them out of the
    microbatch loop), the backward's re-gathers (the transpose of the layers: REGATHERED,
    by hand) and the reduce-scatters once per microbatch; the bytes from the shapes."""
    spec, cfg = MESHES["dp4 m2 (one stage, microbatch loop)"]
    trainer = _trainer(trainer_cache, spec, cfg)
    ops = [o for o in comms.collective_ops_from_hlo(trainer.compiled.as_text())
           if o.kind in ("all-gather", "reduce-scatter")]
    assert ops and all(zero.SCOPE in o.scope for o in ops), [o.scope for o in ops if zero.SCOPE not in o.scope]
    moved = lambda kind, backward: sum(o.bytes * o.executions for o in ops
                                       if o.kind == kind and ("transpose" in o.scope) == backward)
    # every weight but the vectors, whole (the gathered bytes: 4 per float32, all layers)
    nbytes = {(kind, n): 4 * int(np.prod(shape.shape)) for kind in ("blocks", "first", "last")
              for n, shape in trainer.shapes[kind].items() if n not in WHOLE}
    again = sum(b for (kind, n), b in nbytes.items() if n in REGATHERED["dense"][kind])
    m = spec.microbatches
    assert moved("all-gather", False) == sum(nbytes.values())
    assert moved("all-gather", True) == m * again > 0
    assert moved("reduce-scatter", True) == m * sum(nbytes.values())


def test_zero3_in_float64(x64):
    spec = dataclasses.replace(MESHES["dp2 pp2 tp2 1f1b"][0], tp=1)
    r = verify.parity(spec, verify.DENSE, steps=2, optim=OPTIM, dtype=jnp.float64)
    assert r.passed and r.tolerance == (1e-12, 0.0), r.errors


def test_zero2_compiles_to_zero1s_program(trainer_cache):
    """ZeRO-2 keeps the gradients as their dp-th from the reduction on; inside one compiled
    step ZeRO-1 already does (the full gradient is a temporary of the backward either
    way): the same program, the same collectives."""
    spec = ParallelSpec(dp=4, tp=2, zero=1)
    one, two = (_trainer(trainer_cache, dataclasses.replace(spec, zero=z), verify.DENSE) for z in (1, 2))
    c1, c2 = (summary.collectives(t, t.compiled) for t in (one, two))
    for key in ("reductions", "zero", "stages", "sends"):
        assert c1[key] == c2[key], key
    assert summary.matches(c2) and c2["zero"]["reduce-scatter"] > 0
    assert _instructions(one.compiled) == _instructions(two.compiled)


def _instructions(compiled) -> str:
    """The compiled program's HLO without its source metadata: a program read back from
    JAX's persistent compilation cache (tests/conftest.py) keeps no stack frames."""
    return re.sub(r",? metadata=\{[^}]*\}", "", compiled.as_text().split("\nFileNames")[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(zero=4), "zero=4 must be one of 0, 1, 2, 3"),
    (dict(zero=True), "zero=True"),
])
def test_zero_settings_that_do_not_fit_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ParallelSpec(**kwargs)


def test_zero3_dims_are_whole_unless_zero3_and_keep_the_router_bias_whole():
    cfg = dataclasses.replace(verify.MOE, router="sigmoid", bias_rate=1e-3)
    assert all(d == -1 for d in jax.tree.leaves(model.zero3_dims(cfg, ParallelSpec(dp=2, zero=1))))
    dims = model.zero3_dims(cfg, ParallelSpec(dp=2, zero=3))
    assert dims["blocks"]["router_bias"] == -1 and dims["blocks"]["w_up"] >= 0
    assert np.all([d >= 0 for d in (dims["first"]["embed"], dims["last"]["unembed"])])


def test_zero3_plans_the_first_dimension_dp_divides():
    """The trainer's ZeRO-3 splits each matrix along the first dimension of its local shard
    that dp divides (the flat gathered buffer's layout: a slice, no transpose)."""
    cfg = reference.ModelConfig(n_layers=2, d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, d_ff=64,
                                mlp="swiglu", vocab=64)
    dims = model.zero3_dims(cfg, ParallelSpec(dp=4, tp=2, zero=3))
    # local shards under tp=2: w_up [16, 32], unembed [16, 32] (the largest: dimension 1), w_down [32, 16]
    assert dims["blocks"]["w_up"] == 0 and dims["blocks"]["w_down"] == 0 and dims["last"]["unembed"] == 0
    assert dims["blocks"]["attn_norm"] == -1 and dims["last"]["final_norm"] == -1      # vectors stay whole
    wide = dataclasses.replace(cfg, d_model=18, n_heads=2, head_dim=8)    # [18, 32]: 18 is not divisible by 4
    assert model.zero3_dims(wide, ParallelSpec(dp=4, zero=3))["blocks"]["w_up"] == 1
