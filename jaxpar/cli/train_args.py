"""`jaxpar train`'s command line: its flags in three parts (how the model is split, the
model and its optimizer, the run), and FLAGS, the library's names as these flags, which
error messages are translated with (cli.flags.translate)."""

from __future__ import annotations

import argparse

from jaxpar.schedules import orders

FLAGS = {"dp": "--mesh dp", "pp": "--mesh pp", "tp": "--mesh tp", "cp": "--mesh cp", "ep": "--mesh ep",
         "microbatches": "--microbatches", "batch_size": "--batch", "seq_len": "--seq", "n_layers": "--layers",
         "n_heads": "--heads", "n_kv_heads": "--kv-heads", "vocab": "--vocab", "n_experts": "--experts",
         "d_ff": "--ffn", "chunks": "--chunks", "zero": "--zero", "compute_dtype": "--dtype", "attention": "--attention",
         "layout": "--layout", "recompute": "--recompute", "layers_per_stage": "--layers-per-stage",
         "schedule": "--schedule", "steps": "--steps", "warmup": "--warmup", "lr": "--lr", "every": "--every",
         "directory": "--checkpoint", "log": "--log", "router": "--router", "aux_loss": "--aux-loss",
         "bias_rate": "--bias-rate", "top_k": "--top-k", "eval_every": "--eval-every",
         "eval_batches": "--eval-batches", "coordinator": "--coordinator", "num_processes": "--processes",
         "process_id": "--process-id", "profile": "--profile", "resume": "--resume", "clip": "--clip",
         "attention_kernel": "--attention-kernel", "expert_kernel": "--expert-kernel", "d_model": "--d-model",
         "sequence_parallel": "--sp", "out": "--out", "head_dim": "head_dim (--d-model / --heads)"}
HELP = "train the composed model on a dp x pp x tp x cp x ep mesh (lecture 7), with a summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _parallel_arguments(parser)
    _model_arguments(parser)
    _run_arguments(parser)


def _parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model is split: the mesh and each technique's options."""
    parser.add_argument("--mesh", default="dp=2,pp=2,tp=2", help="axis sizes, e.g. dp=2,pp=2,tp=2 (dp pp cp ep tp)")
    parser.add_argument("--schedule", default=orders.DEFAULT, help=f"one of: {', '.join(orders.REGISTRY)}")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches (default: 2 x pp)")
    parser.add_argument("--chunks", type=int, default=None,
                        help=f"model chunks per device ({', '.join(orders.names(takes_chunks=True))})")
    parser.add_argument("--layers-per-stage", default=None,
                        help="uneven stages: the layers of each model stage (pp x chunks of them, in model order), "
                             "e.g. 1,2,2,1 (the first and last stages also run the embedding and the LM head; "
                             "default: --layers split evenly; --layers defaults to their sum)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism on tp")
    parser.add_argument("--recompute", nargs="?", const="full", default="none",
                        help="what B recomputes: none (the default), full (F keeps only each stage's input; what "
                             "--recompute alone means), or dots (F keeps the matmuls' and collectives' outputs, "
                             "B recomputes norms, attention scores, softmax and activations: MaxText's "
                             "remat_policy=minimal)")
    parser.add_argument("--zero", type=int, default=0,
                        help="ZeRO over dp: 1 optimizer state sharded, 2 and gradients reduce-scattered (in one "
                             "compiled step ZeRO-1's program), 3 (FSDP) and the weights sharded, gathered layer by layer")
    parser.add_argument("--dtype", default="float32",
                        help="float32, or bfloat16: the layers compute in bf16, float32 master weights and AdamW "
                             "state, loss and softmax statistics in float32")
    parser.add_argument("--attention", default="ring", help="ring or ulysses over cp")
    parser.add_argument("--attention-kernel", default="auto",
                        help="the attention's kernel: auto (cuDNN's flash attention over whole sequences on a GPU "
                             "with --dtype bfloat16, XLA elsewhere), xla, cudnn, or pallas (jaxpar's kernel, also for "
                             "ring blocks, on a GPU); refused where they cannot run")
    parser.add_argument("--layout", default="contiguous", help="contiguous or zigzag (ring over cp)")
    parser.add_argument("--expert-kernel", default="auto",
                        help="the MoE's grouped expert matmuls: auto (XLA's batched matmuls), xla, or pallas "
                             "(jaxpar's grouped-matmul kernel: 128-row tiles, no weight copies; on a GPU at ep=1)")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its batch and its optimizer."""
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: fits the mesh)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: 2 per stage)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary (default 64; with --data, the data's, rounded up to a multiple of tp)")
    parser.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense)")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--router", default="softmax", help="softmax, or sigmoid (DeepSeek-V3, with --bias-rate)")
    parser.add_argument("--aux-loss", type=float, default=0.0,
                        help="weight of the per-sequence balance loss (Switch/GShard; e.g. 0.01; 0: off)")
    parser.add_argument("--bias-rate", type=float, default=0.0,
                        help="DeepSeek-V3's router-bias step per update (e.g. 0.001; --router sigmoid; 0: off)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: steps / 10)")
    parser.add_argument("--clip", type=float, default=1.0)


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    """Checkpoints, logs, data, evaluation, profiling, processes and output."""
    parser.add_argument("--checkpoint", default=None,
                        help="directory (its folder must exist): save every --every steps and the last, resume from it")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--resume", type=int, default=None, metavar="STEP",
                        help="resume from this step of --checkpoint (default: the latest); a larger --steps than "
                             "the checkpoint's run extends it")
    parser.add_argument("--log", default=None,
                        help="append one JSON line per step to this file (its folder must exist)")
    parser.add_argument("--data", default=None,
                        help="a tokenized text directory (`jaxpar data prepare`) to train on (default: the generated "
                             "corpus)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="validation loss every N steps and at the end (default: steps / 10 with --data, "
                             "else off; 0: off)")
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches averaged (default 4)")
    parser.add_argument("--profile", default=None,
                        help="trace 3 steps after the first with jax.profiler into this directory and report the "
                             "share of op time in collectives")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0: join a multi-process job")
    parser.add_argument("--processes", type=int, default=None, help="processes in the job (with --coordinator)")
    parser.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. processes-1")
    parser.add_argument("--distributed", choices=["auto"], default=None,
                        help="auto: join the cluster job jax.distributed detects (SLURM, Open MPI, Kubernetes)")
    parser.add_argument("--out", default="jaxpar-train", help="where the loss curve goes (default jaxpar-train/)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--devices", type=int, default=None,
                        help="fake CPU devices of this process (default: the mesh's, split over the processes)")
    parser.add_argument("--platform", choices=["cpu", "default"], default="default")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
