"""What a training run ends with: the loss curve (PNG), tokens/s, memory per device from
the compiled step, and the collectives of one step.

    s = summarize(trainer, history, out="run/")     # dict; run/loss.png
    print(format_summary(s))

Memory is XLA's `memory_analysis()` of the compiled step (per device: arguments, i.e. the
weights and optimizer state it holds, outputs, temporaries). Collectives are read from the
compiled program (`comms`): the pipeline's sends exactly, from the plan's counts of each
guarded send (`plan.runs()`), against `pipeline.formulas.pipeline_collectives`; the
gradients' reduction, the global norm and the loss, once per step outside the pipeline
loop, in bytes (XLA may fuse them), each weight's local bytes per group it is summed over;
the collectives inside the stages (TP, SP, CP, EP), run in the schedule's branches under
named scopes whose runs per pp rank the plan knows (`Plan.lane_runs`), counted exactly
per rank against the techniques' formulas at one device's sizes
(`train.formulas.stage_collectives`). With one stage (pp = 1, `pipeline.direct`) those
under its scope, as often as each runs, every combined all-reduce split back into its
psums: the formulas' count of the one-stage program, in count and bytes as well.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxpar import comms
from jaxpar.data import formulas as data_formulas
from jaxpar.data import zero as data_zero
from jaxpar.data.reduce import weights
from jaxpar.expert import formulas as ep_formulas
from jaxpar.mesh import CP, DP, EP, PP, TP
from jaxpar.pipeline import direct
from jaxpar.pipeline import formulas as pipe_formulas
from jaxpar.pipeline.plan import LANE_SCOPES, LAYER_SCOPE
from jaxpar.train import formulas as train_formulas


def _weights(trainer, *, leave_out: tuple[str, ...] = ()) -> list:
    """Every weight as data parallelism's formulas see it (`data.reduce.weights`): the
    embedding's and the head's gradients also summed over pp; under ZeRO-3 each as its
    stored dp-th, split over dp (the layers' backward reduce-scattered it there). Without
    the blocks' leaves named in `leave_out`."""
    pp = (PP,) if trainer.spec.pp > 1 else ()
    kept = lambda kind, tree: {k: v for k, v in tree.items() if kind != "blocks" or k not in leave_out}
    if trainer.spec.zero == 3:    # the weights as stored, their dp-th: what the reduction sums
        return [w for kind in ("blocks", "first", "last")
                for w in weights(kept(kind, trainer.shapes[kind]), kept(kind, trainer.stored_param_pspecs[kind]),
                                 sizes=trainer.mesh.shape, extra=() if kind == "blocks" else pp)]
    return [w for kind in ("blocks", "first", "last")
            for w in weights(kept(kind, trainer.shapes[kind]), kept(kind, trainer.param_pspecs[kind]),
                             sizes=trainer.mesh.shape, extra=() if kind == "blocks" else pp,
                             zero_dims=kept(kind, trainer.zero_dims[kind]))]


def _constant_gradients(trainer, *, zero_sharded: bool = False) -> tuple[str, ...]:
    """The blocks' weights whose zero gradient's all-reduce (of one ZeRO splits over dp, zero_sharded: reduce-scatter)
    XLA folds: the router bias (it only chooses; the step zeroes its gradient) and, at pp = 1, a router that does not
    learn (`expert.formulas.router_learns`; in a pipeline its zero passes the loop's buffers, reduced as any)."""
    spec = trainer.spec
    zero = {"router_bias": True, "router": spec.pp == 1 and not ep_formulas.router_learns(trainer.cfg)}
    names = [n for n in zero if zero[n] and n in trainer.shapes["blocks"]]
    split = lambda n: spec.zero > 0 and spec.dp > 1 and trainer.zero_dims["blocks"][n] >= 0
    return tuple(n for n in names if split(n) == zero_sharded)


def expected_reductions(trainer) -> dict[int, float]:
    """{group size: bytes} of the step's all-reduces outside the pipeline loop: the
    gradients' (`data.formulas.reduction_bytes`: each over the batch axes its pspec does
    not split, the embedding's and the head's also over pp; under ZeRO-1 the dp part is
    `expected_zero`'s; none of a gradient XLA folds, `_constant_gradients`), the norm's one
    scalar per weight (over the axes it is split over, and dp under ZeRO-1), the loss, and
    load balancing's statistics."""
    spec, sizes = trainer.spec, trainer.mesh.shape
    batch_axes, pp = trainer.local.request.batch_axes, ((PP,) if spec.pp > 1 else ())
    constant = _constant_gradients(trainer)
    out = data_formulas.reduction_bytes(_weights(trainer, leave_out=constant), sizes=sizes, batch_axes=batch_axes)

    def add(axes, nbytes):
        n = data_formulas.group_size(axes, sizes)
        if n > 1:
            out[n] = out.get(n, 0.0) + nbytes

    # the norm: one scalar per weight (the router bias' too: its zero square still sums over pp)
    for w in _weights(trainer, leave_out=tuple(n for n in constant if n != "router_bias")):
        add(w.split + ((DP,) if w.zero else ()), w.itemsize)
    add(batch_axes + pp, jnp.dtype(trainer.dtype).itemsize)       # the loss
    cfg = trainer.cfg
    if cfg.n_experts:   # load balancing's statistics of this device's layers, once a step: every
        # chunk's stack, padded to the deepest with uneven stages (a padding layer's are zeros)
        layers = spec.resolved_chunks * trainer.local.request.depth if spec.pp > 1 else cfg.n_layers
        balance = ep_formulas.balance_reduction(cfg=cfg, layers=layers, dtype=trainer.dtype,
                                                **{a: sizes[a] for a in (DP, EP, CP, TP)})
        for n, nbytes in balance.items():
            out[n] = out.get(n, 0.0) + nbytes
    return out


def expected_zero(trainer) -> dict[str, float]:
    """Bytes of ZeRO's reduce-scatters and all-gathers over dp in one step. ZeRO-1 and -2:
    `data.formulas.zero_bytes` (each a weight's local bytes, as the HLO counts an output
    or input of the whole shard). ZeRO-3: `expected_zero3_by_rank` summed over the pp
    ranks (one device each)."""
    if trainer.spec.zero == 3:
        return _sum_ranks(expected_zero3_by_rank(trainer))
    scattered = _weights(trainer, leave_out=_constant_gradients(trainer, zero_sharded=True))
    return {"reduce-scatter": data_formulas.zero_bytes(scattered, dp=trainer.spec.dp)["reduce-scatter"],
            "all-gather": data_formulas.zero_bytes(_weights(trainer), dp=trainer.spec.dp)["all-gather"]}


def _sum_ranks(by_rank: dict) -> dict[str, float]:
    return {k: float(sum(r[k] for r in by_rank.values())) for k in ("reduce-scatter", "all-gather")}


def _zero3_weights(trainer, kind: str) -> list:
    """`kind`'s weights as ZeRO-3's formula reads them: `regather` for the ones the
    backward of their function (the layer, the embedding, the head) gathers again, those
    its pullback reads itself, as the step's trace recorded (`data.zero.regathered`)."""
    req = trainer.local.request
    fn = {"blocks": req.stage_fn.layer_fn, "first": req.first_fn, "last": req.loss_fn}[kind]
    again = data_zero.regathered(fn)
    names = sorted(trainer.shapes[kind])        # a dict of leaves, in jax.tree order
    found = weights(trainer.shapes[kind], trainer.param_pspecs[kind], sizes=trainer.mesh.shape,
                    zero_dims=trainer.zero_dims[kind])
    return [dataclasses.replace(w, regather=name in again) for name, w in zip(names, found, strict=True)]


def expected_zero3_by_rank(trainer) -> dict[int, dict[str, float]]:
    """{pp rank: {"all-gather": bytes, "reduce-scatter": bytes}} of ZeRO-3 in one step on
    one device of that rank (`data.formulas.zero3_bytes`; call it after the step is
    traced: which weights are gathered again is the trace's, `_zero3_weights`), counted
    as the compiled program runs the uses:
      pp = 1   each weight gathered once forward (XLA hoists the gather out of the
               microbatch loop: the weights are invariant in it), gathered again in the
               backward and reduce-scattered once per microbatch;
      pp > 1   per run of a branch on that rank (`Plan.lane_runs`), a chunk's layers
               (1/chunks of the rank's blocks): gathered in each F, again in each B (which
               reads the weights for dL/dx), reduce-scattered in each B, or in each W where
               the schedule splits the backward (W runs the layer's pullback as well, which
               gathers again the weights it reads: the count includes it, though dL/dW
               needs none);
               the embedding gathered in each first-stage F, reduce-scattered in each
               first-stage backward; the head gathered, gathered again and
               reduce-scattered in each F with the loss.
    recompute="full" adds one gather of every layer per B and per W (per microbatch at pp =
    1): each runs the stage's forward again before its pullback."""
    spec, plan = trainer.spec, trainer.local.plan
    kinds = {k: _zero3_weights(trainer, k) for k in ("blocks", "first", "last")}

    def bytes_of(kind, forward, backward, scatters, share=1.0):
        got = data_formulas.zero3_bytes(kinds[kind], dp=spec.dp, forward=forward, backward=backward,
                                        scatters=scatters)
        return {k: v * share for k, v in got.items()}

    def total(*parts):
        return {k: float(sum(p[k] for p in parts)) for k in ("reduce-scatter", "all-gather")}

    # recompute="full": B runs the stage's forward again first, gathering every layer's
    # weights once more (its pullback then gathers again those it reads itself)
    rerun = 1 if spec.recompute == "full" else 0
    if spec.pp == 1:
        m, folded = plan.schedule.microbatches, _constant_gradients(trainer, zero_sharded=True)
        kinds["folded"] = [w for n, w in zip(sorted(trainer.shapes["blocks"]), kinds["blocks"]) if n in folded]
        return {0: total(*(bytes_of(k, 1, m, m) for k in ("blocks", "first", "last")),
                         bytes_of("blocks", rerun * m, 0, 0), bytes_of("folded", 0, 0, -m))}
    out = {}
    v = spec.resolved_chunks
    split = any(plan.lane_runs(d)["pipeline_W"] for d in range(spec.pp))
    for d in range(spec.pp):
        runs = plan.lane_runs(d)
        scatters = runs["pipeline_W"] if split else runs["pipeline_B"]
        # a split backward's W runs the layer's pullback too, which gathers again what it reads
        again = runs["pipeline_B"] + (runs["pipeline_W"] if split else 0)
        # recompute: B reruns the forward, and so does W (from the stage's input it keeps)
        out[d] = total(bytes_of("blocks", runs["pipeline_F"] + rerun * again, again, scatters, share=1 / v),
                       bytes_of("first", runs["pipeline_first"], 0, runs["pipeline_first_backward"]),
                       bytes_of("last", runs["pipeline_loss"], runs["pipeline_loss"], runs["pipeline_loss"]))
    return out


def zero3_by_rank(trainer, ops) -> dict[int, dict[str, float]]:
    """The ZeRO-3 gathers and reduce-scatters (the ops under `data.zero.SCOPE`) one device
    of each pp rank runs in one step, exactly: at pp = 1 each as often as it runs; in the
    pipeline each in its innermost branch scope as often as the plan runs that branch
    there (`_branch_runs`)."""
    plan = trainer.local.plan
    out = {}
    for d in range(trainer.spec.pp):
        runs = plan.lane_runs(d)
        got = {"reduce-scatter": 0.0, "all-gather": 0.0}
        for op in ops:
            if data_zero.SCOPE in op.scope and op.kind in got:
                n = op.executions if trainer.spec.pp == 1 else _branch_runs(op, plan, runs)
                got[op.kind] += n * op.bytes
        out[d] = got
    return out


def _branch_runs(op, plan, runs: dict[str, int]) -> int:
    """How often a conditional op of the pipeline's loop runs on the rank of `runs`
    (`Plan.lane_runs`): its executions per step of the loop times the runs of its
    innermost branch scope (plan.LANE_SCOPES)."""
    scope = next((s for s in LANE_SCOPES if f"/{s}/" in f"/{op.scope}/"), None)
    if not op.conditional or scope is None or op.executions % max(plan.steps, 1):
        raise ValueError(f"collective {op.name} ({op.scope}) is in no branch scope of the pipeline")
    return op.executions // plan.steps * runs[scope]


def stage_collectives(trainer, ops, device: int) -> comms.Collectives:
    """The collectives inside the pipeline's branches that pp rank `device` runs in one
    step, exactly: each op in its innermost branch scope (plan.LANE_SCOPES) runs as often
    as the plan runs that branch there, times its loops inside the branch."""
    plan = trainer.local.plan
    runs = plan.lane_runs(device)
    out = comms.Collectives({})
    if trainer.spec.pp == 1:      # the one-stage program (pipeline.direct): no branches, each op as it runs
        for op in ops:
            if direct.SCOPE in op.scope and data_zero.SCOPE not in op.scope:     # ZeRO-3's: `zero3_by_rank`
                out = out + comms.Collectives({op.kind: (op.executions, op.executions * op.bytes)})
        return out
    for op in ops:
        if not op.conditional or data_zero.SCOPE in op.scope:      # ZeRO-3's: `zero3_by_rank`
            continue
        scope = next((s for s in LANE_SCOPES if f"/{s}/" in f"/{op.scope}/"), None)
        if scope is None or op.executions % max(plan.steps, 1):
            raise ValueError(f"collective {op.name} ({op.scope}) is in no branch scope of the pipeline")
        n = op.executions // plan.steps * runs[scope]
        if trainer.layers_per_stage is not None and f"/{LAYER_SCOPE}/" in f"/{op.scope}/":
            n = _layer_op_runs(trainer, op, scope, device)
        out = out + comms.Collectives({op.kind: (n, n * op.bytes)})
    return out


def _layer_op_runs(trainer, op, scope: str, device: int) -> int:
    """How often a collective inside one layer of an uneven stage runs on pp rank
    `device` in one step: its executions per layer (its loops inside the layer) times the
    real layers that rank runs in the branch `scope` (`Plan.layer_runs`); the scan over a
    chunk's layers runs the largest count, the padding's branch holds no collective."""
    plan, depth = trainer.local.plan, trainer.local.request.depth
    per_layer, rest = divmod(op.executions, max(plan.steps, 1) * depth)
    if rest:
        raise ValueError(f"collective {op.name} ({op.scope}) runs {op.executions} times, not a multiple of "
                         f"{plan.steps} steps x {depth} layers")
    return per_layer * plan.layer_runs(device, trainer.layers_per_stage)[scope]


def expected_stage_collectives(trainer, device: int) -> comms.Collectives:
    """The formulas' sum for what `stage_collectives` measures on pp rank `device`
    (`train.formulas.stage_collectives`: every technique's collectives at the sizes one
    device sees, times the runs of each branch there)."""
    plan, spec = trainer.local.plan, trainer.spec
    kw = dict(spec=spec, batch_size=trainer.batch_size, seq_len=trainer.seq_len, dtype=trainer.dtype)
    if trainer.layers_per_stage is None:
        return train_formulas.stage_collectives(cfg=trainer.cfg, runs=plan.lane_runs(device), **kw)
    # uneven stages: the formula chunk by chunk, each at its own layer count and with the
    # runs of that chunk's branches
    out = comms.Collectives({})
    for c in range(spec.resolved_chunks):
        held = trainer.layers_per_stage[trainer.schedule.stage_of(device, c)]
        out = out + train_formulas.stage_collectives(cfg=trainer.cfg, runs=plan.lane_runs(device, c), depth=held, **kw)
    return out


def collectives(trainer, compiled) -> dict:
    """Measured and expected collectives of one step (see the module docstring)."""
    plan = trainer.local.plan
    # at pp = 1 (pipeline.direct) XLA merges a stage's all-reduces across layers and with
    # the step's own: split back into the psums they were, each counted where it was
    # written (train.formulas counts them so)
    hlo = compiled.as_text()
    # every branch of the lane switch, each op counted by its own lane's runs (the heaviest
    # branch alone would hide W's behind B's; ZeRO-3 scatters in B and in W)
    ops = comms.resolve(comms.collective_ops_from_hlo(hlo, split_combined=trainer.spec.pp == 1, every_branch=True),
                        plan.runs())
    # a collective over a group of one device (XLA keeps some) moves nothing: not counted
    ops = [o for o in ops if o.group_size > 1]
    once = [o for o in ops if not o.conditional and o.executions == 1 and direct.SCOPE not in o.scope]
    sends = comms.nonzero(comms.summarize([o for o in ops if "pipeline_send" in o.scope]))
    spec = trainer.spec
    act = (trainer.seq_len // spec.cp // (spec.tp if spec.sequence_parallel else 1)) * trainer.cfg.d_model
    expected_sends = pipe_formulas.pipeline_collectives(schedule=trainer.schedule, batch_size=trainer.batch_size,
        features=act, dtype=trainer.dtype, dp=spec.dp * spec.ep) if spec.pp > 1 else comms.Collectives({})
    expected_sends = comms.Collectives({k: v for k, v in expected_sends.items() if k == "collective-permute"})
    reductions: dict[int, float] = {}
    for o in once:
        if o.kind == "all-reduce":
            reductions[o.group_size] = reductions.get(o.group_size, 0.0) + o.bytes
    zero = {k: sum(o.bytes for o in once if o.kind == k) for k in ("reduce-scatter", "all-gather")}
    zero_ranks = expected_ranks = None
    if spec.zero == 3:            # inside the layers, per pp rank (and summed: `zero`)
        zero_ranks, expected_ranks = zero3_by_rank(trainer, ops), expected_zero3_by_rank(trainer)
        zero = _sum_ranks(zero_ranks)
    stages = {d: stage_collectives(trainer, ops, d) for d in range(spec.pp)}
    return {"sends": sends, "expected_sends": expected_sends, "reductions": reductions,
            "expected_reductions": expected_reductions(trainer), "zero": zero, "expected_zero": expected_zero(trainer),
            "zero_by_rank": zero_ranks, "expected_zero_by_rank": expected_ranks,
            "stages": stages, "expected_stages": {d: expected_stage_collectives(trainer, d) for d in range(spec.pp)}}


def matches(c: dict) -> bool:
    close = lambda a, b: set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-9 * max(1.0, b[k]) for k in b)
    stages = all(c["stages"][d] == e for d, e in c["expected_stages"].items())
    ranks = c.get("zero_by_rank") is None or all(close(c["zero_by_rank"][d], e)
                                                  for d, e in c["expected_zero_by_rank"].items())
    return c["sends"] == c["expected_sends"] and close(c["reductions"], c["expected_reductions"]) and close(
        c["zero"], c["expected_zero"]) and stages and ranks


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "generated_code")}


