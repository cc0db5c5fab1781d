"""Data parallelism proven against the unsharded model, for `jaxpar verify dp` and the tour:
a two-layer MLP over every device as dp, each device differentiating its rows' share of
the mean loss, then

  * the gradient reduction (`reduce.reduce_gradients`) against jax.grad of the whole
    batch's loss: every gradient;
  * ZeRO-1 (`zero`): two AdamW steps with the gradients reduce-scattered, each dp rank
    updating its dp-th of every weight with its dp-th of the state, and the weights
    all-gathered, against optax's AdamW on the whole model: the weights and the state;

each compiled program's collectives against `formulas.dp_collectives`; and the lecture's
comparison of ZeRO-3 with pipeline parallelism on one small model, both measured from
compiled programs (`check_zero3_vs_pp`): ZeRO-3 moves the weights about 3 times a step
(2 all-gathers and 1 reduce-scatter, `formulas.zero3_bytes`), the pipeline b*s*h of
activations between neighbouring stages per microbatch, each way.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar.collectives import varying
from jaxpar.comms import Collectives, human_bytes
from jaxpar.data import formulas, zero
from jaxpar.data.reduce import reduce_gradients, weights
from jaxpar.mesh import DP
from jaxpar.testing import Result, compare, compiled_collectives, shortfall

# d_model 12: 8 devices do not divide the output bias [12], whose state stays whole
D_MODEL, D_FF, ROWS_PER_DEVICE = 12, 64, 4
OPTIM = optax.adamw(1e-2)


def mlp_loss(params, x, y):
    """The mean squared error of a two-layer GeLU MLP on rows x[B, D] with targets y[B, D]."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])                  # [B, F]
    return jnp.mean(jnp.square(h @ params["w2"] + params["b2"] - y))


def inputs(batch_size: int, seed: int = 0):
    """(params, x, y): weights ~ N(0, 1/fan_in), biases ~ N(0, 0.1), x and y ~ N(0, 1).
    Drawn with numpy: no RNG kernel to compile."""
    rng = np.random.default_rng(seed)
    normal = lambda scale, *shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
    params = {"w1": normal(D_MODEL ** -0.5, D_MODEL, D_FF), "b1": normal(0.1, D_FF),
              "w2": normal(D_FF ** -0.5, D_FF, D_MODEL), "b2": normal(0.1, D_MODEL)}
    return params, normal(1.0, batch_size, D_MODEL), normal(1.0, batch_size, D_MODEL)


def _share(params, x, y, batch_axes):
    """This device's rows' share of the mean loss's gradient, g{U_dp}: the parameters are
    typed varying over the batch axes first, so that autodiff leaves the sum to the
    reduction (the gradient of an invariant parameter is summed by pvary's transpose)."""
    dp = jax.lax.axis_size(DP)
    return jax.grad(lambda p: mlp_loss(p, x, y) / dp)(varying(params, batch_axes))


def _setting():
    mesh = mesh_lib.make_mesh(dp=len(jax.devices()))
    dp = mesh_lib.axis_size(mesh, DP)
    params, x, y = inputs(ROWS_PER_DEVICE * dp)
    pspecs = jax.tree.map(lambda _: P(), params)          # every weight replicated over dp
    # an axis of one device splits nothing (XLA would keep a collective over it)
    batch_axes = (DP,) if dp > 1 else ()
    return mesh, params, x, y, pspecs, batch_axes, P(DP if dp > 1 else None)


def check_reduction() -> Result:
    """The gradient all-reduce over dp against jax.grad of the whole batch's loss."""
    start = time.perf_counter()
    mesh, params, x, y, pspecs, batch_axes, rows = _setting()

    def per_device(params, x, y):                         # x, y: [B/dp, D]
        return reduce_gradients(_share(params, x, y, batch_axes), pspecs, batch_axes=batch_axes)

    step = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(pspecs, rows, rows), out_specs=pspecs))
    compiled = step.lower(params, x, y).compile()
    errors, rule, within = compare({"grads": compiled(params, x, y)},
                                   {"grads": jax.jit(jax.grad(mlp_loss))(params, x, y)})
    sizes = dict(mesh.shape)
    measured = compiled_collectives(compiled)
    expected = formulas.dp_collectives(weights(params, pspecs, sizes=sizes), sizes=sizes, batch_axes=batch_axes)
    return Result(name="data parallel: gradient all-reduce", mesh=mesh_lib.describe(mesh), errors=errors,
                  tolerance=rule, measured={"step": measured}, expected={"step": expected},
                  passed=within and measured == expected, seconds=time.perf_counter() - start,
                  note=f"MLP {D_MODEL}-{D_FF}-{D_MODEL}, {x.shape[0]} rows; every gradient vs jax.grad")


