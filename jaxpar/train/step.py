"""ONE jitted training step: one shard_map over every axis (docs/train.md).

    trainer = Trainer(cfg, ParallelSpec(dp=2, pp=2, tp=2, microbatches=2), OptimConfig(),
                      batch_size=8, seq_len=16)
    state = trainer.init(jax.random.key(0))
    state, metrics = trainer.step(state, tokens)     # tokens int[B, T+1]; metrics: loss, norm, lr

The tokens enter split by rows over the batch axes (`Trainer.token_sharding`, from
`batch_pspecs`): each device (each process) holds only its rows, and the step cuts its
inputs and targets from them without a collective.

The Trainer is built by the recipe (`recipe.py`: each technique applied to the model in the lecture's
order, then assembled) and holds what it built as declared fields; a `TrainerCache` (cache.py) reuses one.

Inside the one shard_map, on every device:
  1. the pipeline program over pp (`recipe.program`: any schedule), whose stages are the
     blocks `recipe.compose` composed (TP/SP over tp, ring or Ulysses over cp, the MoE
     over ep), the vocab-parallel embedding on the first stage and the LM head and
     cross-entropy on the last;
  2. one gradient reduction (`jaxpar.data`): each weight's gradient summed over the
     batch axes (dp, ep, cp) its pspec does not split; the embedding's and the head's also
     over pp (only their stage's device holds a nonzero one). Under ZeRO-1 the dp part of the
     sum is a reduce-scatter instead: each dp rank gets its dp-th of the gradient
     (along one dimension its shard divides), updates that dp-th of the weight with its
     dp-th of the optimizer state, and an all-gather over dp rebuilds the weight
     (ZeRO-2: the same program). Under ZeRO-3 the weights are stored as their dp-th and
     gathered inside each layer (`model.zero3_dims`, `data.zero.gathered`), whose
     backward reduce-scatters their gradient: the reduction skips dp for them, and
     nothing is gathered after the update;
  3. the true global gradient norm (`optim.global_norm`), clipping, optax AdamW;
  4. with MoE load balancing (`balance.py`), the per-layer loads and balance-loss values
     the stages handed back, summed over the batch axes and tp in one all-reduce: the
     balance loss joins the reported loss, the load moves the router bias.

The state between steps (`TrainState`) holds the blocks in the pipeline's stage layout
[pp, chunks, L/(pp chunks), ...] split over pp (uneven stages, `spec.layers_per_stage`: [pp, chunks,
the largest count, ...], each stage's layers first and zeros after; the zeros get a zero
gradient, so AdamW leaves them zero, and `canonical` drops them), the rest as their pspecs say; `canonical` turns it
into reference.init_params's structure (what checkpoints hold, whatever the mesh).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.data import zero
from jaxpar.data.reduce import reduce_gradients
from jaxpar.mesh import PP, TP
from jaxpar.pipeline import runtime
from jaxpar.pipeline.direct import Direct
from jaxpar.pipeline.stage import from_stages, to_microbatches, to_stages
from jaxpar.schedules.schedule import Schedule
from jaxpar.train import balance, recipe
from jaxpar.train import model as model_lib
from jaxpar.train import optim as optim_lib
from jaxpar.train.recipe import batch_pspecs
from jaxpar.train.spec import ParallelSpec, device_list


class TrainState(NamedTuple):
    step: jax.Array        # int32 scalar: steps taken
    params: dict           # {"blocks": stage layout, "first": {"embed"}, "last": {"final_norm", "unembed"}}
    opt: Any               # optax AdamW state, mu and nu laid out as params (ZeRO-1: also split over dp)


def _with_unit(pspec: P) -> P:
    """pspec with pp (of size 1) added to its first dimension."""
    e = pspec[0] if len(pspec) else None
    return P(PP if e is None else (*(e if isinstance(e, tuple) else (e,)), PP), *pspec[1:])


def _built():
    """A Trainer field set once by its own __post_init__ (never a constructor argument)."""
    return dataclasses.field(init=False, repr=False)


@dataclasses.dataclass(eq=False)
class Trainer:
    """The model `cfg` trained on `spec`'s mesh with `optim`, on batches int[batch_size,
    seq_len + 1]. Everything is checked (ConfigError listing every problem) before
    anything compiles. Each Trainer traces and compiles its own step; to reuse one across a
    process (the tests do), ask a `TrainerCache` for it."""

    cfg: reference.ModelConfig
    spec: ParallelSpec
    optim: optim_lib.OptimConfig = dataclasses.field(default_factory=optim_lib.OptimConfig)
    batch_size: int = 8
    seq_len: int = 16
    devices: Any = None
    dtype: Any = jnp.float32
    # mixed precision (MaxText's dtype / weight_dtype): the layers run in compute_dtype
    # (jnp.bfloat16), the state (master weights, AdamW) stays in dtype; None: compute in dtype.
    # Read back resolved: None when it is dtype (no cast at all)
    compute_dtype: Any = None
    # the attention's kernel: "auto" (on a GPU for 16-bit layers: cuDNN's flash attention
    # over whole sequences; a ring's blocks as kernels.attention.choose_block says), "xla",
    # "cudnn" or "pallas" (recipe.choose_kernel); `kernel` says which runs
    attention_kernel: str = "auto"
    # what runs an MoE's grouped experts: "auto" (the XLA batched matmuls until the Pallas
    # kernel has run on a GPU: kernels.grouped.PALLAS_AUTO), "xla", or "pallas" (kernels.grouped,
    # on a GPU at ep = 1); `expert_matmuls` says which runs
    expert_kernel: str = "auto"

    # ---- built from the arguments above, in __post_init__'s order ----
    kernel: str = _built()                   # "cudnn", "pallas" or "xla": what the layers' attention runs
    expert_matmuls: str = _built()           # "pallas" or "xla": what runs the experts' grouped matmuls
    layers: recipe.Layers = _built()         # the model composed technique by technique (recipe.compose)
    mesh: jax.sharding.Mesh = _built()
    schedule: Schedule = _built()
    local: runtime.Local = _built()          # the pipeline program and its checked Request
    layers_per_stage: tuple | None = _built()    # the stage layout's padding (None: even stages)
    token_sharding: NamedSharding = _built()  # the tokens as `put`, `lower`, the loop place them
    batch_pspec: P = _built()                 # the inputs' and targets' pspec inside the shard_map
    tx: optax.GradientTransformation = _built()
    param_pspecs: dict = _built()             # {"blocks", "first", "last"}: the weights' pspecs
    shapes: dict = _built()                  # the weights' shapes in the state's layout
    zero_dims: dict = _built()               # per weight: the dimension ZeRO splits over dp (-1: whole)
    state_param_pspecs: dict = _built()       # the optimizer state's pspecs (ZeRO: split over dp)
    stored_param_pspecs: dict = _built()      # the weights' as stored (ZeRO-3: the state's)
    state_pspecs: TrainState = _built()
    shardings: TrainState = _built()
    _step: Any = _built()                    # the jitted step
    _programs: dict = _built()               # its compiled program and the state's jitted layouts

    def __post_init__(self):
        devices = self._checked_devices()
        compute = recipe.layer_dtype(self.compute_dtype, self.dtype)
        self.compute_dtype = None if compute == jnp.dtype(self.dtype) else compute
        self.kernel = recipe.choose_kernel(self.attention_kernel, self.cfg, self.spec, seq_len=self.seq_len,
                                           dtype=compute, platform=devices[0].platform)
        self.expert_matmuls = recipe.choose_expert_kernel(self.expert_kernel, self.cfg, self.spec,
                                                          platform=devices[0].platform)
        self.layers = recipe.compose(self.cfg, self.spec, seq_len=self.seq_len, batch_size=self.batch_size,
                                     kernel=self.kernel, expert_kernel=self.expert_matmuls,
                                     compute_dtype=self.compute_dtype)
        self.mesh = self.spec.mesh(devices)
        shapes = model_lib.split(jax.eval_shape(lambda: reference.init_params(jax.random.key(0), self.cfg,
                                                                              self.dtype)))
        self.local = recipe.program(self.layers, self.spec, self.mesh, shapes)
        self.schedule = self.layers.schedule
        self.layers_per_stage = self.local.request.layers_per_stage if self.local.request.uneven else None
        token_pspec, self.batch_pspec = batch_pspecs(self.spec)
        self.token_sharding = NamedSharding(self.mesh, token_pspec)
        self.tx = self.optim.transform()
        self._lay_out_state(shapes)
        self._step, self._programs = self._build(), {}

    def _checked_devices(self) -> list:
        if not isinstance(self.spec, ParallelSpec):
            raise ConfigError(f"spec is a {type(self.spec).__name__}, not a jaxpar.train.ParallelSpec")
        if not isinstance(self.optim, optim_lib.OptimConfig):
            raise ConfigError(f"optim is a {type(self.optim).__name__}, not a jaxpar.train.OptimConfig")
        devices = device_list(self.devices)
        self.spec.check(self.cfg, batch_size=self.batch_size, seq_len=self.seq_len, n_devices=len(devices))
        return devices

    def _lay_out_state(self, shapes: dict):
        """The state on the mesh: the weights' pspecs and shapes in the stage layout, ZeRO's
        split of the optimizer state (`_plan_zero`), and the state's pspecs and shardings."""
        req = self.local.request
        # over pp of one device the program's values still vary over pp (a psum over a group
        # of one would stay in the program): their pspecs name pp, which splits nothing
        unit = _with_unit if self.spec.pp == 1 else (lambda s: s)
        is_p = lambda x: isinstance(x, P)
        self.param_pspecs = {"blocks": jax.tree.map(runtime.staged, req.param_pspecs),
                            "first": jax.tree.map(unit, req.first_pspecs, is_leaf=is_p),
                            "last": jax.tree.map(unit, req.last_pspecs, is_leaf=is_p)}
        self.shapes = jax.eval_shape(self._staged, shapes)
        self._plan_zero()
        opt_shapes = jax.eval_shape(self.tx.init, self.shapes)
        opt_pspecs = optax.tree_map_params(self.tx, lambda _, s: s, opt_shapes, self.state_param_pspecs,
                                          transform_non_params=lambda _: P())
        self.state_pspecs = TrainState(step=P(), params=self.stored_param_pspecs, opt=opt_pspecs)
        self.shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.state_pspecs, is_leaf=is_p)

    # ---- layout ---------------------------------------------------------------------------

    def _staged(self, tree: dict) -> dict:
        return {**tree, "blocks": to_stages(tree["blocks"], self.schedule, self.layers_per_stage)}

    def _plan_zero(self):
        """Per leaf: the dimension ZeRO splits its optimizer state along over dp (-1:
        whole; `data.zero.plan`, never the blocks' pp dimension), the state's specs, and
        the weights' as stored: under ZeRO-3 the optimizer state's (split over dp too, along
        the dimension one layer's function gathers: `model.zero3_dims`, 3 more in the
        blocks' layout [pp, chunks, Lc, ...]); else the weights' own."""
        if self.spec.zero == 3:
            dims = self.layers.zero_dims
            self.zero_dims = {**dims, "blocks": {k: d + 3 if d >= 0 else d for k, d in dims["blocks"].items()}}
        elif self.spec.zero:
            self.zero_dims = {k: zero.plan(self.shapes[k], self.param_pspecs[k], sizes=self.mesh.shape,
                                           skip=1 if k == "blocks" else 0) for k in self.shapes}
            if "router_bias" in self.zero_dims["blocks"]:    # moved by update_bias, not AdamW: nothing to shard
                self.zero_dims["blocks"]["router_bias"] = -1
        else:
            self.zero_dims = jax.tree.map(lambda _: -1, self.shapes)
        self.state_param_pspecs = zero.state_pspecs(self.param_pspecs, self.zero_dims, self.shapes)
        self.stored_param_pspecs = self.state_param_pspecs if self.spec.zero == 3 else self.param_pspecs

    # ---- the step -------------------------------------------------------------------------

    def _build(self):
        """The jitted step: `_loss_and_gradients` and `_update` on every device, in one shard_map."""
        req = self.local.request
        # one stage: nothing to schedule, the plain value_and_grad (pipeline.direct)
        program = Direct(req) if self.spec.pp == 1 else self.local.program

        def per_device(state, inputs, targets):
            loss, grads, load = self._loss_and_gradients(program, state.params, inputs, targets)
            params, opt, norm = self._update(state, grads, load)
            metrics = dict(loss=loss[None], norm=norm[None], lr=self.optim.schedule()(state.step))
            return TrainState(step=state.step + 1, params=params, opt=opt), metrics

        per_pp = P(PP) if self.spec.pp == 1 else P(None)      # the loss and norm: one value (per pp rank)
        metric_pspecs = dict(loss=per_pp, norm=per_pp, lr=P())
        sharded = jax.shard_map(per_device, mesh=self.mesh, in_specs=(self.state_pspecs, self.batch_pspec,
                                                                      self.batch_pspec),
                                out_specs=(self.state_pspecs, metric_pspecs))
        spec = self.spec

        def step(state, tokens):
            # tokens int[B_(dp ep), T+1] as `token_sharding` splits them: each device cuts
            # its rows' inputs and targets [B_(dp ep), T_cp] locally (no collective)
            inputs, targets = model_lib.to_layout(tokens, spec)
            state, metrics = sharded(state, inputs, targets)
            return state, {**metrics, "loss": metrics["loss"][0], "norm": metrics["norm"][0]}
        return jax.jit(step, donate_argnums=(0,), compiler_options=runtime.compiler_options(self.mesh))

    @property
    def _pp_axes(self) -> tuple[str, ...]:
        """(PP,) when the pipeline has several stages: the first and last stages' sums run over it."""
        return (PP,) if self.spec.pp > 1 else ()

    def _loss_and_gradients(self, program, params, inputs, targets):
        """This device's part of the step's math: (the loss summed over the batch axes and pp,
        the gradients {"blocks", "first", "last"} before data parallelism's reduction, in
        the weights' dtype, the MoE layers' loads [chunks, Lc, E] or None). inputs / targets
        [B', T'] are this device's tokens; `program` the pipeline (or one-stage) program."""
        cfg, tp, batch_axes = self.cfg, self.spec.tp, self.local.request.batch_axes
        balancing = balance.enabled(cfg)
        # mixed precision: the weights as the layers use them, cast before any layer
        compute_dtype = self.layers.compute_dtype
        weights = reference.cast(params, compute_dtype)
        blocks = jax.tree.map(lambda a: a[0], weights["blocks"])
        if balancing:
            blocks = {**blocks, balance.STATS: balance.slots(blocks, cfg, tp, self.dtype)}
        m = self.schedule.microbatches
        xs, ts = to_microbatches(inputs, m), to_microbatches(targets, m)            # [m, mb, ...]
        loss, g_blocks, _, g_first, g_last = program(blocks, xs, ts, weights["first"], weights["last"])
        if compute_dtype is not None:      # the cast's transpose: reductions and AdamW in dtype
            g_blocks, g_first, g_last = reference.cast((g_blocks, g_first, g_last), self.dtype)
        load = None
        if "router_bias" in g_blocks:     # it only chooses: its gradient is zero, and reduced as one, XLA drops it
            g_blocks = {**g_blocks, "router_bias": jnp.zeros_like(g_blocks["router_bias"])}
        if balancing:
            stats_axes = batch_axes + ((TP,) if tp > 1 else ())
            load, aux = balance.totals(g_blocks.pop(balance.STATS), stats_axes)   # [chunks, Lc, E], [chunks, Lc]
            # this pp rank's layers' balance loss, folded into the loss's own sum over the
            # batch axes (each of the `shards` adds its share) and pp
            shards = math.prod(self.mesh.shape[a] for a in batch_axes)
            loss = loss + (cfg.aux_loss / self.batch_size * jnp.sum(aux) / shards).astype(loss.dtype)
        over = batch_axes + self._pp_axes
        loss = jax.lax.psum(loss, over) if over else loss
        grads = {"blocks": jax.tree.map(lambda a: a[None], g_blocks), "first": g_first, "last": g_last}
        return loss, grads, load

    def _reduce(self, part: str, grads, sharded_state: bool):
        """One part's ("blocks", "first", "last") gradients summed over the batch axes its
        stored pspecs do not split, the first and last stages' also over pp; over dp a
        reduce-scatter when the optimizer state is sharded (ZeRO-1, -2)."""
        pspecs, extra = self.stored_param_pspecs[part], () if part == "blocks" else self._pp_axes
        batch_axes = self.local.request.batch_axes
        if sharded_state:
            return zero.reduce_scatter_gradients(grads, pspecs, self.zero_dims[part], batch_axes=batch_axes,
                                                 extra=extra)
        return reduce_gradients(grads, pspecs, batch_axes=batch_axes, extra=extra)

    def _update(self, state: TrainState, grads: dict, load):
        """Data parallelism's one reduction, the global norm, clipping and AdamW: (the new
        weights, the new optimizer state, the norm). ZeRO-1 and -2 reduce-scatter over dp,
        update a dp-th and all-gather it; under ZeRO-3 the layers' backward already
        reduce-scattered (a weight's stored pspec names dp) and the dp-th stays as it is."""
        zero_dims = self.zero_dims
        sharded_state = bool(self.spec.zero) and self.spec.zero != 3     # ZeRO-1 and -2: the same program
        grads = {k: self._reduce(k, g, sharded_state) for k, g in grads.items()}
        norm = optim_lib.global_norm(grads)
        grads = optim_lib.clip(grads, norm, self.optim.clip)
        params = state.params
        own = zero.slice_params(params, zero_dims) if sharded_state else params       # ZeRO-1: a dp-th
        updates, opt = self.tx.update(grads, state.opt, own)
        new = optax.apply_updates(own, updates)
        new = zero.gather_params(new, zero_dims) if sharded_state else new
        if load is not None:
            new = balance.update_bias(new, params, load, self.cfg)
        # microbatches' gradients add up in float32: the state keeps its dtypes (bf16 stays bf16)
        same = lambda a, b: a.astype(b.dtype)
        return jax.tree.map(same, new, params), jax.tree.map(same, opt, state.opt), norm

    # ---- state ------------------------------------------------------------------------------

    def init(self, key=None) -> TrainState:
        """A fresh state from reference.init_params(key, cfg) (the same weights on every mesh)."""
        key = jax.random.key(0) if key is None else key
        return self.from_canonical(reference.init_params(key, self.cfg, self.dtype))

    def from_canonical(self, params: dict, opt=None, step=0) -> TrainState:
        """A state on this mesh from reference-structured params (and an optimizer state in
        the canonical layout, `canonical`'s second output; None: a fresh one)."""
        if "from_canonical" not in self._programs:      # one jit per Trainer: its compiled programs are kept
            self._programs["from_canonical"] = jax.jit(self._build_state, out_shardings=self.shardings)
        return self._programs["from_canonical"](params, opt, step)

    def _build_state(self, params, opt, step) -> TrainState:
        staged = self._staged(model_lib.split(params))
        opt = self.tx.init(staged) if opt is None else self._opt_map(opt, lambda a, k: to_stages(
            a, self.schedule, self.layers_per_stage) if k else a)
        return TrainState(step=jnp.asarray(step, jnp.int32), params=staged, opt=opt)

    def _unstage(self, state: TrainState):
        params = model_lib.join({**state.params, "blocks": from_stages(state.params["blocks"], self.schedule,
                                                                         self.layers_per_stage)})
        opt = self._opt_map(state.opt, lambda a, k: from_stages(a, self.schedule, self.layers_per_stage) if k else a)
        return params, opt, state.step

    def canonical(self, state: TrainState) -> tuple[dict, Any, jax.Array]:
        """(params as reference.init_params, optimizer state with mu/nu in that layout,
        step): the same numbers on any mesh, replicated."""
        if "canonical" not in self._programs:           # one jit per Trainer: its compiled programs are kept
            self._programs["canonical"] = jax.jit(self._unstage, out_shardings=NamedSharding(self.mesh, P()))
        return self._programs["canonical"](state)

    def canonical_abstract(self):
        """The shapes and dtypes `canonical` returns."""
        return jax.eval_shape(self._unstage, self.abstract_state())

    def _opt_map(self, opt, fn):
        kinds = {"blocks": jax.tree.map(lambda _: True, self.shapes["blocks"]),
                 "first": jax.tree.map(lambda _: False, self.shapes["first"]),
                 "last": jax.tree.map(lambda _: False, self.shapes["last"])}
        return optax.tree_map_params(self.tx, fn, opt, kinds, transform_non_params=lambda a: a)

    def put(self, tokens) -> jax.Array:
        """A host batch int[B, T+1] as the global array the step takes, split by rows
        (`token_sharding`): every process passes the same batch, each device gets only its
        rows (`loop.global_batch` builds it from each process's own rows instead)."""
        tokens = np.asarray(tokens)
        if tokens.shape != (self.batch_size, self.seq_len + 1) or tokens.dtype.kind not in "iu":
            raise ConfigError(f"tokens {tokens.shape} {tokens.dtype}: this trainer takes int[batch_size="
                              f"{self.batch_size}, seq_len+1={self.seq_len + 1}]")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab):
            raise ConfigError(f"token ids in [{tokens.min()}, {tokens.max()}]: they must lie in [0, vocab="
                              f"{self.cfg.vocab})")
        tokens = tokens.astype(np.int32)
        return jax.make_array_from_callback(tokens.shape, self.token_sharding, lambda i: tokens[i])

    @property
    def compiled(self):
        """The compiled step (compiled once per Trainer request; `step` runs it)."""
        if "compiled" not in self._programs:
            self._programs["compiled"] = self.lower().compile()
        return self._programs["compiled"]

    def step(self, state: TrainState, tokens) -> tuple[TrainState, dict]:
        """One step on tokens int[B, T+1] (host data, or an int32 array laid out as
        `token_sharding`: `put`'s, `loop.global_batch`'s). The state is donated: use the
        returned one."""
        if jax.tree.structure(state) != jax.tree.structure(self.shardings):
            raise ConfigError(f"state (a {type(state).__name__}) is not this trainer's TrainState: pass init()'s")
        if any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(state)):
            raise ConfigError("the state was donated to the previous step; pass the state that step returned")
        if not (isinstance(tokens, jax.Array) and tokens.sharding == self.token_sharding
                and tokens.dtype == jnp.int32):
            tokens = self.put(tokens)
        return self.compiled(state, tokens)

    def lower(self, state: TrainState | None = None):
        abstract_state, tokens = self.abstract_inputs()
        return self._step.lower(abstract_state if state is None else state, tokens)

    def abstract_inputs(self) -> tuple[TrainState, jax.ShapeDtypeStruct]:
        """(state, tokens) as the step takes them, shapes and shardings only: to lower or
        trace the step without data."""
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             self.abstract_state(), self.shardings)
        return state, jax.ShapeDtypeStruct((self.batch_size, self.seq_len + 1), jnp.int32, sharding=self.token_sharding)

    def abstract_state(self) -> TrainState:
        return jax.eval_shape(lambda: TrainState(step=jnp.zeros((), jnp.int32), params=self.shapes,
                                                 opt=self.tx.init(self.shapes)))
