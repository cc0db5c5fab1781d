"""Expert parallelism: jaxpar's all-to-all dispatch against GShard-style one-hot dispatch.

    python -m benchmarks.expert          (or python -m benchmarks.run expert)

The peer is the dispatch of GShard, Praxis and MaxText's dense path, on the same mesh
and with the same router and drop rule: a one-hot dispatch tensor [t, E, C] and a
combine tensor (the gates on it), x_e = einsum("tec,td->ecd"), the same all-to-alls and
experts, y = einsum("tec,ecd->td"). It costs t*E*C*D multiply-adds per einsum and holds
[t, E, C] tensors; jaxpar's pack/unpack are a gather and a scatter of D-wide rows.

Rows (ep=4 on 4 fake CPU devices by default, top-2, capacity factor 1.25, position drops):
  speed   fwd+bwd time at E=8, 4096 tokens per device, D=512, F=2048: ratio of medians of
          REPEATS alternated runs after warm-up, and the max difference of the outputs
          and gradients between the two (they compute the same function);
  memory  compiled fwd+bwd temp bytes per device at E=8, D=256, F=512 for 512 .. 4096
          tokens per device (compile only): the one-hot tensors hold E x C x t elements,
          1.25 k t^2 (C = 1.25 t k / E), quadratic in the tokens; jaxpar's buffers hold
          E x C x D = 1.25 t k D, linear;
  grouped dropless on one device (ep=1), E=8, top-2, 4096 tokens, D=512, F=2048: the
          grouped experts (expert/grouped.py, about 1.5 t*k rows) against the padded
          [E, t, D] buffer (E*t rows), fwd+bwd, alternated as above, side by side.
"""

from __future__ import annotations

import functools
import statistics

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from benchmarks._timing import alternated
from jaxpar import comms, mesh, reference
from jaxpar.expert import dispatch, router
from jaxpar.expert.formulas import capacity
from jaxpar.expert.verify import moe_inputs
from jaxpar.testing import max_abs_diff

REPEATS = 3
EP = 4
CF = 1.25


def _mesh():
    return mesh.make_mesh(ep=EP, devices=jax.devices()[:EP])


