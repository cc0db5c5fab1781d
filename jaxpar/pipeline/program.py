"""The per-device pipeline program: a Plan executed by one `lax.scan` (lecture 2.4).

`Program(request, plan, passes)(params, inputs, targets, first_params, last_params)` runs
inside a shard_map over every mesh axis; `runtime.pipeline` builds that shard_map, and a
composed training step may call the program inside its own. Shapes on one device: params
[chunks, Lc, ...] (chunks of Lc layers each), inputs and targets [m, mb, ...] (m microbatches of
mb rows), an activation [mb, ...].

The scan's state is a `Carry` of named buffers. At each step a device reads its `Row` of
the plan's table (indexed by `lax.axis_index("pp")`) and runs, in `_Step`:
  backward lane  (`_Step.backward_lane`, a `lax.switch`) idle; B: the pullback of the
                 output gradient from the residuals chunk c's F stored (`passes.py`): the
                 input gradient goes to the previous stage, the weight gradient (unless the
                 schedule splits the backward) is added in place to the accumulator; on
                 stage 0, the first-stage function's vjp too (its parameters' gradient, and
                 d loss / d inputs); W: the weight gradient alone, from the output gradients
                 a split B kept;
  forward lane   (`_Step.forward_lane`) idle; F: stage 0 reads its microbatch (through the
                 first-stage function, e.g. the embedding of token ids), the others their
                 received activation; the stage runs under jax.vjp and its residuals go to
                 a slot; on the last stage the loss (with its own parameters, e.g. the LM
                 head) and its gradient, which waits here for this stage's B;
  deliveries     (`_Step.deliver`) each channel's `ppermute` where the step's flags say
                 (`plan.py`), and every lane's output into the slot the row names.
Buffers, residuals and accumulators are carried and updated in place (one dynamic update
of a slot); the weight-gradient accumulators go through the backward lane's branches,
which idle passes through, so nothing weight-sized is built or selected per step.

Typing: activations are varying over pp and the axes the batch is split over (`axes`);
parameters are typed varying over the same, so that no B all-reduces a weight gradient
(the transpose of an implicit pvary): the caller sums them once, at the end. A stage's
own collectives (tensor parallelism over tp, ...) are its business.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.collectives import varying, varying_axes
from jaxpar.errors import ConfigError
from jaxpar.mesh import PP
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline.passes import Residuals, Stack, Whole, shapes_and_axes
from jaxpar.pipeline.plan import F_BRANCHES, LANES, Row
from jaxpar.pipeline.request import Request


def accumulator_dtype(dtype):
    """The dtype gradients are summed in over the microbatches: float32 at least (bf16
    weights' gradients, under mixed precision, would lose the low bits of each addend)."""
    dtype = jnp.dtype(dtype)
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def take(buf, i):
    """buf[i] as one dynamic slice (an indexing gather's bounds check would select)."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def put(buf, i, value):
    """buf[i] = value in place: a dynamic update (`.at[i].set` is a scatter whose
    out-of-bounds rule makes XLA copy the whole buffer every step)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


class Carry(NamedTuple):
    """The scan's state on one device. A buffer has its slots + 1 entries: the last is
    the trash slot (`plan.py`)."""
    dx: jax.Array | None    # [m, mb, ...] d loss / d inputs (None: not asked for)
    first: Any              # the first-stage function's parameter gradients
    g: jax.Array            # [n_g + 1, mb, ...] output gradients (the loss's too), waiting for their B
    grads: Any              # [chunks, Lc, ...] the weight gradients, accumulated in place
    gw: jax.Array | None    # [n_res + 1, *kept] a split B's output gradients, until its W (None: not split)
    last: Any               # the loss's parameter gradients
    loss: jax.Array         # scalar: the loss, the microbatches' mean
    res: list               # per stored leaf [n_res + 1, ...]: an F's residuals, until its B (or W)
    x: jax.Array            # [n_x + 1, mb, ...] activations received, waiting for their F


class Forward(NamedTuple):
    """What the forward lane's branches read."""
    x: jax.Array            # [mb, ...] the received activation (not read on stage 0)
    ids: jax.Array          # [mb, ...] the microbatch's inputs (read on stage 0)
    target: jax.Array       # [mb, ...] its targets (read on the last stage)
    entry: jax.Array        # [columns] this device's row of the step's table, one operand
    last: Any               # the loss's parameter-gradient accumulator

    @property
    def row(self) -> Row:
        """The entry's fields by name."""
        return Row(*self.entry)


class ForwardOut(NamedTuple):
    """What the forward lane's branches return."""
    out: jax.Array          # [mb, ...] the activation for the next stage, or the loss gradient
    stored: list            # what F stores for its B (idle: zeros, to the trash slot)
    loss: jax.Array         # scalar: the microbatch's loss / scale on the last stage, else 0
    last: Any


class Backward(NamedTuple):
    """What the backward lane's branches read."""
    g: jax.Array            # [mb, ...] the output gradient
    stored: list            # the residual buffers [n_res + 1, ...]; slot row.res_read holds this action's F's
    kept: jax.Array | None  # the buffer of the output gradients split Bs kept (gw), read at row.res_read
    grads: Any              # [chunks, Lc, ...] the weight-gradient accumulator
    first: Any              # the first-stage gradient accumulator
    ids: jax.Array          # [mb, ...] the microbatch's inputs (stage 0's first-stage vjp)
    entry: jax.Array        # [columns] this device's row of the step's table, one operand

    @property
    def row(self) -> Row:
        """The entry's fields by name."""
        return Row(*self.entry)


class BackwardOut(NamedTuple):
    """What the backward lane's branches return."""
    dx: jax.Array           # [mb, ...] d loss / d stage input, for the previous stage's B
    grads: Any
    first: Any
    kept: jax.Array         # what a split B keeps for its W (otherwise zeros, unused)
    d_inputs: jax.Array     # [mb, ...] d loss / d inputs on stage 0's B, else zeros


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The per-device program of `request` on `plan`'s tables; `passes` (a `passes.Stack`
    or `passes.Whole`) run the stage's F, B and W."""

    request: Request
    plan: plan_lib.Plan
    passes: Stack | Whole

    @property
    def axes(self) -> tuple[str, ...]:
        return self.request.activation_axes

    def activation(self, first_params, inputs) -> tuple[jax.ShapeDtypeStruct, tuple[str, ...]]:
        """The shape of one microbatch's activation and the axes it varies over: those of
        `axes`, and any the first stage adds (inside shard_map; a sequence-parallel
        embedding's output varies over tp, the activations between stages then too)."""
        first_fn = self.request.first_fn
        if first_fn is None:
            act, first_out = jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype), inputs
        else:
            act = first_out = jax.eval_shape(first_fn, first_params, inputs[0])
        extra = sorted(set(varying_axes(first_out)) - set(self.axes))
        return act, (*self.axes, *extra)

    def __call__(self, params, inputs, targets, first_params=None, last_params=None):
        """params [chunks, Lc, ...], inputs / targets [m, mb, ...] -> (loss, grads [chunks, Lc, ...],
        d inputs [m, mb, ...] or None, first-stage grads, last-stage grads)."""
        tables = (jnp.asarray(self.plan.table), jnp.asarray(self.plan.flags))   # [steps, p, columns], [steps, ch]
        device = jax.lax.axis_index(PP)
        params, first_params, last_params = varying((params, first_params, last_params), self.axes)
        act, act_axes = self.activation(first_params, inputs)
        self._check_stage(params, act, act_axes)
        residuals = self.passes.learn(params, varying(jnp.zeros(act.shape, act.dtype), act_axes))
        step = _Step(self, residuals, params, first_params, last_params, inputs, targets, act_axes, device)
        carry = step.initial_carry(act)
        if self.plan.steps:
            carry, _ = jax.lax.scan(step, carry, tables)
        return carry.loss, carry.grads, carry.dx, carry.first, carry.last

    def _check_stage(self, params, act, act_axes):
        """A stage must keep the activation's shape, dtype and sharding type (traced here,
        inside shard_map, where its collectives are bound)."""
        x = varying(jnp.zeros(act.shape, act.dtype), act_axes)
        varies = ("stage_fn's output varies over more axes than its input: a per-shard stage returns its "
                  "activation laid out as it came in (sum partial results with psum, or split the batch over "
                  "that axis with batch_pspec)")
        try:
            (y,), (y_axes,) = shapes_and_axes(lambda: [self.passes.forward(params, 0, x)[0]])
        except TypeError as e:
            if "manual axis types do not match" in str(e):  # a layer's output, inside the layer scan
                raise ConfigError(f"{varies}. JAX: {str(e).splitlines()[0]}") from None
            raise
        if (y.shape, y.dtype) != (act.shape, act.dtype):
            raise ConfigError(f"stage_fn maps a microbatch {act.shape} {act.dtype} to {y.shape} {y.dtype}: a "
                              f"pipeline stage must keep the activation's shape and dtype")
        extra = set(y_axes) - set(act_axes)
        if extra:
            raise ConfigError(f"{varies}: over {sorted(extra)}")


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """The scan's body for one trace of a Program: what every step reads (the parameters
    [chunks, Lc, ...], the microbatches [m, mb, ...], the Residuals F stores, this device's pp
    rank) and the two lanes and the deliveries of one step."""

    program: Program
    residuals: Residuals
    params: Any
    first_params: Any
    last_params: Any
    inputs: jax.Array
    targets: jax.Array
    act_axes: tuple[str, ...]
    device: jax.Array

    @property
    def axes(self) -> tuple[str, ...]:
        return self.program.axes

    @property
    def split(self) -> bool:
        return self.program.plan.schedule.split_backward

    def initial_carry(self, act: jax.ShapeDtypeStruct) -> Carry:
        """Empty buffers: slots of a floating dtype start as `bubble_fill` (NaN shows that
        nothing reads them), the accumulators and the loss at zero."""
        req, plan, res = self.program.request, self.program.plan, self.residuals
        fill = lambda a: req.bubble_fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
        buf = lambda n, a: jnp.full((n + 1, *a.shape), fill(a), a.dtype)
        zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros_like(a, accumulator_dtype(a.dtype)), tree)
        return varying(Carry(
            x=varying(buf(plan.n_x, act), self.act_axes), g=varying(buf(plan.n_g, act), self.act_axes),
            gw=varying(buf(plan.n_res, res.kept), self.act_axes) if self.split else None,
            res=[varying(buf(plan.n_res, a), axes) for a, axes in zip(res.stored, res.axes)],
            grads=zeros(self.params), first=zeros(self.first_params), last=zeros(self.last_params),
            dx=jnp.full(self.inputs.shape, fill(self.inputs), self.inputs.dtype) if req.input_grads else None,
            loss=jnp.zeros((), req.loss_dtype)), self.axes)

    def __call__(self, carry: Carry, tables) -> tuple[Carry, None]:
        """One step: the backward lane first (it may free the residual slot this step's F
        takes), then the forward lane, then the deliveries."""
        table, flags = tables                    # [p, columns], [channels]
        entry = table[self.device]               # [columns]
        carry, b_out = self.backward_lane(carry, entry)
        carry, f_out = self.forward_lane(carry, entry)
        return self.deliver(carry, Row(*entry), flags, {"F": f_out, "B": b_out}), None

    # ---- the backward lane: idle, B or W -------------------------------------------------

    def backward_lane(self, carry: Carry, entry: jax.Array) -> tuple[Carry, jax.Array]:
        """B or W of microbatch row.b_microbatch on chunk row.b_chunk, or nothing. Reads
        g[g_read] [mb, ...], the residuals res[res_read] and (split) gw[res_read]; adds
        the weight and first-stage gradients in place; writes what a split B keeps to
        gw[gw_write] and d loss / d inputs [mb, ...] to dx[dx_write]. Returns the carry
        and d loss / d stage input [mb, ...], for the previous stage."""
        row, m = Row(*entry), self.program.plan.schedule.microbatches
        # the residual buffers go in whole and B (or W) reads its slot inside its branch: a
        # buffer a conditional only reads is not copied, and an idle step reads nothing
        operands = Backward(g=take(carry.g, row.g_read), stored=carry.res,
                            kept=carry.gw if self.split else None, grads=carry.grads,
                            first=carry.first, ids=take(self.inputs, row.b_microbatch), entry=entry)
        branches = [lambda op: varying(self._backward_idle(op), self.axes), self._backward]
        out = jax.lax.switch(row.b_branch, branches + ([self._weight] if self.split else []), operands)
        carry = carry._replace(grads=out.grads, first=out.first)
        if self.split:
            carry = carry._replace(gw=put(carry.gw, row.gw_write, out.kept))
        if self.program.request.input_grads:  # dx is returned as it stands (no trash slot): row m-1 rewritten when idle
            j = jnp.minimum(row.dx_write, m - 1)
            carry = carry._replace(dx=put(carry.dx, j, jnp.where(row.dx_write < m, out.d_inputs, take(carry.dx, j))))
        return carry, out.dx

    def _backward_idle(self, op: Backward) -> BackwardOut:
        kept = self.residuals.kept
        return BackwardOut(dx=op.g, grads=op.grads, first=op.first,
                           kept=varying(jnp.zeros(kept.shape, kept.dtype), self.act_axes),
                           d_inputs=jnp.zeros(self.inputs.shape[1:], self.inputs.dtype))

    # named scopes (plan.LANE_SCOPES) let a reader of the compiled program count the
    # collectives of each branch exactly: the plan knows how often each runs on each device
    def _backward(self, op: Backward) -> BackwardOut:
        with jax.named_scope("pipeline_B"):
            stored = [take(r, op.row.res_read) for r in op.stored]
            dx, grads, kept = self.program.passes.backward(self.params, op.row.b_chunk, stored, op.g, op.grads,
                                                           weights=not self.split, template=self.residuals.template)
            on_first = op.row.dx_write < self.program.plan.schedule.microbatches
            with jax.named_scope("pipeline_first_backward"):
                d_inputs, first = jax.lax.cond(
                    on_first, lambda: varying(self._first_backward(op.ids, dx, op.first), self.axes),
                    lambda: varying((jnp.zeros(self.inputs.shape[1:], self.inputs.dtype), op.first), self.axes))
            return varying(BackwardOut(dx, grads, first, kept, d_inputs), self.axes)

    def _weight(self, op: Backward) -> BackwardOut:
        with jax.named_scope("pipeline_W"):
            stored = [take(r, op.row.res_read) for r in op.stored]
            kept = take(op.kept, op.row.res_read)
            grads = self.program.passes.weight(self.params, op.row.b_chunk, stored, kept, op.grads,
                                               template=self.residuals.template)
            return varying(self._backward_idle(op._replace(grads=grads)), self.axes)

    def _first_backward(self, ids, g, first_acc) -> tuple[jax.Array, Any]:
        """(d loss / d inputs [mb, ...], first_acc + d loss / d first_params) from the
        output gradient g of the first-stage function (identity without one)."""
        first_fn = self.program.request.first_fn
        if first_fn is None:
            return g, first_acc
        if self.program.request.input_grads:   # d loss / d inputs through the first-stage function
            d_first, d_ids = jax.vjp(first_fn, self.first_params, ids)[1](g)
        else:                                  # token ids: no gradient
            (d_first,), d_ids = jax.vjp(lambda fp: first_fn(fp, ids), self.first_params)[1](g), jnp.zeros(
                self.inputs.shape[1:], self.inputs.dtype)
        return d_ids, jax.tree.map(jnp.add, first_acc, d_first)

    # ---- the forward lane: idle, F, or F with the loss -------------------------------------

    def forward_lane(self, carry: Carry, entry: jax.Array) -> tuple[Carry, jax.Array]:
        """F of microbatch row.f_microbatch on chunk row.f_chunk (the loss too on the last
        stage), or nothing. Reads x[x_read] [mb, ...] or, on stage 0, the microbatch's
        inputs; writes the residuals to res[res_write] and adds the loss. Returns the
        carry and the output [mb, ...]: the next stage's activation or the loss gradient."""
        row = Row(*entry)
        i, branch = row.f_microbatch, jnp.minimum(row.f_branch, 1)
        operands = Forward(x=take(carry.x, row.x_read), ids=take(self.inputs, i), target=take(self.targets, i),
                           entry=entry, last=carry.last)
        branches = [lambda op: varying(self._forward_idle(op), self.axes), self._forward]
        out = jax.lax.switch(branch, branches, operands)
        # written here, not in the branch: a buffer passed through a conditional is copied
        res = [put(r, row.res_write, new) for r, new in zip(carry.res, out.stored)]
        return carry._replace(res=res, loss=carry.loss + out.loss, last=out.last), out.out

    def _forward_idle(self, op: Forward) -> ForwardOut:
        # the slot written is the trash slot: zeros of one slot (activations, not weights)
        res = self.residuals
        zeros = [varying(jnp.zeros(a.shape, a.dtype), axes) for a, axes in zip(res.stored, res.axes)]
        return ForwardOut(op.x, zeros, jnp.zeros((), self.program.request.loss_dtype), op.last)

    def _forward(self, op: Forward) -> ForwardOut:
        req = self.program.request
        with jax.named_scope("pipeline_F"):
            with jax.named_scope("pipeline_first"):
                x = jax.lax.cond(op.row.from_batch > 0, lambda: varying(self._first(op.ids), self.act_axes),
                                 lambda: op.x)
            y, stored = self.program.passes.forward(self.params, op.row.f_chunk, x)
            last = op.row.f_branch == F_BRANCHES.index("F_last")
            with jax.named_scope("pipeline_loss"):
                out, loss, last_acc = jax.lax.cond(
                    last, lambda: varying(self._loss_and_grad(y, op.target, op.last), self.axes),
                    lambda: varying((y, jnp.zeros((), req.loss_dtype), op.last), self.axes))
            return varying(ForwardOut(out, stored, loss, last_acc), self.axes)

    def _first(self, ids) -> jax.Array:
        first_fn = self.program.request.first_fn
        return ids if first_fn is None else first_fn(self.first_params, ids)

    def _loss_and_grad(self, y, target, last_acc) -> tuple[jax.Array, jax.Array, Any]:
        """(d loss / d y [mb, ...], loss, last_acc + d loss / d last_params), each / scale."""
        req = self.program.request
        if req.has_last:
            loss, (d_last, dy) = jax.value_and_grad(req.loss_fn, argnums=(0, 1))(self.last_params, y, target)
            last_acc = jax.tree.map(lambda a, d: a + d / req.scale, last_acc, d_last)
        else:
            loss, dy = jax.value_and_grad(req.loss_fn)(y, target)
        return (dy / req.scale).astype(y.dtype), (loss / req.scale).astype(req.loss_dtype), last_acc

    # ---- the deliveries --------------------------------------------------------------------

    def deliver(self, carry: Carry, row: Row, flags, outs: dict[str, jax.Array]) -> Carry:
        """Every lane's output [mb, ...] to the slot where it is consumed: one device over,
        through its channel's ppermute (run where the step's flags open it, the same on
        every device), or on this device."""
        plan = self.program.plan
        for j, (lane, direction) in enumerate(plan.channels):
            with jax.named_scope(plan_lib.scope(lane, direction)):
                received = jax.lax.cond(
                    flags[j], lambda value, pairs=plan.pairs[lane, direction]: jax.lax.ppermute(value, PP, pairs),
                    lambda value: value, outs[lane])
            carry = self._land(carry, row, lane, direction, received)
        for lane in LANES:
            carry = self._land(carry, row, lane, None, outs[lane])
        return carry

    def _land(self, carry: Carry, row: Row, lane: str, direction: str | None, value) -> Carry:
        """value into x and g at the slots the row names for (lane, direction), where the
        plan uses that delivery."""
        for buffer in ("x", "g"):
            field = plan_lib.delivery_field(lane, direction, buffer)
            if field in self.program.plan.deliveries:
                carry = carry._replace(**{buffer: put(getattr(carry, buffer), getattr(row, field), value)})
        return carry

