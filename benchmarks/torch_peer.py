"""jaxpar's trainer beside what a PyTorch user would run for the same model on the same GPU.

    PYTHONPATH=. python3 -m benchmarks.torch_peer --quick --out DIR      # one GPU: 124M and 1B, ~3 min
    PYTHONPATH=. python3 -m benchmarks.torch_peer --size tiny --cpu --out DIR    # CPU, float32, seconds
    python -m benchmarks.run torch_peer                                  # --quick, in a fresh process

Both train reference.ModelConfig's decoder (pre-norm RMSNorm blocks, rotary embedding,
grouped-query attention, GeLU or SwiGLU MLP, untied LM head, mean next-token
cross-entropy) from the same weights (`reference.init_params`, copied by `torch_weights`)
on the same batches (`Corpus.batch(i)`) with the same AdamW (b1, b2, eps, weight decay on
all but the norm gains, global-norm clipping) at the same rates (jaxpar's warm-up + cosine,
evaluated by `OptimConfig.schedule` and handed to torch's LambdaLR). jaxpar: `Trainer(cfg,
ParallelSpec(), optim, dtype=float32, compute_dtype=bfloat16)` on one device. torch:
`Decoder` below, `torch.compile`d, `F.scaled_dot_product_attention(is_causal=True,
enable_gqa=True)` (the kernel it picks is recorded), bf16 autocast over float32 weights,
`torch.optim.AdamW(fused=True)`, `clip_grad_norm_`. A step's time is its wall time until
its loss is on the host, the figure the median after WARMUP steps; every step's loss is
compared (bf16: about 1e-2 relative; float32 on CPU: 1e-4, tests/benchmarks/).

Where the two cannot be identical:
  * mixed precision: jaxpar casts every weight to bf16 before any layer (reference.cast):
    embedding, residual stream, norms and rotary embedding run in bf16 (softmax statistics
    and loss in float32). Autocast casts only the inputs of matmuls and attention: torch's
    residual stream and norms stay float32, as any PyTorch user's do.
  * attention: each side's kernel is recorded: torch's, the one SDPA's dispatcher picks
    (FLASH_ATTENTION wanted); jaxpar's, `Trainer.kernel` where the trainer has one
    (cuDNN's flash attention where kernels.attention applies it), else the XLA path
    (reference.attention's einsums, which form the [B, N, T, T] scores). The same math,
    rounded otherwise.
  * clipping: torch scales by clip / (norm + 1e-6), jaxpar by clip / norm.
  * on CPU (--cpu) torch runs eager and its AdamW unfused (foreach, the same arithmetic):
    inductor needs a C++ compiler and minutes, the fused CPU AdamW is 100x slower, and
    the CPU run checks numbers, not speed.
  * order: torch runs first at each size, then jaxpar: torch.cuda.empty_cache() gives
    torch's memory back, while JAX's pool (XLA_PYTHON_CLIENT_PREALLOCATE=false) only grows.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # before JAX starts: room for torch

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.train.data import Corpus
from jaxpar.train.optim import OptimConfig
from jaxpar.train.spec import ParallelSpec
from jaxpar.train.step import Trainer

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:        # the weight map and jaxpar's half still import (and are tested) without torch
    torch = F = None
    nn = types.SimpleNamespace(Module=object)

WARMUP = 3                 # steps left out of the timing (the first compiles)
STEPS = 50                 # steps whose losses are compared


@dataclasses.dataclass(frozen=True, kw_only=True)
class Size:
    cfg: reference.ModelConfig
    batch_size: int
    seq_len: int
    lr: float              # peak rate: GPT-2's 6e-4 at 124M, Llama's 3e-4 at 1B
    quick_steps: int       # under --quick: 1B's 50 steps would not fit ~3 minutes with its compiles


SIZES = {
    "tiny": Size(cfg=reference.ModelConfig(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                                           n_layers=2, mlp="swiglu", rope_theta=10000.0),
                 batch_size=4, seq_len=64, lr=3e-3, quick_steps=STEPS),
    "124M": Size(cfg=reference.ModelConfig(vocab=32000, d_model=768, n_heads=12, n_kv_heads=12, head_dim=64,
                                           d_ff=3072, n_layers=12, mlp="gelu", rope_theta=10000.0),
                 batch_size=16, seq_len=1024, lr=6e-4, quick_steps=STEPS),
    "1B": Size(cfg=reference.ModelConfig(vocab=32000, d_model=2048, n_heads=16, n_kv_heads=8, head_dim=128,
                                         d_ff=5632, n_layers=16, mlp="swiglu", rope_theta=10000.0),
               batch_size=8, seq_len=2048, lr=3e-4, quick_steps=WARMUP + 10),
}


def optim_config(size: Size, steps: int) -> OptimConfig:
    """jaxpar's defaults (b 0.9/0.95, eps 1e-8, decay 0.1, clip 1) at the size's rate, a
    fifth of the run warming up, the cosine ending with the run."""
    return OptimConfig(lr=size.lr, warmup=max(1, steps // 5), steps=steps)


def torch_weights(params: dict, cfg: reference.ModelConfig) -> dict[str, np.ndarray]:
    """reference.init_params's tree as float32 arrays named and shaped as `Decoder`'s
    parameters: nn.Linear holds [out, in], so every matrix is transposed, its head axes
    flattened (N, H) -> N*H; the stacked blocks [L, ...] become blocks.{l}.*."""
    if cfg.n_experts:
        raise ConfigError(f"n_experts={cfg.n_experts}: the torch peer is the dense decoder. Fix: n_experts=0")
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out = {"embed.weight": p["embed"], "final_norm": p["final_norm"], "unembed.weight": p["unembed"].T}
    b = p["blocks"]
    for layer in range(cfg.n_layers):
        pre = f"blocks.{layer}."
        out |= {pre + "attn_norm": b["attn_norm"][layer], pre + "mlp_norm": b["mlp_norm"][layer],
                pre + "wq.weight": b["wq"][layer].reshape(D, N * H).T,
                pre + "wk.weight": b["wk"][layer].reshape(D, K * H).T,
                pre + "wv.weight": b["wv"][layer].reshape(D, K * H).T,
                pre + "wo.weight": b["wo"][layer].reshape(N * H, D).T}
        out |= {pre + f"{name}.weight": b[name][layer].T for name in ("w_up", "w_gate", "w_down") if name in b}
    out = {name: np.array(a, np.float32, order="C") for name, a in out.items()}   # writable for torch
    assert sum(a.size for a in out.values()) == n_params(params), "a jaxpar weight has no torch parameter"
    return out


def n_params(params) -> int:
    return sum(a.size for a in jax.tree.leaves(params))


# ---- the PyTorch side ---------------------------------------------------------------------

def rms_norm(x, gain, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def rope(x, positions, theta: float):
    """Llama's half-split rotary embedding of x [B, T, n, H], as reference.rope."""
    H = x.shape[-1]
    freq = theta ** (-torch.arange(0, H // 2, dtype=torch.float32, device=x.device) * 2 / H)
    angle = positions.float()[:, None] * freq                                           # [T, H/2]
    cos, sin = (f(angle).to(x.dtype)[None, :, None, :] for f in (torch.cos, torch.sin))
    x1, x2 = x[..., :H // 2], x[..., H // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); y = h + mlp(norm(h)). Parameters named as the reference's."""

    def __init__(self, cfg: reference.ModelConfig):
        super().__init__()
        D, N, K, H, Fd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.wq, self.wo = nn.Linear(D, N * H, bias=False), nn.Linear(N * H, D, bias=False)
        self.wk, self.wv = nn.Linear(D, K * H, bias=False), nn.Linear(D, K * H, bias=False)
        self.w_up, self.w_down = nn.Linear(D, Fd, bias=False), nn.Linear(Fd, D, bias=False)
        if cfg.mlp == "swiglu":
            self.w_gate = nn.Linear(D, Fd, bias=False)

    def forward(self, x, positions):
        cfg, (B, T, _) = self.cfg, x.shape
        z = rms_norm(x, self.attn_norm, cfg.norm_eps)
        q = self.wq(z).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.wk(z).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(z).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.rope_theta:
            q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=cfg.causal, enable_gqa=True)                # [B, N, T, H]
        h = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
        z = rms_norm(h, self.mlp_norm, cfg.norm_eps)
        up = self.w_up(z)
        hidden = F.gelu(up) if cfg.mlp == "gelu" else F.silu(self.w_gate(z)) * up    # gelu: erf, as jax's exact
        return h + self.w_down(hidden)


class Decoder(nn.Module):
    """tokens -> mean next-token cross-entropy, as reference.loss (logits to float32 first)."""

    def __init__(self, cfg: reference.ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.d_model))
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        positions = torch.arange(inputs.shape[1], device=inputs.device)
        for block in self.blocks:
            x = block(x, positions)
        logits = self.unembed(rms_norm(x, self.final_norm, self.cfg.norm_eps))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def torch_adamw(model, optim: OptimConfig, rates: list[float], fused: bool = True):
    """Fused AdamW, decay on every parameter but the norm gains (jaxpar's decay_mask rule
    on the names), the rate of step i = jaxpar's schedule(i)."""
    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("norm") == gain],
               "weight_decay": 0.0 if gain else optim.weight_decay} for gain in (False, True)]
    opt = torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps, fused=fused)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda count: rates[count] / optim.lr)


