"""Expert parallelism (lecture 6): route, all-to-all to the experts' owners, compute, all-to-all back.

    ep_moe_shard(p, x, *, axis, options, bias, routing)   per-shard, inside shard_map
    ep_moe(params, x, *, mesh, cfg, capacity_factor, ...)  global arrays -> (y, MoEStats)
    MoEOptions(top_k=, capacity_factor=, drop=, mlp=, ...) how tokens are routed, packed and computed

On each device of the `ep` axis (E/ep experts each):
  1. route: the replicated router picks each token's top-k experts and gates (router.py);
  2. pack: each (token, slot) gets a position in its expert's buffer, [E, C, D] in all,
     C slots per expert: first choices of every token before second choices, in token
     order (drop="position", GShard/Switch), or highest gate first (drop="probability").
     Past C the assignment is dropped; the token keeps its other experts (and the
     residual, outside this layer). capacity_factor=None is dropless: C = t, the most one
     device can send one expert, since a token picks an expert at most once;
  3. all-to-all the [ep, E/ep, C, D] buffer: each device receives every device's slots
     for its own experts;
  4. run each local expert on its ep*C slots: one matmul per expert (an einsum batched
     over the local experts);
  5. all-to-all the results back, gather each assignment's row and mix by the gates.
Two all-to-alls forward, two backward (their transposes), each of E*C*D elements: their
bytes follow tokens x k x D (times the capacity padding), not the experts' width.

Packing and combining are a scatter and a gather of D-wide rows, O(t*k*D), where the
one-hot GShard einsums cost O(t*E*C*D) and hold [t, E, C] tensors.
The statistics are per device (`MoEStats`), not reduced: reducing them would add
collectives to the program; they are summed on the host.
XLA:CPU has no ragged_all_to_all (jax 0.10.2), so the dropless path across devices uses the
fixed worst-case buffers here and on every backend. Dropless on one device (ep = 1), steps
2-5 are grouped matmuls instead (grouped.py, `MoEOptions.grouped`): at most 1.5 t*k rows of
expert work, not E*t.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import errors
from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.expert.formulas import capacity
from jaxpar.expert.grouped import KERNELS, MLPS, grouped_moe
from jaxpar.expert.router import check_route, check_top_k, expert_load, select_experts
from jaxpar.errors import ConfigError
from jaxpar.kernels import flash
from jaxpar.kernels import grouped as grouped_kernel
from jaxpar.mesh import DP, EP

DROPS = ("position", "probability")
EXPERT_WEIGHTS = ("w_up", "w_gate", "w_down")


def positions(experts, weights, n_experts: int, drop: str):
    """(position of each assignment in its expert's buffer [t, k], in priority order)."""
    t, k = experts.shape
    if drop == "position":      # slot-major: every token's first choice before any second choice
        order = jnp.arange(t * k).reshape(k, t).T.reshape(-1)          # rank of (token, slot)
        rank = jnp.argsort(order)
    else:                       # highest gate first
        rank = jnp.argsort(-jax.lax.stop_gradient(weights).reshape(-1), stable=True)
    flat = experts.reshape(-1)[rank]                                   # experts in priority order
    one_hot = jax.nn.one_hot(flat, n_experts, dtype=jnp.int32)
    pos_sorted = (jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=-1) - 1).astype(jnp.int32)
    return jnp.zeros((t * k,), jnp.int32).at[rank].set(pos_sorted).reshape(t, k)