def zero1_step(mesh, pspecs, dims, batch_axes, state_pspecs, rows):
    """One jitted ZeRO-1 AdamW step (params, state, x, y) -> (params, state) on `mesh`."""
    def per_device(params, state, x, y):
        grads = zero.reduce_scatter_gradients(_share(params, x, y, batch_axes), pspecs, dims, batch_axes=batch_axes)
        own = zero.slice_params(params, dims)              # this rank's dp-th of each weight
        updates, state = OPTIM.update(grads, state, own)   # on dp-ths, with a dp-th of the state
        return zero.gather_params(optax.apply_updates(own, updates), dims), state

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(pspecs, state_pspecs, rows, rows),
                                 out_specs=(pspecs, state_pspecs)))


def check_zero1(steps: int = 2) -> Result:
    """`steps` AdamW steps under ZeRO-1 against optax's AdamW on the unsharded model."""
    start = time.perf_counter()
    mesh, params, x, y, pspecs, batch_axes, rows = _setting()
    sizes = dict(mesh.shape)
    dims = zero.plan(params, pspecs, sizes=sizes)
    state = OPTIM.init(params)
    state_pspecs = optax.tree_map_params(OPTIM, lambda _, s: s, state, zero.state_pspecs(pspecs, dims, params),
                                        transform_non_params=lambda _: P())
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), state_pspecs))
    compiled = zero1_step(mesh, pspecs, dims, batch_axes, state_pspecs, rows).lower(params, state, x, y).compile()

    @jax.jit
    def reference_step(params, state):
        updates, state = OPTIM.update(jax.grad(mlp_loss)(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    ours, ref = (params, state), (params, OPTIM.init(params))
    for _ in range(steps):
        ours, ref = compiled(*ours, x, y), reference_step(*ref)
    errors, rule, within = compare({"params": ours[0], "AdamW state": ours[1]},
                                   {"params": ref[0], "AdamW state": ref[1]})
    measured = compiled_collectives(compiled)
    expected = formulas.dp_collectives(weights(params, pspecs, sizes=sizes, zero_dims=dims), sizes=sizes,
                                       batch_axes=batch_axes)
    held = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(ours[1]))
    whole = sum(a.nbytes for a in jax.tree.leaves(ours[1]))
    kept = [k for k, d in dims.items() if d < 0] if sizes[DP] > 1 else []
    return Result(name=f"ZeRO-1: {steps} AdamW steps, state over dp", mesh=mesh_lib.describe(mesh), errors=errors,
                  tolerance=rule, measured={"step": measured}, expected={"step": expected},
                  passed=within and measured == expected, seconds=time.perf_counter() - start,
                  note=f"AdamW state per device {human_bytes(held)} of {human_bytes(whole)}"
                       + (f"; whole: {', '.join(kept)} (no dimension dp divides)" if kept else ""))


# ---- ZeRO-3 against pipeline parallelism --------------------------------------------------

# a stack of residual GeLU MLP layers (width D, hidden F) on [rows, SEQ, D] activations
STACK_LAYERS, STACK_D, STACK_F, STACK_SEQ = 4, 16, 64, 8
PP_STAGES, PP_MICROBATCHES = 2, 4                       # 2 stages of 2 layers


def stack_inputs(rows: int, seed: int = 0):
    """(params {"w1": [L, D, F], "w2": [L, F, D]}, x, y [rows, SEQ, D]) drawn with numpy."""
    rng = np.random.default_rng(seed)
    normal = lambda scale, *shape: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
    params = {"w1": normal(STACK_D ** -0.5, STACK_LAYERS, STACK_D, STACK_F),
              "w2": normal(STACK_F ** -0.5, STACK_LAYERS, STACK_F, STACK_D)}
    return params, normal(1.0, rows, STACK_SEQ, STACK_D), normal(1.0, rows, STACK_SEQ, STACK_D)


def stack_layer(p, x):
    """One layer: x + gelu(x @ w1) @ w2, x [rows, SEQ, D]."""
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


def _run_layers(layer_fn, params, x):
    """layer_fn over every layer of params [n, ...] in order."""
    for i in range(jax.tree.leaves(params)[0].shape[0]):
        x = layer_fn(jax.tree.map(lambda a: a[i], params), x)
    return x


def stack_loss(params, x, y):
    """The mean squared error of the whole stack (the unsharded model)."""
    return jnp.mean(jnp.square(_run_layers(stack_layer, params, x) - y))


def _zero3_gradients(mesh, dims, stored):
    """The jitted ZeRO-3 gradient (params, x, y) -> grads over dp: each layer gathers its
    weights (`zero.gathered`), and again in its backward, which reduce-scatters them."""
    layer = zero.gathered(stack_layer, dims)
    dp = mesh_lib.axis_size(mesh, DP)

    def per_device(params, x, y):                 # params [L, ..., X/dp, ...]; x, y [rows/dp, SEQ, D]
        share = lambda p: jnp.mean(jnp.square(_run_layers(layer, p, x) - y)) / dp
        return jax.grad(share)(params)             # the dp-th of the summed gradient
    rows = P(DP if dp > 1 else None)               # over one device XLA would keep the gradients' all-reduce
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(stored, rows, rows), out_specs=stored))