class Side(NamedTuple):
    losses: list
    seconds: list
    attention: str = ""      # the attention kernel that ran


def timed(step, data: list) -> Side:
    """step(item) for each item, each returning its loss as a Python float (so it has finished)."""
    losses, seconds = [], []
    for item in data:
        start = time.perf_counter()
        losses.append(step(item))
        seconds.append(time.perf_counter() - start)
    return Side(losses, seconds)


def run_torch(size: Size, weights: dict, batches: list, optim: OptimConfig, rates: list, device: str) -> Side:
    with torch.device(device):
        model = Decoder(size.cfg)
    model.load_state_dict({name: torch.from_numpy(a) for name, a in weights.items()}, strict=True)
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(a.size for a in weights.values()), f"torch has {count} parameters"
    opt, schedule = torch_adamw(model, optim, rates, fused=device == "cuda")
    forward = torch.compile(model) if device == "cuda" else model

    def step(tokens):
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if optim.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()                         # waits for the step (a device sync)
    side = timed(step, [torch.from_numpy(b).to(device, torch.long) for b in batches])
    return side._replace(attention=sdpa_backend(size, device))


# ---- jaxpar's side and the comparison -----------------------------------------------------

def run_jaxpar(size: Size, params: dict, batches: list, optim: OptimConfig, mixed: bool) -> Side:
    trainer = Trainer(size.cfg, ParallelSpec(), optim, batch_size=size.batch_size, seq_len=size.seq_len,
                      devices=jax.devices()[:1], dtype=jnp.float32, compute_dtype=jnp.bfloat16 if mixed else None)
    state = trainer.from_canonical(params)

    def step(tokens):
        nonlocal state
        state, metrics = trainer.step(state, tokens)
        return float(metrics["loss"])              # waits for the step (block_until_ready)
    return timed(step, [trainer.put(b) for b in batches])._replace(attention=trainer.kernel)