def _experts(p: dict, h, mlp: str):
    """Each local expert on its rows: h [S, E_local, C, D] -> [S, E_local, C, D]."""
    up = jnp.einsum("secd,edf->secf", h, p["w_up"])
    if mlp == "swiglu":
        up = jax.nn.silu(jnp.einsum("secd,edf->secf", h, p["w_gate"])) * up
    else:
        up = jax.nn.gelu(up, approximate=False)
    return jnp.einsum("secf,efd->secd", up, p["w_down"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEOptions:
    """How one MoE layer routes, packs and computes its tokens: the settings `ep_moe_shard`
    and `dispatch_and_combine` share (the arrays, bias and routing, stay arguments).
    `of(cfg)` reads them from a reference.ModelConfig. Checked where they are used
    (`ep_moe_shard`, `ep_moe`), not here."""

    top_k: int
    """Experts per token, 1 .. E (router.select_experts)."""
    capacity_factor: float | None = None
    """Slots per expert over the even share t*k/E (formulas.capacity); None: dropless,
    C = t, as the reference computes it."""
    drop: str = "position"
    """Which assignments fill an expert's C slots first: "position" (every token's first
    choice before any second choice, GShard/Switch) or "probability" (highest gate first)."""
    mlp: str = "gelu"
    """Each expert's FFN: "gelu" or "swiglu" (w_gate too)."""
    scoring: str = "softmax"
    """The router: "softmax", or "sigmoid" (DeepSeek-V3, which takes a bias)."""
    renormalize: bool = True
    """The top-k gates renormalised to sum to 1 (Mixtral), as the reference's default."""
    grouped: bool | None = None
    """The experts as grouped matmuls (grouped.py: each expert's assignments one run of
    whole blocks, at most 1.5 t*k rows of work) instead of the [E, C, D]
    buffer (E*C rows, E*t dropless). It needs dropless (capacity_factor None) and every
    expert on this device (ep = 1). None: grouped exactly there (what the trainer asks
    for); True: grouped, refused elsewhere; False: the buffer always."""
    kernel: str = "xla"
    """What runs the grouped experts' matmuls: "xla" (einsums batched over blocks of
    t*k/2E rows, one weight copy per block) or "pallas" (kernels.grouped: 128-row tiles,
    each reading its expert's matrix in place). "pallas" needs the grouped path and
    d_model and the experts' d_ff multiples of 16."""

    @classmethod
    def of(cls, cfg: reference.ModelConfig, **overrides) -> MoEOptions:
        """The options `cfg` implies (top_k, mlp, its router and renormalisation), with
        `overrides` (e.g. capacity_factor=1.25) replacing any of them."""
        implied = cls(top_k=cfg.top_k, mlp=cfg.mlp, scoring=cfg.router, renormalize=cfg.moe_renormalize)
        return dataclasses.replace(implied, **overrides)


def ep_moe_shard(p: dict, x, *, axis=EP, options: MoEOptions, bias=None, routing=None):
    """The MoE layer on this device's tokens x [t, D], inside shard_map over `axis`.

    p: "router" [D, E] (replicated), "w_up" [E/ep, D, F], "w_down" [E/ep, F, D] (and
    "w_gate" for SwiGLU): this device's experts, expert e on device e // (E/ep).
    Returns (y [t, D], kept [E], dropped [E]): assignments of this device's tokens each
    expert took and dropped. axis=None is one device, nothing sent. bias [E]: the
    sigmoid router's selection bias. routing: the `router.route` of x, when the caller
    took it (to read its balance statistics; route checked the router then); default:
    routed here. Checked here (ConfigError); `dispatch_and_combine` is the same without
    the checks."""
    errors.one_of("drop", options.drop, DROPS)
    errors.one_of("mlp", options.mlp, MLPS)
    t, D = errors.array("x", x, ndim=2, kinds="f", shape_doc="x[tokens, d_model]")
    if routing is None:
        E = check_route(p["router"], D, top_k=options.top_k, scoring=options.scoring, bias=bias)
    else:
        E = routing.probs.shape[-1]
        check_top_k(options.top_k, E)
    ep = 1 if axis is None else jax.lax.axis_size(axis)
    if E % ep:
        raise ConfigError(f"n_experts={E} is not divisible by ep={ep}: each device owns E/ep whole experts. "
                          f"Fix: ep in ({errors.divisors(E)}) or n_experts a multiple of {ep}")
    check_expert_weights(p, mlp=options.mlp, leading=E // ep,
                         why=f"each of the ep={ep} devices holds E/ep={E // ep} experts")
    check_grouped(options, ep)
    check_kernel(options, ep, d_model=D, d_ff=p["w_up"].shape[-1])
    return dispatch_and_combine(p, x, axis=axis, options=options, bias=bias, routing=routing)


def check_expert_weights(p: dict, *, mlp: str, leading: int, why: str) -> None:
    """Refuse expert weights (w_up, w_down, and w_gate for SwiGLU) that are missing, not
    float [E, ., .] arrays, or whose leading (expert) axis is not `leading` (`why` says
    why it must be)."""
    for name in ("w_up", "w_down") + (("w_gate",) if mlp == "swiglu" else ()):
        if name in p:
            errors.array(name, p[name], ndim=3, kinds="f", shape_doc=f"expert weight {name}[experts, d_in, d_out]")
        if name not in p or p[name].shape[0] != leading:
            got = "missing" if name not in p else f"shape {tuple(p[name].shape)}"
            raise ConfigError(f"expert weight {name} is {got}: {why}, so it needs leading size {leading}")


def runs_grouped(options: MoEOptions, ep: int) -> bool:
    """Whether the layer runs grouped (`MoEOptions.grouped`): where asked, or (None) where
    it applies, dropless with every expert local (ep = 1)."""
    applies = options.capacity_factor is None and ep == 1
    return applies if options.grouped is None else options.grouped


def check_grouped(options: MoEOptions, ep: int) -> None:
    """Refuse grouped=True where the grouped path does not apply."""
    if options.grouped not in (None, True, False):
        raise ConfigError(f"grouped={options.grouped!r}: give None (grouped where it applies), True or False")
    if options.grouped and options.capacity_factor is not None:
        raise ConfigError(f"grouped=True with capacity_factor={options.capacity_factor}: the grouped experts are "
                          "dropless. Fix: capacity_factor=None, or grouped=None (the padded buffer with a capacity)")
    if options.grouped and ep > 1:
        raise ConfigError(f"grouped=True with ep={ep}: the grouped experts run where every expert is on the "
                          "device (ep = 1); across devices the all-to-all buffers stay. Fix: grouped=None")


def check_kernel(options: MoEOptions, ep: int, *, d_model: int, d_ff: int) -> None:
    """Refuse kernel="pallas" where the grouped path does not run or its tiles do not fit."""
    errors.one_of("kernel", options.kernel, KERNELS)
    if options.kernel != "pallas":
        return
    if not runs_grouped(options, ep):
        raise ConfigError(f"kernel='pallas' with capacity_factor={options.capacity_factor}, ep={ep}, "
                          f"grouped={options.grouped}: the kernel runs the grouped experts, which need dropless "
                          "(capacity_factor None) and ep = 1. Fix: kernel='xla'")
    refusal = grouped_kernel.fits(k=d_model, n=d_ff)      # each width alone: the same for w_down's [F, D]
    if refusal:
        raise ConfigError(f"kernel='pallas': {refusal}. Fix: kernel='xla'")


def interpreted(options: MoEOptions) -> bool:
    """Whether the layer runs a Pallas kernel in Pallas' interpreter (off a GPU), which
    cannot run inside a shard_map checking varying axes: its loops lose them (jax 0.10)."""
    return options.kernel == "pallas" and flash.interpret_here()


def dispatch_and_combine(p: dict, x, *, axis, options: MoEOptions, bias, routing):
    """ep_moe_shard on inputs its entry points (ep_moe, ep_moe_shard) have checked: route
    (unless `routing` is given), pack each expert's tokens, all-to-all them to the
    expert's device, run the experts, all-to-all back and combine; or, where
    `runs_grouped`, the grouped experts of grouped.py. x [t, D] -> (y [t, D], kept [E],
    dropped [E])."""
    t, D = x.shape
    r = select_experts(p["router"], x, top_k=options.top_k, scoring=options.scoring, renormalize=options.renormalize,
                       bias=bias) if routing is None else routing
    E = r.probs.shape[-1]
    ep = 1 if axis is None else jax.lax.axis_size(axis)
    if runs_grouped(options, ep):
        y, kept = grouped_moe(p, x, r.experts, r.weights, mlp=options.mlp, kernel=options.kernel)
        return y, kept, jnp.zeros_like(kept)
    local = E // ep
    C = capacity(t, options.top_k, E, options.capacity_factor)
    buf, slot, keep = pack(x, r.experts, r.weights, n_experts=E, capacity=C, drop=options.drop)
    out = exchange(_experts(p, exchange(buf.reshape(ep, local, C, D), axis), options.mlp), axis)
    y = unpack(out.reshape(E * C, D), slot, keep, r.weights)
    load = expert_load(r.experts, E)
    kept = jnp.zeros((E,), jnp.int32).at[r.experts.reshape(-1)].add(keep.reshape(-1).astype(jnp.int32))
    return y, kept, load - kept


def pack(x, experts, weights, *, n_experts: int, capacity: int, drop: str):
    """(buffer [E, C, D], slot [t, k], keep [t, k]): each kept assignment's row of x at
    slot = expert*C + position; empty slots are zero rows. The buffer is a gather of x
    (which token fills each slot), whose transpose is a scatter-add into dx: no
    buffer-sized zeros are summed over devices in the backward."""
    t, D = x.shape
    k = experts.shape[1]
    E, C = n_experts, capacity
    pos = positions(experts, weights, E, drop)
    keep = pos < C
    slot = jnp.where(keep, experts * C + pos, E * C)                 # E*C: out of range, dropped
    token = jnp.full((E * C,), t, jnp.int32).at[slot.reshape(-1)].set(
        jnp.repeat(jnp.arange(t, dtype=jnp.int32), k), mode="drop", unique_indices=True)
    return jnp.take(x, token, axis=0, mode="fill", fill_value=0).reshape(E, C, D), slot, keep


def exchange(buf, axis):
    """The all-to-all of a [ep, E/ep, C, D] buffer over `axis`: block r goes to device r,
    and device r's block i arrives as block i (its own experts' slots from every device).
    The same call takes the results back. A no-op on one device."""
    if axis is None or jax.lax.axis_size(axis) == 1:
        return buf
    return jax.lax.all_to_all(buf, axis, split_axis=0, concat_axis=0, tiled=True)


def unpack(out, slot, keep, weights):
    """y [t, D] = sum over each token's kept assignments of gate * its expert's row."""
    got = jnp.take(out, slot, axis=0, mode="fill", fill_value=0)     # [t, k, D]; dropped slots read 0
    return jnp.einsum("tk,tkd->td", (weights * keep).astype(out.dtype), got)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["kept", "dropped"], meta_fields=["ep", "capacity"])
@dataclasses.dataclass(frozen=True)
class MoEStats:
    """Per-device counts of one MoE layer: kept[g, e] and dropped[g, e], the assignments
    (token, slot) of device g's tokens that expert e took and dropped (a pytree: it
    passes through jit). The summaries below are computed on the host (numpy), from
    concrete counts."""

    kept: jax.Array
    dropped: jax.Array
    ep: int
    capacity: int

    @property
    def tokens_per_expert(self) -> np.ndarray:
        return np.asarray(self.kept).sum(axis=0)

    @property
    def dropped_per_expert(self) -> np.ndarray:
        return np.asarray(self.dropped).sum(axis=0)

    @property
    def drop_rate(self) -> float:
        kept, dropped = self.tokens_per_expert.sum(), self.dropped_per_expert.sum()
        return float(dropped / (kept + dropped)) if kept + dropped else 0.0

    @property
    def tokens_per_rank(self) -> np.ndarray:
        """Token-slots each ep rank's experts process (summed over the dp groups)."""
        return self.tokens_per_expert.reshape(self.ep, -1).sum(axis=1)

    @property
    def imbalance(self) -> float:
        """Busiest ep rank's token-slots over the mean: how long the slowest rank works
        relative to the average (every layer waits for it)."""
        per = self.tokens_per_rank
        return float(per.max() / per.mean()) if per.mean() else 1.0

    def to_json(self) -> dict:
        return {"tokens_per_expert": self.tokens_per_expert.tolist(),
                "dropped_per_expert": self.dropped_per_expert.tolist(),
                "tokens_per_rank": self.tokens_per_rank.tolist(), "drop_rate": self.drop_rate,
                "imbalance": self.imbalance, "capacity": self.capacity}


def manual_axes(mesh) -> tuple[str, ...]:
    """The axes ep_moe splits over: dp and ep, each when it has more than one device. Its
    shard_map runs on the mesh without the axes of one device (mesh.without_unit_axes),
    every axis manual: an axis left automatic put a sharding annotation in the gradient
    all-reduce's reducer, which XLA:CPU (jax 0.10.2) aborted compiling in bf16, and an
    axis of one device made manual but named by no input adds all-reduces over groups
    of one device."""
    return tuple(a for a in (DP, EP) if mesh_lib.axis_size(mesh, a) > 1)


def pspecs(mesh, params: dict) -> tuple[dict, P]:
    """(PartitionSpecs of params, of the tokens): router replicated, expert weights split
    over ep; tokens (the batch) over (dp, ep)."""
    split = EP if EP in manual_axes(mesh) else None
    param_pspecs = {name: P(split) if name in EXPERT_WEIGHTS else P() for name in params}
    return param_pspecs, P(manual_axes(mesh) or None)


def ep_moe(params: dict, x, *, mesh, cfg, capacity_factor=None, drop: str = "position",
           scoring: str = "softmax", bias=None, grouped: bool | None = None, kernel: str = "xla"):
    """The MoE layer on global arrays: x [B, T, D] -> (y [B, T, D], MoEStats). Tokens are
    split over (dp, ep), expert weights over ep (EP shares the data-parallel devices). Dropless
    (capacity_factor=None) it equals reference.moe(params, x, top_k=cfg.top_k); grouped and kernel:
    `MoEOptions.grouped` and `.kernel`."""
    mesh_lib.require_mesh(mesh, axes=(EP,), needed_by="ep_moe")
    if not isinstance(cfg, reference.ModelConfig):
        raise ConfigError(f"cfg is a {type(cfg).__name__}: give a reference.ModelConfig with n_experts and top_k")
    B, T, D = errors.array("x", x, ndim=3, kinds="f", shape_doc="x[batch, seq, d_model]")
    if D != cfg.d_model:
        raise ConfigError(f"x has d_model {D}, cfg.d_model={cfg.d_model}: give x [B, T, {cfg.d_model}]")
    if not cfg.n_experts:
        raise ConfigError("cfg.n_experts=0 is a dense MLP: ep_moe needs an MoE config, e.g. n_experts=8")
    errors.mapping("params", params, "reference.layer_params(params, 0)")
    names = ("router", "w_up", "w_down") + (("w_gate",) if cfg.mlp == "swiglu" else ())
    for name in names:
        if name not in params:
            raise ConfigError(f"params has no {name!r}: give the MoE layer's params (router [D, E], w_up [E, D, F],"
                              " w_down [E, F, D], and w_gate for SwiGLU), e.g. reference.layer_params(params, 0)")
    check_route(params["router"], D, top_k=cfg.top_k, scoring=scoring, bias=bias, n_experts=cfg.n_experts)
    check_expert_weights(params, mlp=cfg.mlp, leading=cfg.n_experts,
                         why=f"cfg.n_experts={cfg.n_experts}: one slice per expert")
    if bias is not None and errors.array("bias", bias, ndim=1, kinds="f", shape_doc="bias[n_experts]") != (
            cfg.n_experts,):
        raise ConfigError(f"bias has shape {tuple(bias.shape)}: DeepSeek-V3's selection bias has one entry per "
                          f"expert, [{cfg.n_experts}]")
    ep = mesh_lib.axis_size(mesh, EP)
    mesh_lib.require_divisible("n_experts", cfg.n_experts, mesh, (EP,), why="each ep device owns E/ep whole experts")
    mesh_lib.require_divisible("batch_size", B, mesh, (DP, EP), why="the batch is split over the dp x ep devices")
    errors.one_of("drop", drop, DROPS)
    tokens = B // mesh_lib.axis_size(mesh, DP) // ep * T        # per device
    C = capacity(tokens, cfg.top_k, cfg.n_experts, capacity_factor)   # refuses a capacity_factor <= 0
    p = {name: params[name] for name in names}
    p_pspecs, x_pspec = pspecs(mesh, p)
    options = MoEOptions.of(cfg, capacity_factor=capacity_factor, drop=drop, scoring=scoring, grouped=grouped,
                            kernel=kernel)
    check_grouped(options, ep)
    check_kernel(options, ep, d_model=D, d_ff=params["w_up"].shape[-1])
    shard = functools.partial(dispatch_and_combine, axis=EP if ep > 1 else None, options=options, routing=None)

    def run(p, x, bias):
        b = x.shape[0]
        y, kept, dropped = shard(p, x.reshape(b * T, D), bias=bias)
        return y.reshape(b, T, D), kept[None], dropped[None]

    bias_pspec = None if bias is None else P()
    if manual_axes(mesh):
        run = jax.shard_map(run, mesh=mesh_lib.without_unit_axes(mesh),
                            in_specs=(p_pspecs, x_pspec, bias_pspec), out_specs=(x_pspec, x_pspec, x_pspec),
                            check_vma=not interpreted(options))
    y, kept, dropped = run(p, x, bias)       # one device: nothing to split, no shard_map
    return y, MoEStats(kept, dropped, ep, C)
