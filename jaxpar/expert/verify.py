"""Expert parallelism proven against the reference, for `jaxpar verify ep`, the tour, example
06, the benchmark and the tests: ep_moe's output and, from jax.vjp, the input, router and
every expert's gradient against reference.moe (dropless) or against `reference_capacity_moe`
(the same drop rule written densely, its C from the definition: `reference_capacity`); the
collectives of the forward and backward against `formulas.ep_moe_collectives`; the
lecture's imbalance experiment and exercise 9(c)'s sweep.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import mesh as mesh_lib
from jaxpar import reference, testing
from jaxpar.expert import formulas
from jaxpar.expert.dispatch import MoEStats, ep_moe
from jaxpar.mesh import DP, EP
from jaxpar.testing import Result, Run, compiled_collectives, join_notes, skipped


def moe_inputs(cfg: reference.ModelConfig, batch_size: int, seq_len: int, *, skew: float = 0.0,
               dtype=jnp.float32, seed: int = 0):
    """(params, x, dy) of one MoE layer: weights ~ N(0, 1/fan_in) as init_params draws them;
    x ~ N(0, 1) + u for a unit vector u, and the router + skew * u v^T with v falling
    from 1 to -1 over the experts, so skew > 0 sends more tokens to the first experts.
    Drawn with numpy: no RNG kernel to compile for each shape."""
    rng = np.random.default_rng(seed)
    E, D, F = cfg.n_experts, cfg.d_model, cfg.d_ff
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    v = np.linspace(1.0, -1.0, E)
    p = {"router": rng.standard_normal((D, E)) / np.sqrt(D) + skew * np.outer(u, v),
         "w_up": rng.standard_normal((E, D, F)) / np.sqrt(D), "w_down": rng.standard_normal((E, F, D)) / np.sqrt(F)}
    if cfg.mlp == "swiglu":
        p["w_gate"] = rng.standard_normal((E, D, F)) / np.sqrt(D)
    x = rng.standard_normal((batch_size, seq_len, D)) + u
    dy = rng.standard_normal((batch_size, seq_len, D)) / (batch_size * seq_len)
    cast = lambda a: jnp.asarray(a, dtype)
    return {k: cast(a) for k, a in p.items()}, cast(x), cast(dy)


def _keep(experts, weights, C: int, drop: str):
    """[t, k] bool: assignment a is kept when fewer than C assignments to its expert come
    before it. Written densely, O((t k)^2), from the definition: "before" is (slot, token)
    order for drop="position" and a higher gate (ties: token-major order) for
    drop="probability"."""
    t, k = experts.shape
    e = experts.reshape(-1)
    token, slot = jnp.repeat(jnp.arange(t), k), jnp.tile(jnp.arange(k), t)
    if drop == "position":
        before = (slot[:, None] < slot[None, :]) | ((slot[:, None] == slot[None, :]) & (token[:, None] < token[None, :]))
    else:
        w = jax.lax.stop_gradient(weights).reshape(-1)
        idx = jnp.arange(t * k)
        before = (w[:, None] > w[None, :]) | ((w[:, None] == w[None, :]) & (idx[:, None] < idx[None, :]))
    ahead = jnp.sum(before & (e[:, None] == e[None, :]), axis=0)      # for each a: the b before it
    return (ahead < C).reshape(t, k)


def reference_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor) -> int:
    """The slots each expert gives one source device, from the definition and in exact
    arithmetic: ceil(cf * t * k / E) (the mean load t*k/E times the factor), at least 1 and
    at most t (a token picks an expert at most once); t when dropless (cf None)."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(Fraction(capacity_factor) * tokens * top_k / n_experts)))