def _guarded(fn, *args) -> Side | str:
    """fn(*args), or its error in one line (an out-of-memory on one side still reports the other)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (any failure of a side is reported, not raised)
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"[:300]
    finally:
        if torch is not None:
            torch._dynamo.reset()          # torch.compile's caches hold the model: let it go
        gc.collect()
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()       # torch's cached memory back to the device, for JAX


def compare(size: Size, steps: int, device: str) -> dict:
    """Both sides for `steps` steps from seed 0's weights on Corpus batches 0..steps-1."""
    optim = optim_config(size, steps)
    corpus = Corpus(vocab=size.cfg.vocab)
    batches = [corpus.batch(i, batch_size=size.batch_size, seq_len=size.seq_len) for i in range(steps)]
    params = jax.tree.map(np.asarray, reference.init_params(jax.random.key(0), size.cfg))  # host: device freed
    rates = [float(r) for r in np.asarray(optim.schedule()(jnp.arange(steps + 1)))]
    peer = _guarded(run_torch, size, torch_weights(params, size.cfg), batches, optim, rates, device)
    ours = _guarded(run_jaxpar, size, params, batches, optim, device != "cpu")
    return summary(size, steps, n_params(params), ours, peer)


def sdpa_backend(size: Size, device: str) -> str:
    """The kernel torch's dispatcher picks for this size's attention (FLASH_ATTENTION wanted)."""
    cfg, dtype = size.cfg, torch.bfloat16 if device == "cuda" else torch.float32
    q, k = (torch.empty(size.batch_size, n, size.seq_len, cfg.head_dim, dtype=dtype, device=device,
                        requires_grad=True) for n in (cfg.n_heads, cfg.n_kv_heads))
    try:
        choice = torch._fused_sdp_choice(q, k, k, is_causal=cfg.causal, enable_gqa=True)
        return torch.nn.attention.SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:    # a private function: it may move
        return f"unknown ({type(e).__name__})"