def plot(history, path: str) -> str:
    """The loss curve (and the validation losses, where measured) as a PNG at `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(history.steps, history.losses, lw=1.5, label="train")
    validation = history.validation()
    if validation:      # the validation loss where measured: after that step's update
        ax.plot([s for s, _ in validation], [v for _, v in validation], "o-", ms=4, lw=1, label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize(trainer, history, *, out: str | None = None) -> dict:
    """The run's summary (the module docstring); with no step trained (a resumed run with
    nothing left to train) the same keys, None where nothing was measured: the step is
    not compiled for it."""
    trained = bool(history.steps)
    compiled = trainer.compiled if trained else None
    c = collectives(trainer, compiled) if trained else None
    tokens = trainer.batch_size * trainer.seq_len
    compute = "" if trainer.compute_dtype is None else f" ({jnp.dtype(trainer.compute_dtype).name} compute)"
    s = {"spec": trainer.spec.describe() + compute, "mesh": dict(trainer.mesh.shape), "steps": len(history.steps),
         "first_loss": history.losses[0] if trained else None, "last_loss": history.losses[-1] if trained else None,
         "tokens_per_second": history.tokens_per_second(tokens) if trained else None,
         "step_seconds": history.step_seconds() if trained else None,
         "compile_seconds": history.seconds[0] if trained else None,
         "memory_per_device": memory(compiled) if trained else None, "collectives": c,
         "collectives_match": matches(c) if trained else None,
         "layers_per_stage": list(trainer.local.request.layers_per_stage) if trainer.spec.pp > 1 else None,
         "loss_png": None}
    if out is not None and trained:
        os.makedirs(out, exist_ok=True)
        s["loss_png"] = plot(history, os.path.join(out, "loss.png"))
    return s


def _kib(b: float) -> str:
    return f"{b / 1024:.1f} KiB" if b < 1 << 20 else f"{b / (1 << 20):.2f} MiB"


def _layer_lines(s: dict) -> list[str]:
    """The layers of each model stage (pipelines only); uneven: the padding each device holds."""
    counts = s.get("layers_per_stage")
    if not counts:
        return []
    line = f"  layers per stage: {'/'.join(map(str, counts))}"
    if len(set(counts)) > 1:
        line += (f" (uneven: every stage laid out as {max(counts)} layers, the {len(counts) * max(counts) - sum(counts)}"
                 " padding layers skipped)")
    return [line]


def format_summary(s: dict) -> str:
    c, mem = s["collectives"], s["memory_per_device"]
    red = lambda d: ", ".join(f"{_kib(b)} over {n}" for n, b in sorted(d.items())) or "none"
    lines = [
        f"trained {s['spec']} for {s['steps']} steps: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}",
        f"  {s['tokens_per_second']:,.0f} tokens/s, {1e3 * s['step_seconds']:.1f} ms/step "
        f"(first step, compile included: {s['compile_seconds']:.1f} s)",
        *_layer_lines(s),
        f"  memory per device (compiled): weights+state {_kib(mem['argument'])}, temporaries {_kib(mem['temp'])}",
        f"  pipeline sends per step: {c['sends'].format() if c['sends'] else 'none'}"
        f" (formula: {c['expected_sends'].format() if c['expected_sends'] else 'none'})",
        f"  gradient/norm/loss all-reduces: {red(c['reductions'])} (formula: {red(c['expected_reductions'])})",
    ]
    if c["expected_zero"]["all-gather"]:
        stage = next((word.removeprefix("zero") for word in s["spec"].split() if word.startswith("zero")), "1")
        lines.append(f"  ZeRO-{stage} over dp: reduce-scatter {_kib(c['zero']['reduce-scatter'])}, all-gather "
                     f"{_kib(c['zero']['all-gather'])} (formula: {_kib(c['expected_zero']['reduce-scatter'])}, "
                     f"{_kib(c['expected_zero']['all-gather'])})")
    for d, got in c["stages"].items():
        lines.append(f"  inside the stages, pp rank {d}: {got.format()} (formula: {c['expected_stages'][d].format()})")
    lines.append(f"  collectives {'=' if s['collectives_match'] else '!='} the formulas")
    if s.get("loss_png"):
        lines.append(f"  loss curve: {s['loss_png']}")
    return "\n".join(lines)

