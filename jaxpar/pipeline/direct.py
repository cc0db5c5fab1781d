"""The program of a one-stage pipeline (pp = 1), without the pipeline's machinery.

    program = Direct(request)          # request.schedule.stages == 1
    loss, grads, dx, g_first, g_last = program(params, inputs, targets, first, last)

The same call and results as `program.Program` (params [chunks, Lc, ...], inputs / targets
[m, mb, ...]; the gradients not yet summed over the batch axes), computed the way an
unpipelined trainer does: one `jax.value_and_grad` of first_fn, the layers in order and
loss_fn, accumulated over the m microbatches by a `lax.scan` (gradient accumulation;
m = 1: no loop). With one stage the schedule has nothing to order: a plan's scan, its
switch over lanes and its slot buffers would only cost time, and XLA fuses across a
plain value_and_grad that it cannot across the plan's branches.

`request.recompute` wraps each layer in `jax.checkpoint` (keep only its input). The
parameters enter varying over the activation axes (pp and the batch axes), as in the
pipeline program, so their gradients stay per-device partial sums for the caller's one
reduction (`jaxpar.data.reduce_gradients`). Everything it runs sits under the named scope
SCOPE, so a reader of the compiled program can tell the stage's collectives (tp, cp, ep:
the same as the pipeline's branches run) from the caller's reductions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.collectives import varying
from jaxpar.errors import ConfigError
from jaxpar.pipeline.program import accumulator_dtype
from jaxpar.pipeline.request import Request
from jaxpar.pipeline.stage import layers, unstack

SCOPE = "pipeline_direct"


@dataclasses.dataclass(frozen=True, eq=False)
class Direct:
    """The per-device step of a one-stage `request` (see the module docstring)."""

    request: Request

    def __post_init__(self):
        if self.request.schedule.stages != 1:
            raise ConfigError(f"Direct runs a one-stage pipeline; this schedule has {self.request.schedule.stages} "
                              "stages: use pipeline.runtime.local")

    @property
    def axes(self) -> tuple[str, ...]:
        return self.request.activation_axes

    def _forward(self, params, first_params, last_params, x, target):
        """One microbatch's loss / scale: first_fn, every layer of params [chunks, Lc, ...] in order, loss_fn."""
        req = self.request
        h = x if req.first_fn is None else req.first_fn(first_params, x)
        stage = req.stage_fn
        per_layer = [p for chunk in unstack(params) for p in unstack(chunk)] if isinstance(stage, layers) else None
        if per_layer is not None:
            layer = jax.checkpoint(stage.layer_fn) if req.recompute == "full" else stage.layer_fn
            for p in per_layer:
                h = layer(p, h)
        else:
            chunk_fn = jax.checkpoint(stage) if req.recompute == "full" else stage
            for chunk in unstack(params):
                h = chunk_fn(chunk, h)
        loss = req.loss_fn(last_params, h, target) if req.has_last else req.loss_fn(h, target)
        return (loss / req.scale).astype(req.loss_dtype)

    def __call__(self, params, inputs, targets, first_params=None, last_params=None):
        """params [chunks, Lc, ...], inputs / targets [m, mb, ...] -> (loss, grads [chunks, Lc, ...],
        None, first-stage grads, last-stage grads): `Program`'s results (no input gradients)."""
        if self.request.input_grads:
            raise ConfigError("Direct does not return input gradients: use pipeline.runtime.local")
        with jax.named_scope(SCOPE):
            return self._accumulate(*varying((params, first_params, last_params), self.axes), inputs, targets)

    def _accumulate(self, params, first_params, last_params, inputs, targets):
        """The loss and gradients summed over the microbatches (m = 1: no loop)."""
        grad_fn = jax.value_and_grad(self._forward, argnums=(0, 1, 2))
        m = inputs.shape[0]
        if m == 1:
            loss, (g, g_first, g_last) = grad_fn(params, first_params, last_params, inputs[0], targets[0])
            return loss, g, None, g_first, g_last

        def accumulate(carry, batch):
            loss, grads = grad_fn(params, first_params, last_params, *batch)
            return jax.tree.map(lambda acc, new: acc + new.astype(acc.dtype), carry, (loss, grads)), None

        zeros = jax.tree.map(lambda a: jnp.zeros_like(a, accumulator_dtype(a.dtype)),
                             (jnp.zeros((), self.request.loss_dtype), (params, first_params, last_params)))
        (loss, (g, g_first, g_last)), _ = jax.lax.scan(accumulate, varying(zeros, self.axes), (inputs, targets))
        return loss, g, None, g_first, g_last