def summary(size: Size, steps: int, count: int, ours: Side | str, peer: Side | str) -> dict:
    tokens = size.batch_size * size.seq_len
    out = {"params": count, "batch_size": size.batch_size, "seq_len": size.seq_len, "steps": steps,
           "model": dataclasses.asdict(size.cfg)}
    for name, side in (("jaxpar", ours), ("torch", peer)):
        if isinstance(side, str):
            out[name] = {"error": side}
            continue
        ms = 1e3 * float(np.median(side.seconds[min(WARMUP, len(side.seconds) - 1):]))
        out[name] = {"ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3, "first_step_s": side.seconds[0],
                     "attention": side.attention, "losses": side.losses}
    if not isinstance(ours, str) and not isinstance(peer, str):
        a, b = np.asarray(ours.losses), np.asarray(peer.losses)
        out |= {"ratio": out["jaxpar"]["ms_per_step"] / out["torch"]["ms_per_step"],
                "max_loss_diff": float(np.max(np.abs(a - b))),
                "max_rel_loss_diff": float(np.max(np.abs(a - b) / np.abs(b)))}
    return out


def rows(result: dict) -> list[dict]:
    """The table's rows: one per size, or the reason nothing ran."""
    if "skipped" in result:
        return [{"skipped": result["skipped"]}]
    table = []
    for name, r in result["sizes"].items():
        row = {"size": name, "params": f"{r['params'] / 1e6:.3g}M", "B x T": f"{r['batch_size']} x {r['seq_len']}"}
        for side in ("jaxpar", "torch"):
            s = r[side]
            row |= {f"{side} ms": f"failed: {s['error']}"} if "error" in s else {
                f"{side} ms": s["ms_per_step"], f"{side} tok/s": s["tokens_per_s"], f"{side} attention": s["attention"]}
        if "ratio" in r:
            row |= {"jaxpar/torch": r["ratio"], "steps": r["steps"], "max |dloss|": r["max_loss_diff"],
                    "max rel": r["max_rel_loss_diff"]}
        table.append(row)
    return table


def skip_reason(cpu: bool) -> str | None:
    if torch is None:
        return "torch is not installed: nothing to compare jaxpar with (pip install torch)"
    if not cpu and not torch.cuda.is_available():
        return "no CUDA GPU for torch (--cpu runs the tiny size on the CPU, in float32)"
    if not cpu and jax.default_backend() != "gpu":
        return f"JAX runs on {jax.default_backend()}, not the GPU (install jax[cuda])"
    return None


def _versions(device: str) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:          # no git where it runs
        commit = None
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "jax": jax.__version__, "jax_device": jax.devices()[0].device_kind, "commit": commit}


def _write(out: Path | None, result: dict):
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "torch_peer.json").write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", choices=list(SIZES),
                        help="repeatable; default 124M and 1B (tiny with --cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer steps where the size says (1B: 13)")
    parser.add_argument("--steps", type=int, help=f"steps per size (default {STEPS}, or --quick's)")
    parser.add_argument("--cpu", action="store_true", help="run both sides on the CPU in float32")
    parser.add_argument("--out", type=Path, help="write DIR/torch_peer.json")
    args = parser.parse_args(argv)
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    reason = skip_reason(args.cpu)
    result = {"skipped": reason} if reason else {**_versions("cpu" if args.cpu else "cuda"), "sizes": {}}
    _write(args.out, result)
    for name in [] if reason else args.size or (["tiny"] if args.cpu else ["124M", "1B"]):
        steps = args.steps or (SIZES[name].quick_steps if args.quick else STEPS)
        result["sizes"][name] = compare(SIZES[name], steps, "cpu" if args.cpu else "cuda")
        _write(args.out, result)           # after each size: a run cut short keeps what it measured
    if reason:
        print(json.dumps(result))
        return 0
    from benchmarks.run import format_rows
    print(format_rows(rows(result)))
    return int(any("error" in r["jaxpar"] or "error" in r["torch"] for r in result["sizes"].values()))


def run() -> list[dict]:
    """`python -m benchmarks.run torch_peer`: --quick in a fresh process (JAX there must
    not have taken the GPU's memory before torch starts), its rows."""
    with tempfile.TemporaryDirectory() as out:
        root = Path(__file__).resolve().parent.parent
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "benchmarks.torch_peer", "--quick", "--out", out], cwd=root,
                              env=env, check=False)
        path = Path(out) / "torch_peer.json"
        if not path.exists():
            return [{"failed": f"python -m benchmarks.torch_peer --quick exited with {done.returncode}"}]
        return rows(json.loads(path.read_text()))


if __name__ == "__main__":
    sys.exit(main())