def gshard_shard(p, x, *, top_k, capacity_factor, axis=mesh.EP):
    """One device's MoE by one-hot einsum dispatch and combine (the peer)."""
    t, D = x.shape
    E = p["router"].shape[1]
    ep = jax.lax.axis_size(axis)
    r = router.route(p["router"], x, top_k=top_k)
    C = capacity(t, top_k, E, capacity_factor)
    pos = dispatch.positions(r.experts, r.weights, E, "position")
    keep = pos < C
    mask = (jax.nn.one_hot(r.experts, E, dtype=x.dtype)[..., None]
            * jax.nn.one_hot(jnp.where(keep, pos, C), C, dtype=x.dtype)[:, :, None, :])      # [t, k, E, C]
    dispatch_t = mask.sum(axis=1)                                                          # [t, E, C]
    combine_t = jnp.einsum("tk,tkec->tec", r.weights.astype(x.dtype), mask)
    h = jnp.einsum("tec,td->ecd", dispatch_t, x).reshape(ep, E // ep, C, D)
    h = jax.lax.all_to_all(h, axis, 0, 0, tiled=True)
    up = jax.nn.gelu(jnp.einsum("secd,edf->secf", h, p["w_up"]), approximate=False)
    out = jax.lax.all_to_all(jnp.einsum("secf,efd->secd", up, p["w_down"]), axis, 0, 0, tiled=True)
    return jnp.einsum("tec,ecd->td", combine_t, out.reshape(E, C, D))


def _programs(cfg, m, tokens):
    p, x, dy = moe_inputs(cfg, EP, tokens, skew=0.5)
    ours = lambda p, x: dispatch.ep_moe(p, x, mesh=m, cfg=cfg, capacity_factor=CF)[0]
    pspecs = {"router": P(), "w_up": P(mesh.EP), "w_down": P(mesh.EP)}
    peer_shard = functools.partial(gshard_shard, top_k=cfg.top_k, capacity_factor=CF)
    peer = jax.shard_map(lambda p, x: peer_shard(p, x[0])[None], mesh=m, in_specs=(pspecs, P(mesh.EP)),
                         out_specs=P(mesh.EP))

    return {"jaxpar all-to-all": _step(ours), "GShard one-hot einsum": _step(peer)}, (p, x, dy)


def _step(fn):
    """jit of (y, the vjp of dy): forward and backward."""
    def run(p, x, dy):
        y, vjp = jax.vjp(fn, p, x)
        return y, vjp(dy)
    return jax.jit(run)


def speed_rows(tokens: int = 4096) -> list[dict]:
    cfg = reference.ModelConfig(n_layers=1, d_model=512, d_ff=2048, n_experts=8, top_k=2)
    fns, args = _programs(cfg, _mesh(), tokens)
    outs = {name: fn(*args) for name, fn in fns.items()}
    diff = max_abs_diff(*outs.values())
    times = alternated(fns, args, REPEATS)
    return _timed_rows(times, "jaxpar all-to-all", diff, {"row": "speed", "E": 8, "tokens/device": tokens},
                       ratio="this / jaxpar")


def _timed_rows(times: dict, base: str, diff: float, fields: dict, *, ratio: str) -> list[dict]:
    """One row per program: its median seconds, median and best against `base`'s."""
    ref = times[base]
    return [{**fields, "program": name, "fwd+bwd s": round(statistics.median(ts), 3),
             ratio: round(statistics.median(ts) / statistics.median(ref), 2),
             "best ratio": round(min(ts) / min(ref), 2), "max diff between them": f"{diff:.1e}"}
            for name, ts in times.items()]


def memory_rows(tokens=(512, 1024, 2048, 4096), E: int = 8) -> list[dict]:
    rows = []
    cfg = reference.ModelConfig(n_layers=1, d_model=256, d_ff=512, n_experts=E, top_k=2)
    for t in tokens:
        fns, args = _programs(cfg, _mesh(), t)
        temp = {name: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes for name, fn in fns.items()}
        C = capacity(t, 2, E, CF)
        rows.append({"row": "memory", "E": E, "tokens/device": t, "C": C,
                     "jaxpar temp": comms.human_bytes(temp["jaxpar all-to-all"]),
                     "GShard temp": comms.human_bytes(temp["GShard one-hot einsum"]),
                     "GShard / jaxpar": round(temp["GShard one-hot einsum"] / temp["jaxpar all-to-all"], 2),
                     "one [t, E, C] f32": comms.human_bytes(t * E * C * 4)})
    return rows


def grouped_rows(tokens: int = 4096) -> list[dict]:
    """Dropless on one device: the grouped path against the padded buffer (`MoEOptions.grouped`)."""
    cfg = reference.ModelConfig(n_layers=1, d_model=512, d_ff=2048, n_experts=8, top_k=2)
    m = mesh.make_mesh(ep=1, devices=jax.devices()[:1])
    args = moe_inputs(cfg, 1, tokens, skew=0.5)
    fns = {name: _step(lambda p, x, g=g: dispatch.ep_moe(p, x, mesh=m, cfg=cfg, grouped=g)[0])
           for name, g in (("grouped", True), ("padded", False))}
    diff = max_abs_diff(*(fn(*args) for fn in fns.values()))
    times = alternated(fns, args, REPEATS)
    return _timed_rows(times, "padded", diff, {"row": "grouped", "E": 8, "tokens": tokens}, ratio="this / padded")


def run() -> list[dict]:
    if len(jax.devices()) < EP:
        return [{"row": "skipped", "reason": f"needs {EP} devices, {len(jax.devices())} present"}]
    return speed_rows() + memory_rows() + grouped_rows()