def _pipeline_gradients(mesh):
    """The jitted gradient of the stack pipelined over 2 stages (L/2 layers each), the
    microbatches in turn: stage 0 runs its layers, sends the activation [mb, SEQ, D] to
    stage 1 (a collective-permute; its gradient comes back the same way), stage 1 runs
    its layers and the loss. Every device runs both turns (SPMD); the turn that is not its
    stage's is discarded: stage 0's second by the mask on the loss, stage 1's first by
    the send, which carries stage 0's only."""
    stages = PP_STAGES

    def per_device(params, xs, ys):               # params [L/2, ...]; xs, ys [m, mb, SEQ, D]
        stage = jax.lax.axis_index("pp")

        def loss(params):
            def microbatch(total, batch):
                x, y = batch
                h = jax.lax.ppermute(_run_layers(stack_layer, params, x), "pp", [(0, 1)])
                out = _run_layers(stack_layer, params, h)
                mine = jnp.where(stage == stages - 1, jnp.mean(jnp.square(out - y)), 0.0)
                return total + mine / xs.shape[0], None
            return jax.lax.scan(microbatch, varying(jnp.zeros((), xs.dtype), ("pp",)), (xs, ys))[0]
        return jax.grad(loss)(params)
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("pp"), P(), P()), out_specs=P("pp")))


class _Half(NamedTuple):
    """One side of the comparison: its gradients, its compiled program's collectives and
    their formula, and the bytes the note quotes."""
    grads: dict
    measured: Collectives
    expected: Collectives
    nbytes: float


def _zero3_half(params, x, y) -> _Half:
    """ZeRO-3 over every device as dp; nbytes: what it moves a step."""
    dp_mesh = mesh_lib.make_mesh(dp=len(jax.devices()))
    dp = mesh_lib.axis_size(dp_mesh, DP)
    one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params)
    dims = zero.plan(one_layer, jax.tree.map(lambda _: P(), params), sizes=dict(dp_mesh.shape))
    stored = {k: zero.state_pspec(P(), d + 1 if d >= 0 else d, params[k].ndim) for k, d in dims.items()}
    compiled = _zero3_gradients(dp_mesh, dims, stored).lower(params, x, y).compile()
    # per layer and weight; the backward reads each again but the first layer's w1, which only
    # the input's gradient would read (and the data x needs none)
    each = [formulas.Weight(nbytes=a[0].nbytes, itemsize=a.dtype.itemsize, zero=True,
                            regather=not (layer == 0 and name == "w1"))
            for layer in range(STACK_LAYERS) for name, a in params.items()]
    moved = formulas.zero3_bytes(each, dp=dp, forward=1, backward=1, scatters=1)
    regathers = sum(w.regather for w in each)
    expected = Collectives({"all-gather": (len(each) + regathers, moved["all-gather"]),
                            "reduce-scatter": (len(each), moved["reduce-scatter"])} if dp > 1 else {})
    return _Half(compiled(params, x, y), compiled_collectives(compiled), expected,
                 moved["all-gather"] + moved["reduce-scatter"])


