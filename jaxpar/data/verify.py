"""Data parallelism proven against the unsharded model, for `jaxpar verify dp` and the tour:
a two-layer MLP over every device as dp, each device differentiating its rows' share of
the mean loss, then

  * the gradient reduction (`reduce.reduce_gradients`) against jax.grad of the whole
    batch's loss: every gradient;
  * ZeRO-1 (`zero`): two AdamW steps with the gradients reduce-scattered, each dp rank
    updating its dp-th of every weight with its dp-th of the state, and the weights
    all-gathered, against optax's AdamW on the whole model: the weights and the state;

each compiled program's collectives against `formulas.dp_collectives`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import mesh as mesh_lib
from jaxpar.collectives import varying
from jaxpar.comms import human_bytes
from jaxpar.data import formulas, zero
from jaxpar.data.reduce import reduce_gradients, weights
from jaxpar.mesh import DP
from jaxpar.testing import Result, compare, compiled_collectives

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


def zero1_step(mesh, pspecs, dims, batch_axes, state_specs, rows):
    """One jitted ZeRO-1 AdamW step (params, state, x, y) -> (params, state) on `mesh`."""
    def per_device(params, state, x, y):
        grads = zero.reduce_scatter_gradients(_share(params, x, y, batch_axes), pspecs, dims, batch_axes=batch_axes)
        own = zero.slice_params(params, dims)              # this rank's dp-th of each weight
        updates, state = OPTIM.update(grads, state, own)   # on dp-ths, with a dp-th of the state
        return zero.gather_params(optax.apply_updates(own, updates), dims), state

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(pspecs, state_specs, rows, rows),
                                 out_specs=(pspecs, state_specs)))


def check_zero1(steps: int = 2) -> Result:
    """`steps` AdamW steps under ZeRO-1 against optax's AdamW on the unsharded model."""
    start = time.perf_counter()
    mesh, params, x, y, pspecs, batch_axes, rows = _setting()
    sizes = dict(mesh.shape)
    dims = zero.plan(params, pspecs, sizes=sizes)
    state = OPTIM.init(params)
    state_specs = optax.tree_map_params(OPTIM, lambda _, s: s, state, zero.state_pspecs(pspecs, dims, params),
                                        transform_non_params=lambda _: P())
    state = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs))
    compiled = zero1_step(mesh, pspecs, dims, batch_axes, state_specs, rows).lower(params, state, x, y).compile()

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


def check_dp() -> list[Result]:
    """`jaxpar verify dp`: the gradient reduction and ZeRO-1."""
    return [check_reduction(), check_zero1()]