def reference_capacity_moe(p: dict, x, *, top_k: int, groups: int, capacity: int, drop: str,
                           mlp: str = "gelu", renormalize: bool = True):
    """reference.moe with ep_moe's drop rule: the tokens x [B, T, D] are cut into `groups`
    (one per device, in device order) and, in each group, expert e takes at most
    `capacity` of its assignments. Every expert still runs on every token (dense)."""
    B, T, D = x.shape
    xs = x.reshape(groups, B * T // groups, D)
    E = p["router"].shape[-1]

    def one(xg):
        probs = jax.nn.softmax(xg @ p["router"], axis=-1)
        vals, idx = jax.lax.top_k(probs, top_k)
        if renormalize:
            vals = vals / jnp.sum(vals, axis=-1, keepdims=True)
        keep = _keep(idx, vals, capacity, drop)
        return jnp.einsum("tk,tke->te", vals * keep, jax.nn.one_hot(idx, E, dtype=vals.dtype))

    gates = jax.vmap(one)(xs).reshape(B * T, E)
    tokens = x.reshape(B * T, D)
    every = jax.vmap(lambda e: reference.mlp({n: p[n][e] for n in ("w_up", "w_gate", "w_down") if n in p},
                                             tokens, mlp=mlp))(jnp.arange(E))           # [E, BT, D]
    return jnp.einsum("te,etd->td", gates, every).reshape(B, T, D)


@dataclasses.dataclass(kw_only=True)
class MoERun(Run):
    """One step of ep_moe and of its reference on the same inputs: out and ref are
    (y, (param grads, x grad)); stats are ep_moe's; capacity the slots per expert the
    reference drops by (`reference_capacity`), which ep_moe's stats.capacity must equal."""

    stats: MoEStats
    capacity: int

    def named(self, outputs) -> dict:
        grads = outputs[1][0]
        return {"y": outputs[0], "dx": outputs[1][1], "d router": grads["router"],
                "d experts": {k: v for k, v in grads.items() if k != "router"}}


def run_moe(cfg: reference.ModelConfig, mesh, *, batch_size: int, seq_len: int = 8, capacity_factor=None,
            drop: str = "position", skew: float = 0.0, dtype=jnp.float32, seed: int = 0, kernel: str = "xla") -> MoERun:
    p, x, dy = moe_inputs(cfg, batch_size, seq_len, skew=skew, dtype=dtype, seed=seed)
    step = jax.jit(lambda p, x: ep_moe(p, x, mesh=mesh, cfg=cfg, capacity_factor=capacity_factor, drop=drop,
                                       kernel=kernel))
    forward = step.lower(p, x).compile()          # y and the stats: the stats add no collective
    y, stats = forward(p, x)
    _, vjp = jax.vjp(lambda p, x: step(p, x)[0], p, x)
    backward = jax.jit(lambda vjp, dy: vjp(dy)).lower(vjp, dy).compile()
    out, fwd, bwd = (y, backward(vjp, dy)), compiled_collectives(forward), compiled_collectives(backward)
    dp, ep = mesh_lib.axis_size(mesh, DP), mesh_lib.axis_size(mesh, EP)
    C = reference_capacity(batch_size * seq_len // (dp * ep), cfg.top_k, cfg.n_experts, capacity_factor)
    if capacity_factor is None:
        ref_fn = lambda p, x: reference.moe(p, x, top_k=cfg.top_k, mlp=cfg.mlp, renormalize=cfg.moe_renormalize)
    else:
        ref_fn = functools.partial(reference_capacity_moe, top_k=cfg.top_k, groups=dp * ep, capacity=C,
                                   drop=drop, mlp=cfg.mlp, renormalize=cfg.moe_renormalize)
    ref = _reference_step(ref_fn)(p, x, dy)
    kw = dict(cfg=cfg, batch_size=batch_size, seq_len=seq_len, dtype=dtype, dp=dp, ep=ep,
              capacity_factor=capacity_factor)
    return MoERun(out=out, ref=ref, stats=stats, capacity=C, forward=fwd, backward=bwd,
                  formula_forward=formulas.ep_moe_collectives(**kw),
                  formula_backward=formulas.ep_moe_collectives(**kw, backward=True))


def _reference_step(fn):
    def step(p, x, dy):
        y, vjp = jax.vjp(fn, p, x)
        return y, vjp(dy)
    return jax.jit(step)


def default_mesh() -> tuple[jax.sharding.Mesh, str]:
    """(dp x ep mesh, note): ep 4 or 2, dp filling the rest (testing.default_mesh)."""
    return testing.default_mesh(EP)


CFG = reference.ModelConfig(n_layers=1, d_model=16, d_ff=32, n_experts=8, top_k=2)


def check_moe(capacity_factor=None, drop: str = "position", kernel: str = "xla") -> Result:
    """One tour row: ep_moe on the default mesh against the reference (with the same
    drops), collectives against their formula. kernel="pallas" (the grouped experts
    through kernels.grouped) runs on dp alone, since the grouped path needs every expert
    on the device (ep = 1); off a GPU it runs interpreted, tile by tile."""
    start = time.perf_counter()
    m, mesh_note = default_mesh() if kernel == "xla" else (mesh_lib.make_mesh(dp=len(jax.devices()), ep=1), "")
    B = 2 * mesh_lib.axis_size(m, DP) * mesh_lib.axis_size(m, EP)
    run = run_moe(CFG, m, batch_size=B, capacity_factor=capacity_factor, drop=drop, skew=1.0, kernel=kernel)
    errors, rule, within = run.compared
    dropless = capacity_factor is None
    name = "MoE, dropless" if dropless else f"MoE, capacity {capacity_factor} (drop by {drop})"
    name += ", grouped experts by the Pallas kernel" if kernel == "pallas" else ""
    ok = (within and run.collectives_match and run.stats.capacity == run.capacity
          and (not dropless or run.stats.drop_rate == 0.0))
    return Result(name=name, mesh=mesh_lib.describe(m), errors=errors, tolerance=rule,
                  measured={"fwd": run.forward, "bwd": run.backward},
                  expected={"fwd": run.formula_forward, "bwd": run.formula_backward},
                  passed=ok, seconds=time.perf_counter() - start,
                  note=join_notes(f"E=8 top-2, {B * 8} tokens, vs reference.moe"
                               + ("" if dropless else " with the same drops")
                               + f"; dropped {run.stats.drop_rate:.1%}", mesh_note))


def imbalance_experiment(*, skew: float = 2.0, seed: int = 0, capacity_factors=(None, 2.0, 1.5, 1.25, 1.0, 0.5)):
    """The lecture's experiment: 4 ep ranks, 8 experts (2 each), top-2, a skewed router,
    on one device's worth of routing math per rank: per-rank token-slots, busiest/mean,
    and exercise 9(c)'s drop rate for each capacity factor. Needs 4 devices."""
    m = mesh_lib.make_mesh(ep=4, devices=jax.devices()[:4])
    cfg = reference.ModelConfig(n_layers=1, d_model=32, d_ff=64, n_experts=8, top_k=2)
    p, x, _ = moe_inputs(cfg, 16, 64, skew=skew, seed=seed)
    rows = []
    for cf in capacity_factors:
        _, stats = jax.jit(lambda p, x, cf=cf: ep_moe(p, x, mesh=m, cfg=cfg, capacity_factor=cf))(p, x)
        rows.append({"capacity_factor": cf, "capacity": stats.capacity, "tokens_per_rank": stats.tokens_per_rank.tolist(),
                     "imbalance": stats.imbalance, "drop_rate": stats.drop_rate,
                     "dropped_per_expert": stats.dropped_per_expert.tolist()})
    return rows


def check_imbalance() -> Result:
    start = time.perf_counter()
    if len(jax.devices()) < 4:
        return skipped("MoE load imbalance (lecture 6.3)", needs=4, have=len(jax.devices()), mesh="ep=4")
    rows = imbalance_experiment()
    dropless, tight = rows[0], rows[-2]
    ok = dropless["drop_rate"] == 0.0 and dropless["imbalance"] > 1.2 and tight["drop_rate"] > 0
    return Result(name="MoE load imbalance (lecture 6.3)", mesh="ep=4", errors={"dropless drop rate": 0.0},
                  passed=ok, seconds=time.perf_counter() - start,
                  note=f"skewed router: token-slots per rank {dropless['tokens_per_rank']}, busiest/mean "
                       f"{dropless['imbalance']:.2f}; capacity 1.0 drops {tight['drop_rate']:.1%}")


def check_ep() -> list[Result]:
    """`jaxpar verify ep`: dropless, capacity with both drop rules, the grouped experts
    through the Pallas kernel, the imbalance experiment."""
    return [check_moe(), check_moe(1.25, "position"), check_moe(1.0, "probability"), check_moe(kernel="pallas"),
            check_imbalance()]