def _pp_half(params, x, y) -> _Half:
    """The 2-stage pipeline over PP_MICROBATCHES microbatches of the rows; nbytes: b*s*h of
    one microbatch's activation."""
    pp_mesh = mesh_lib.make_mesh(pp=PP_STAGES, devices=jax.devices()[:PP_STAGES])
    xs, ys = (a.reshape(PP_MICROBATCHES, -1, *a.shape[1:]) for a in (x, y))
    compiled = _pipeline_gradients(pp_mesh).lower(params, xs, ys).compile()
    activation = xs.shape[1] * STACK_SEQ * STACK_D * x.dtype.itemsize          # b*s*h of one microbatch
    sends = 2 * PP_MICROBATCHES                      # per microbatch: the activation forward, its gradient back
    return _Half(compiled(params, xs, ys), compiled_collectives(compiled),
                 Collectives({"collective-permute": (sends, sends * activation)}), activation)


def check_zero3_vs_pp() -> Result:
    """The lecture's comparison on one small model, both from compiled programs: ZeRO-3
    over every device as dp (the weights gathered twice and reduce-scattered once per
    step: about 3x their bytes) against a 2-stage pipeline (b*s*h of activations between
    the neighbours per microbatch, each way); both gradients against jax.grad. On one
    device the ZeRO-3 half runs alone (over dp=1 it moves nothing) and the note says why."""
    start = time.perf_counter()
    n = len(jax.devices())
    params, x, y = stack_inputs(2 * math.lcm(n, PP_MICROBATCHES))       # rows: split over dp and microbatches
    reference = jax.jit(jax.grad(stack_loss))(params, x, y)
    halves = {"ZeRO-3": _zero3_half(params, x, y)}
    if n >= PP_STAGES:
        halves["PP"] = _pp_half(params, x, y)
    errors, rule, within = compare({f"{k} grads": h.grads for k, h in halves.items()},
                                   {f"{k} grads": reference for k in halves})
    measured = {k: h.measured for k, h in halves.items()}
    expected = {k: h.expected for k, h in halves.items()}
    weights_bytes, moved = sum(a.nbytes for a in params.values()), halves["ZeRO-3"].nbytes
    zero3 = (f"ZeRO-3 moves {human_bytes(moved)} a step (2 all-gathers + 1 reduce-scatter: "
             f"{moved / weights_bytes:.2f}x the weights)" if n > 1 else "ZeRO-3 over dp=1 splits and moves nothing")
    notes = [f"{STACK_LAYERS} MLP layers {STACK_D}-{STACK_F}, weights {human_bytes(weights_bytes)}: {zero3}"]
    if "PP" in halves:
        activation, mb = halves["PP"].nbytes, x.shape[0] // PP_MICROBATCHES
        notes.append(f"PP moves b*s*h = {mb}*{STACK_SEQ}*{STACK_D} = {human_bytes(activation)} per microbatch each "
                     f"way, {human_bytes(2 * PP_MICROBATCHES * activation)} for {PP_MICROBATCHES} microbatches")
    else:
        notes.append(f"pipeline half skipped: {shortfall(needs=PP_STAGES, have=n)}")
    return Result(name="ZeRO-3 vs pipeline: bytes moved per step",
                  mesh=f"dp={n}" + (f" | pp={PP_STAGES}" if "PP" in halves else ""),
                  errors=errors, tolerance=rule, measured=measured, expected=expected,
                  passed=within and measured == expected, seconds=time.perf_counter() - start,
                  note="; ".join(notes))


def check_dp() -> list[Result]:
    """`jaxpar verify dp`: the gradient reduction, ZeRO-1, and ZeRO-3 against the pipeline."""
    return [check_reduction(), check_zero1(), check_zero3_vs_pp()]
