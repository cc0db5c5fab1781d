"""`jaxpar train`: the composed model trained on a dp x pp x tp x cp x ep mesh.

    jaxpar train --mesh dp=2,pp=2,tp=2 --schedule 1f1b --steps 200
    jaxpar train --mesh pp=2,cp=2,ep=2 --experts 4 --microbatches 2 --steps 50
    jaxpar train --mesh dp=4,tp=2 --sp --zero 1 --checkpoint run/ckpt --every 20   (resumes if killed)
    jaxpar train --mesh dp=2 --steps 50 --log run/steps.jsonl --json
    jaxpar train --mesh dp=2,tp=2 --data data/ --seq 64 --eval-every 20     (tokenized text: `jaxpar data prepare`)
    jaxpar train --mesh dp=2,tp=2 --steps 20 --profile run/trace            (the share of op time in collectives)
    jaxpar train --mesh dp=2,tp=4 --coordinator 10.0.0.1:12355 --processes 2 --process-id 0    (on each host)

Ends with a summary: loss curve PNG (validation points on it), tokens/s, MFU, memory per
device (compiled), communication, and the collectives of one step against the
techniques' formulas (`jaxpar.train.summary`); `--json` adds the history, one row per
step (step, loss, grad_norm, lr, seconds, and val_loss where measured), the rows `--log`
writes as JSON lines while training. The data directory, the checkpoint directory, the
log and the multi-process flags are checked before JAX starts; the checkpoints' threads
are closed on every way out.

Several processes (one per host, or several on one machine with fake CPU devices) form
one job with `--coordinator HOST:PORT --processes N --process-id I` (jax.distributed; on
CPU, gloo collectives), or, inside a cluster job that jax.distributed detects (SLURM,
Open MPI, Kubernetes), with `--distributed auto`. `--devices` is then each process's
fake CPU devices. Each process reads only the rows of each batch its own devices hold;
process 0 alone prints, plots and writes the log; all of them write the checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys

from jaxpar.cli.train_args import FLAGS, HELP, add_arguments  # noqa: F401 - the subcommand interface (cli.main)
from jaxpar.errors import ConfigError
from jaxpar.pipeline import stage_layers


_HOST_PORT = re.compile(r"[\w.\-]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}")


def check_distributed(args) -> int:
    """The multi-process flags, checked before JAX starts: the number of processes (1
    without any)."""
    joined = [flag for flag, value in (("--processes", args.processes), ("--process-id", args.process_id))
              if value is not None]
    if args.distributed is not None:
        if args.coordinator is not None or joined:
            raise ConfigError("--distributed auto takes the job's layout from the cluster: give it without "
                              "--coordinator, --processes and --process-id")
        return 1        # known once jax.distributed has joined
    if args.coordinator is None:
        if joined:
            raise ConfigError(f"{' and '.join(joined)} without --coordinator: give --coordinator HOST:PORT of "
                              "process 0 too (or --distributed auto inside a cluster job)")
        return 1
    if not _HOST_PORT.fullmatch(args.coordinator) or not 0 < int(args.coordinator.rsplit(":", 1)[1]) < 65536:
        raise ConfigError(f"--coordinator {args.coordinator!r} is not HOST:PORT: give process 0's address and a "
                          "free port, e.g. --coordinator 10.0.0.1:12355")
    if args.processes is None or args.process_id is None:
        raise ConfigError("--coordinator needs --processes N and --process-id I (0 .. N-1) too")
    if args.processes < 1:
        raise ConfigError(f"--processes {args.processes}: give 1 or more processes")
    if not 0 <= args.process_id < args.processes:
        raise ConfigError(f"--process-id {args.process_id} with --processes {args.processes}: ids run from 0 to "
                          f"{args.processes - 1}")
    return args.processes


def open_data(args, tp: int):
    """(the data, or None for the generated corpus; the model's vocab): --data opened and
    its vocabulary checked against --vocab (default: the data's, rounded up to a multiple
    of tp for the vocab-parallel embedding) before JAX starts."""
    if args.data is None:
        return None, 64 if args.vocab is None else args.vocab
    from jaxpar.train import text

    data = text.TokenData(args.data)
    vocab = -(-data.vocab // tp) * tp if args.vocab is None else args.vocab
    text.check_vocab(data, vocab)
    return data, vocab


def eval_every(args) -> int | None:
    """--eval-every, or its default: steps / 10 with --data, else off; 0: off."""
    if args.eval_batches < 1:
        raise ConfigError(f"--eval-batches {args.eval_batches}: give 1 or more validation batches")
    if args.eval_every is None:
        return max(1, args.steps // 10) if args.data is not None else None
    if args.eval_every < 0:
        raise ConfigError(f"--eval-every {args.eval_every}: give the steps between validations, or 0 for none")
    return args.eval_every or None


def local_devices(args, spec, processes: int) -> int | None:
    """The fake CPU devices this process starts: --devices, else the mesh's share of
    each process (None under --distributed auto without --devices: the cluster's)."""
    if args.devices is not None or args.distributed is not None:
        return args.devices
    if spec.devices % processes:
        raise ConfigError(f"--mesh {args.mesh} has {spec.devices} devices, not a multiple of --processes "
                          f"{processes}: give --devices (each process's) or a mesh that divides evenly")
    return spec.devices // processes


DTYPES = ("float32", "bfloat16")


def compute_dtype(name: str):
    """--dtype's compute dtype for Trainer (None: float32, no cast); a ConfigError names a bad one."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}: float32 trains in float32, "
                          "bfloat16 computes in bf16 with float32 master weights")
    import jax.numpy as jnp

    return jnp.bfloat16 if name == "bfloat16" else None


def start_jax(args, processes: int, devices: int | None, threads_per_device: int = 8):
    """Start JAX for this process with `devices` fake CPU devices (joining the job
    first, if any; `mesh.use_cpu_devices` sizes their thread pool); return the job's devices."""
    import jax

    from jaxpar import mesh

    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
    if args.distributed == "auto":        # the cluster's environment names the coordinator and the ranks
        if devices is not None:
            mesh.use_cpu_devices(devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
    elif args.coordinator is not None:
        mesh.init_distributed(args.coordinator, num_processes=processes, process_id=args.process_id,
                              local_device_count=devices)
    else:
        mesh.use_cpu_devices(devices, threads_per_device=threads_per_device)
    return jax.devices()


def _spec(args):
    """--mesh and the technique flags as a ParallelSpec (microbatches: --microbatches, default 2 x pp)."""
    from jaxpar.train import spec as spec_lib

    counts = None if args.layers_per_stage is None else stage_layers.parse_layer_split(args.layers_per_stage)
    spec = spec_lib.parse(args.mesh, schedule=args.schedule, chunks=args.chunks, sequence_parallel=args.sp,
                          recompute=args.recompute, zero=args.zero, attention=args.attention,
                          layout=args.layout, microbatches=1, layers_per_stage=counts)
    m = 2 * spec.pp if args.microbatches is None else args.microbatches
    return spec_lib.ParallelSpec(**{**spec.__dict__, "microbatches": m})


def model_config(args, spec, vocab: int):
    """The model the flags ask for, as given: each head d_model / n_heads wide (refused unless
    whole, and even for the rotary embedding), top_k as given (refused past the experts)."""
    from jaxpar import errors, reference

    heads = errors.whole("n_heads", args.heads, maximum=1 << 20)
    d_model = errors.whole("d_model", args.d_model, maximum=1 << 24)
    if d_model % heads or (d_model // heads) % 2:
        raise ConfigError(f"d_model={d_model} over n_heads={heads}: each head takes an equal share of the width, "
                          f"a whole and even number of features (the rotary embedding turns pairs). Fix: a multiple "
                          f"of 2 x {heads}, e.g. d_model={2 * heads * max(1, round(d_model / (2 * heads)))}")
    if args.experts and not 1 <= args.top_k <= args.experts:
        raise ConfigError(f"top_k={args.top_k} with n_experts={args.experts}: each token picks top_k distinct "
                          f"experts. Fix: top_k={min(2, args.experts)}"
                          + (f", or n_experts={args.top_k} or more" if args.top_k > args.experts else ""))
    counts = spec.layers_per_stage
    layers = args.layers if args.layers is not None else sum(counts) if counts else 2 * spec.pp * spec.resolved_chunks
    return reference.ModelConfig(n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=args.kv_heads,
                                 head_dim=d_model // heads, d_ff=args.ffn, vocab=vocab, mlp="swiglu",
                                 n_experts=args.experts, top_k=args.top_k, rope_theta=10000.0, router=args.router,
                                 aux_loss=args.aux_loss, bias_rate=args.bias_rate)


_TUPLE = re.compile(r"(layers_per_stage=)\((\d+(?:, \d+)*),?\)")


def check_fit(spec, cfg, *, batch_size: int, seq_len: int) -> None:
    """spec.check, with a stage split written as --layers-per-stage takes it (3,3, not (3, 3))."""
    try:
        spec.check(cfg, batch_size=batch_size, seq_len=seq_len)
    except ConfigError as e:
        raise ConfigError(_TUPLE.sub(lambda m: m.group(1) + m.group(2).replace(", ", ","), str(e))) from None


def check_paths(args) -> None:
    """The kernels' names and every path the run writes, before JAX starts."""
    from jaxpar import errors
    from jaxpar.kernels import grouped
    from jaxpar.kernels.attention import IMPLEMENTATIONS

    errors.one_of("attention_kernel", args.attention_kernel, IMPLEMENTATIONS)
    errors.one_of("expert_kernel", args.expert_kernel, grouped.IMPLEMENTATIONS)
    if args.checkpoint is not None:
        errors.writable_path("directory", args.checkpoint, directory=True)
    if args.resume is not None:
        errors.whole("resume", args.resume, minimum=0, maximum=1 << 62)
        if args.checkpoint is None:
            raise errors.ConfigError(f"resume={args.resume}: a step of which checkpoints? give directory= too")
    if args.log is not None:
        errors.writable_path("log", args.log)
    if args.profile is not None:
        errors.writable_path("profile", args.profile, directory=True)
    errors.writable_path("out", args.out, directory=True)


def main(args) -> int:
    processes = check_distributed(args)
    spec = _spec(args)
    data, vocab = open_data(args, spec.tp)
    every_eval = eval_every(args)
    devices = local_devices(args, spec, processes)
    cfg = model_config(args, spec, vocab)
    batch = spec.dp * spec.ep * spec.microbatches if args.batch is None else args.batch
    check_fit(spec, cfg, batch_size=batch, seq_len=args.seq)        # every problem, before JAX starts
    compute = compute_dtype(args.dtype)
    check_paths(args)

    from jaxpar.train.checkpoint import Checkpoints
    from jaxpar.train.loop import NonFiniteLoss, Profiling, Validation, fit
    from jaxpar.train.optim import OptimConfig
    from jaxpar.train.step import Trainer

    # --warmup as given: OptimConfig refuses one longer than --steps
    optim = OptimConfig(lr=args.lr, warmup=max(1, args.steps // 10) if args.warmup is None else args.warmup,
                        steps=args.steps, clip=args.clip)
    # a pipeline's concurrent collectives need a larger XLA:CPU thread pool (mesh.use_cpu_devices)
    devices = start_jax(args, processes, devices, threads_per_device=8 if spec.pp > 1 else 2)
    with contextlib.ExitStack() as stack:    # the checkpoints' threads end here, whatever is raised
        ckpt = stack.enter_context(Checkpoints(args.checkpoint, every=args.every)) if args.checkpoint else None
        trainer = Trainer(cfg, spec, optim, batch_size=batch, seq_len=args.seq, devices=devices[:spec.devices],
                          compute_dtype=compute, attention_kernel=args.attention_kernel,
                          expert_kernel=args.expert_kernel)
        validation = Validation(every_eval, args.eval_batches) if every_eval is not None else None
        try:
            _, history = fit(trainer, steps=args.steps, corpus=data, checkpoints=ckpt, resume=args.resume,
                             log=args.log, progress=not (args.quiet or args.json), validation=validation,
                             profiling=Profiling(args.profile) if args.profile is not None else None)
        except NonFiniteLoss as e:     # a run gone to NaN: one line, exit 1 (input refused up front is 2)
            from jaxpar.cli.flags import translate

            print(f"jaxpar train: error: {translate(str(e), FLAGS)}", file=sys.stderr)
            return 1
    return _report(args, trainer, history)


def _communication(trainer, history, collectives) -> dict:
    """What is known of the step's communication: measured from the profile when one was
    taken and could be read back, else the bytes counted in the compiled program."""
    from jaxpar.train import throughput

    counted = throughput.collective_bytes(collectives)
    record = history.profile
    measured = None
    if record and record.get("file"):
        measured = throughput.collective_time(record["file"], trainer.compiled.as_text())
    if measured is None:
        return {"source": "compiled program (counted, not timed)", "bytes_per_step": counted}
    return {"source": f"jax.profiler trace of steps {record['steps'][0]}-{record['steps'][-1]} ({record['file']})",
            "bytes_per_step": counted, **measured}


def _format_communication(c: dict) -> str:
    from jaxpar.comms import human_bytes

    counted = f"{human_bytes(c['bytes_per_step'])} of collectives per step per device (counted in the compiled step)"
    if "fraction" in c:
        return (f"  communication (measured): {100 * c['fraction']:.1f}% of the op time in collectives "
                f"({c['collective_s'] * 1e3:.1f} of {c['op_s'] * 1e3:.1f} ms summed over devices, waiting included; "
                f"{c['source']}); {counted}")
    return f"  communication: {counted}; not timed (--profile DIR measures its share of the time)"


def _report(args, trainer, history) -> int:
    import jax

    from jaxpar.train.summary import format_summary

    lead = jax.process_index() == 0
    summary = _summary(args, trainer, history, lead)
    if not lead:
        return 0 if summary["collectives_match"] is not False else 1
    if args.json:
        c = summary["collectives"] or {}
        summary["collectives"] = {k: (v.to_json() if hasattr(v, "to_json") else {str(n): b for n, b in v.items()}
                                      if isinstance(v, dict) else v) for k, v in c.items()} if c else None
        print(json.dumps(summary, indent=1, default=str))
    elif not history.steps:     # resumed from a checkpoint of the last step: nothing to train, nothing to measure
        print(f"nothing to train: the checkpoint is at step {history.resumed_from or 0} of --steps {args.steps}")
    else:
        if history.resumed_from is not None:
            change = history.schedule_change
            print(f"resumed from the checkpoint of step {history.resumed_from}" + (
                f" (written by a {change['from']['steps']}-step run; the learning rate followed this run's "
                f"{change['to']['steps']} steps, warm-up {change['to']['warmup']})" if change else ""))
        print(format_summary(summary))
        print(_format_extra(summary, trainer, args))
    return 0 if summary["collectives_match"] is not False else 1


def _summary(args, trainer, history, lead: bool) -> dict:
    """`summary.summarize` and what the command line adds (MFU, the device, the rows this
    process reads, the validation loss, the communication, the run's history and where it
    resumed): the same keys on every run, None where nothing was measured."""
    import jax

    from jaxpar.train import loop, throughput
    from jaxpar.train.summary import summarize

    summary = summarize(trainer, history, out=args.out if lead else None)
    device_kind = trainer.mesh.devices.flat[0].device_kind
    summary["mfu"] = None if not history.steps else throughput.mfu(
        summary["tokens_per_second"], trainer.cfg, trainer.seq_len, trainer.mesh.size, device_kind,
        trainer.compute_dtype or trainer.dtype)
    summary["flops_per_token"] = throughput.flops_per_token(trainer.cfg, trainer.seq_len)
    summary["device_kind"] = device_kind
    summary["attention_kernel"] = trainer.kernel
    summary["expert_kernel"] = trainer.expert_matmuls if trainer.cfg.n_experts else None
    summary["vocab"] = trainer.cfg.vocab
    summary["processes"] = jax.process_count()
    rows = loop.local_rows(trainer.token_sharding, (trainer.batch_size, trainer.seq_len + 1))
    summary["batch_rows"] = [rows.start, rows.stop]        # the rows of each batch this process reads
    validation = history.validation()
    summary["val_step"], summary["val_loss"] = validation[-1] if validation else (None, None)
    summary["communication"] = _communication(trainer, history, summary["collectives"]) if history.steps else None
    summary["resumed_from"] = history.resumed_from
    summary["schedule_change"] = history.schedule_change
    summary["history"] = history.rows()
    from jaxpar.cli.flags import translate

    summary["ignored"] = [translate(line, FLAGS) for line in trainer.spec.ignored()]     # nothing to do here
    return summary


def _format_extra(s: dict, trainer, args) -> str:
    from jaxpar.kernels.attention import describe
    from jaxpar.kernels.grouped import describe as grouped_describe
    from jaxpar.train import throughput

    peak = throughput.peak_flops(s["device_kind"], trainer.compute_dtype or trainer.dtype)
    lines = [f"  ignored (nothing to do on this mesh): {'; '.join(s['ignored'])}"] if s["ignored"] else []
    if s["processes"] > 1:
        lines.append(f"  {s['processes']} processes; process 0 read rows {s['batch_rows'][0]}:{s['batch_rows'][1]} "
                     f"of each batch of {trainer.batch_size}")
    if s["val_loss"] is not None:
        lines.append(f"  validation loss {s['val_loss']:.4f} after step {s['val_step']} (mean of --eval-batches "
                     f"{args.eval_batches} held-out batches)")
    lines.append(f"  MFU {throughput.format_mfu(s['mfu'])} ({s['flops_per_token']:,} FLOPs/token, 6N + 12·L·H·Q·T; "
                 + (f"peak {peak:.3g} FLOP/s per {s['device_kind']})" if peak else
                    f"no peak FLOP/s known for {s['device_kind']!r})"))
    lines.append(f"  attention: {describe(s['attention_kernel'])}")
    if s["expert_kernel"] is not None:
        lines.append(f"  experts: {grouped_describe(s['expert_kernel'], trainer.spec.ep)}")
    lines.append(_format_communication(s["communication"]))
    return "\n".join(lines)
