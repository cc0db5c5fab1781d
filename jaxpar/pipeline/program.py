"""The per-device pipeline program: a Plan executed by one `lax.scan` (lecture 2.4).

`Program(...)(params, inputs, targets, first_params, last_params)` runs inside a
shard_map over every mesh axis; `runtime.pipeline` builds that shard_map, and a composed
training step may call the program inside its own. At each step a device reads its row
of the plan's table, indexed by `lax.axis_index("pp")`, and runs two lanes, each a
`lax.switch`:
  backward lane  idle; B: the pullback of the output gradient from the residuals chunk
                 c's F kept (`passes.py`): the input gradient goes to the previous stage,
                 the weight gradient (unless the schedule splits the backward) is added in
                 place to the accumulator; on stage 0, the first-stage function's vjp too
                 (its parameters' gradient, and d loss / d inputs); W: the weight gradient
                 alone, from the output gradients a split B kept;
  forward lane   idle; F: stage 0 reads its microbatch (through the first-stage function,
                 e.g. the embedding of token ids), the others their received activation;
                 the stage runs under jax.vjp and its residuals go to a slot; on the last
                 stage the loss (with its own parameters, e.g. the LM head) and its
                 gradient, which waits here for this stage's B.
Then each channel's `ppermute` runs where the step's flags say (`plan.py`), and every
lane's output lands in the slot the table names. Buffers, residuals and accumulators
are scan carries updated in place (one dynamic update of a slot); the weight-gradient
accumulators go through the backward lane's branches, which idle passes through, so
nothing weight-sized is built or selected per step.

Typing: activations are varying over pp and the axes the batch is split over (`axes`);
parameters are typed varying over the same, so that no B all-reduces a weight gradient
(the transpose of an implicit pvary): the caller sums them once, at the end. A stage's
own collectives (tensor parallelism over tp, ...) are its business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxpar.collectives import varying
from jaxpar.errors import ConfigError
from jaxpar.mesh import PP
from jaxpar.pipeline import plan as plan_lib
from jaxpar.pipeline.plan import F as FIELD
from jaxpar.pipeline.plan import LANES
from jaxpar.pipeline.passes import shapes_and_axes


def take(buf, i):
    """buf[i] as one dynamic slice (an indexing gather's bounds check would select)."""
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def put(buf, i, value):
    """buf[i] = value in place: a dynamic update (`.at[i].set` is a scatter whose
    out-of-bounds rule makes XLA copy the whole buffer every step)."""
    return jax.lax.dynamic_update_index_in_dim(buf, value.astype(buf.dtype), i, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """plan: the tables; passes: a `passes.Stack` or `passes.Whole`; loss_fn(y, t) or, with
    `last_params`, loss_fn(last_params, y, t); first_fn(first_params, inputs) -> the first
    stage's activation, or None; axes: the axes activations vary over; scale: microbatches
    x batch shards (the loss is their mean); fill: what unused slots start with."""

    plan: plan_lib.Plan
    passes: object
    loss_fn: Callable
    first_fn: Callable | None
    last_params: bool
    axes: tuple[str, ...]
    scale: int
    fill: float
    loss_dtype: object
    input_grads: bool

    def activation(self, first_params, inputs) -> tuple[jax.ShapeDtypeStruct, tuple[str, ...]]:
        """The shape of one microbatch's activation and the axes it varies over: those of
        `axes`, and any the first stage adds (inside shard_map; a sequence-parallel
        embedding's output varies over tp, the activations between stages then too)."""
        if self.first_fn is None:
            act, extra = jax.ShapeDtypeStruct(inputs.shape[1:], inputs.dtype), jax.typeof(inputs)
        else:
            act = extra = jax.eval_shape(self.first_fn, first_params, inputs[0])
        extra = sorted(set(extra.manual_axis_type.varying) - set(self.axes))
        return act, (*self.axes, *extra)

    def __call__(self, params, inputs, targets, first_params=None, last_params=None):
        """params [v, Lc, ...], inputs / targets [m, mb, ...] -> (loss, grads [v, Lc, ...],
        d inputs [m, mb, ...] or None, first-stage grads, last-stage grads)."""
        pl, passes, axes = self.plan, self.passes, self.axes
        s = pl.schedule
        m, split, scale = s.microbatches, s.split_backward, self.scale
        table, flags = jnp.asarray(pl.table), jnp.asarray(pl.flags)
        me = jax.lax.axis_index(PP)
        params, first_params, last_params = varying((params, first_params, last_params), axes)
        act, act_axes = self.activation(first_params, inputs)
        self._check_stage(params, act, act_axes)
        passes.learn(params, varying(jnp.zeros(act.shape, act.dtype), act_axes))
        fill = lambda a: self.fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
        buf = lambda n, a: jnp.full((n + 1, *a.shape), fill(a), a.dtype)
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        d_inputs = self.input_grads
        carry = varying(dict(
            x=varying(buf(pl.n_x, act), act_axes), g=varying(buf(pl.n_g, act), act_axes),
            gw=varying(buf(pl.n_res, passes.kept), act_axes) if split else None,
            res=[varying(buf(pl.n_res, a), extra) for a, extra in zip(passes.stored, passes.stored_axes)],
            grads=zeros(params), first=zeros(first_params),
            last=zeros(last_params), dx=jnp.full(inputs.shape, fill(inputs), inputs.dtype) if d_inputs else None,
            loss=jnp.zeros((), self.loss_dtype)), axes)

        def first(fp, ids):
            return ids if self.first_fn is None else self.first_fn(fp, ids)

        def first_backward(fp, ids, g, f_acc):
            if self.first_fn is None:
                return g, f_acc
            if d_inputs:   # d loss / d inputs through the first-stage function
                d_fp, d_ids = jax.vjp(self.first_fn, fp, ids)[1](g)
            else:          # token ids: no gradient
                (d_fp,), d_ids = jax.vjp(lambda fp: self.first_fn(fp, ids), fp)[1](g), jnp.zeros(
                    inputs.shape[1:], inputs.dtype)
            return d_ids, jax.tree.map(jnp.add, f_acc, d_fp)

        def loss_and_grad(y, target, l_acc):
            if self.last_params:
                loss, (d_last, dy) = jax.value_and_grad(self.loss_fn, argnums=(0, 1))(last_params, y, target)
                l_acc = jax.tree.map(lambda a, d: a + d / scale, l_acc, d_last)
            else:
                loss, dy = jax.value_and_grad(self.loss_fn)(y, target)
            return (dy / scale).astype(y.dtype), (loss / scale).astype(self.loss_dtype), l_acc

        def f_idle(x_in, ids, target, e, l_acc):
            # the slot written is the trash slot: zeros of one slot (activations, not weights)
            zeros = [varying(jnp.zeros(a.shape, a.dtype), ex) for a, ex in zip(passes.stored, passes.stored_axes)]
            return x_in, zeros, jnp.zeros((), self.loss_dtype), l_acc

        # named scopes (LANE_SCOPES) let a reader of the compiled program count the collectives
        # of each branch exactly: the plan knows how often each runs on each device
        def f_run(x_in, ids, target, e, l_acc):
            with jax.named_scope("pipeline_F"):
                with jax.named_scope("pipeline_first"):
                    x = jax.lax.cond(e[FIELD["from_batch"]] > 0,
                                     lambda: varying(first(first_params, ids), act_axes), lambda: x_in)
                y, stored = passes.forward(params, e[FIELD["f_chunk"]], x)
                last = e[FIELD["f_branch"]] == plan_lib.F_BRANCHES.index("F_last")
                with jax.named_scope("pipeline_loss"):
                    out, loss, l_acc = jax.lax.cond(
                        last, lambda: varying(loss_and_grad(y, target, l_acc), axes),
                        lambda: varying((y, jnp.zeros((), self.loss_dtype), l_acc), axes))
                return varying((out, stored, loss, l_acc), axes)

        def b_idle(g_in, stored, kept, acc, f_acc, ids, e):
            return g_in, acc, f_acc, varying(jnp.zeros(passes.kept.shape, passes.kept.dtype), act_axes), jnp.zeros(
                inputs.shape[1:], inputs.dtype)

        def b_run(g_in, stored, kept, acc, f_acc, ids, e):
            with jax.named_scope("pipeline_B"):
                dx, acc, keep = passes.backward(params, e[FIELD["b_chunk"]], stored, g_in, acc, weights=not split)
                on_first = e[FIELD["dx_write"]] < m
                with jax.named_scope("pipeline_first_backward"):
                    d_in, f_acc = jax.lax.cond(
                        on_first, lambda: varying(first_backward(first_params, ids, dx, f_acc), axes),
                        lambda: varying((jnp.zeros(inputs.shape[1:], inputs.dtype), f_acc), axes))
                return varying((dx, acc, f_acc, keep, d_in), axes)

        def b_weight(g_in, stored, kept, acc, f_acc, ids, e):
            with jax.named_scope("pipeline_W"):
                acc = passes.weight(params, e[FIELD["b_chunk"]], stored, kept, acc)
                return varying(b_idle(g_in, stored, kept, acc, f_acc, ids, e), axes)

        f_branches = [lambda *a: varying(f_idle(*a), axes), f_run]
        b_branches = [lambda *a: varying(b_idle(*a), axes), b_run] + ([b_weight] if split else [])

        def step(carry, xs):
            row, flag = xs
            e = row[me]
            get = lambda name: e[FIELD[name]]
            c = dict(carry)
            # backward lane (B or W) first: it may free the residual slot this step's F takes
            slot = get("res_read")
            reads = (take(carry["g"], get("g_read")), [take(r, slot) for r in carry["res"]],
                     take(carry["gw"], slot) if split else None)
            b_out, c["grads"], c["first"], keep, d_in = jax.lax.switch(
                get("b_branch"), b_branches, *reads, carry["grads"], carry["first"],
                take(inputs, get("b_microbatch")), e)
            if split:
                c["gw"] = put(carry["gw"], get("gw_write"), keep)
            if d_inputs:  # dx is returned as it stands (no trash slot): row m-1 rewritten when idle
                j = jnp.minimum(get("dx_write"), m - 1)
                c["dx"] = put(carry["dx"], j, jnp.where(get("dx_write") < m, d_in, take(carry["dx"], j)))
            # forward lane
            i = get("f_microbatch")
            f_out, stored, loss, c["last"] = jax.lax.switch(
                jnp.minimum(get("f_branch"), 1), f_branches, take(carry["x"], get("x_read")), take(inputs, i),
                take(targets, i),
                e, carry["last"])
            # written here, not in the branch: a buffer passed through a conditional is copied
            c["res"] = [put(r, get("res_write"), new) for r, new in zip(carry["res"], stored)]
            c["loss"] = carry["loss"] + loss
            # every lane's output to where it is consumed: here, or one device over
            outs = {"F": f_out, "B": b_out}
            for j, (lane, direction) in enumerate(pl.sends):
                ch = "from_left" if direction == "right" else "from_right"
                with jax.named_scope(plan_lib.scope(lane, direction)):
                    received = jax.lax.cond(
                        flag[j], lambda v, p=pl.pairs[lane, direction]: jax.lax.ppermute(v, PP, p),
                        lambda v: v, outs[lane])
                for name in ("x", "g"):
                    if f"{lane}_{ch}_{name}" in pl.channels:
                        c[name] = put(c[name], get(f"{lane}_{ch}_{name}"), received)
            for lane in LANES:
                for name in ("x", "g"):
                    if f"{lane}_local_{name}" in pl.channels:
                        c[name] = put(c[name], get(f"{lane}_local_{name}"), outs[lane])
            return c, None

        if pl.steps:
            carry, _ = jax.lax.scan(step, carry, (table, flags))
        return carry["loss"], carry["grads"], carry["dx"], carry["first"], carry["last"]

    def _check_stage(self, params, act, act_axes):
        """A stage must keep the activation's shape, dtype and sharding type (traced here,
        inside shard_map, where its collectives are bound)."""
        x = varying(jnp.zeros(act.shape, act.dtype), act_axes)
        varies = ("stage_fn's output varies over more axes than its input: a per-shard stage returns its "
                  "activation laid out as it came in (sum partial results with psum, or split the batch over "
                  "that axis with batch_spec)")
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
