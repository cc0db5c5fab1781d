"""Megatron tensor parallelism and sequence parallelism (lecture sections 3 and 4.4).

    python examples/03_tensor_parallel.py

Runs on 8 fake CPU devices unless XLA_FLAGS sets another count. Mirrors the lecture's
03_tensor_parallel.py, lecture figures beside jaxpar's. Opens with the technique:
  demo 1  the attention + MLP block with residuals, 4-way TP (dp=2 x tp=4): Megatron's
          per-shard block (tensor.block_shard) in a shard_map laid out by TPSpecs, its
          output, input gradient and every parameter shard's gradient vs reference.block;
  demo 2  the counterexample: A split by rows, GeLU applied to partial sums;
  demo 3  the sequence-parallel MLP sublayer (RMSNorm -> all-gather -> column -> row ->
          reduce-scatter -> residual), with the norm gain's gradient all-reduced;
then the collectives of the compiled programs vs 2*s*d elements each way, the
per-device ring traffic 8*b*s*h*(t-1)/t per layer, the vocabulary-parallel LM head
(rms_norm -> unembed[D, V/t] -> cross-entropy, the logits never gathered), and the whole
model tensor parallel end to end (vocab-parallel embedding -> blocks -> LM head) against
reference.loss. The same checks as one table: `jaxpar verify tp` and `jaxpar verify sp`.
"""

from jaxpar import mesh

n = mesh.use_cpu_devices(8)

import dataclasses  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxpar import comms, reference, tensor  # noqa: E402
from jaxpar.tensor.ops import copy_to_tp  # noqa: E402
from jaxpar.testing import fwd_bwd, max_abs_diff  # noqa: E402


def tp_block(m, cfg, p, *, sp: bool):
    """The block over mesh m: Megatron's per-shard block (tensor.block_shard) in a
    shard_map, every array laid out by TPSpecs (what tensor.tp_block wraps)."""
    tp, dp = mesh.axis_size(m, mesh.TP), mesh.axis_size(m, mesh.DP)
    specs = tensor.TPSpecs.megatron(n_kv_heads=cfg.n_kv_heads, tp=tp, sequence_parallel=sp,
                                    data_axis=mesh.DP if dp > 1 else None)
    shard = partial(tensor.block_shard, cfg=cfg, axis=mesh.TP, sequence_parallel=sp)
    return jax.shard_map(shard, mesh=m, in_specs=(specs.params(p), specs.act_btd), out_specs=specs.act_btd)


@partial(jax.jit, static_argnums=3)
def reference_step(p, x, dy, cfg):
    """One device: reference.block, and the gradients of <y, dy> by jax.vjp."""
    y, vjp = jax.vjp(lambda p, x: reference.block(p, x, cfg), p, x)
    return y, vjp(dy)


def sp_mlp_sublayer(p, x, *, cfg):
    """Demo 3's sublayer on one shard: x[B, T/t, D] -> x + MLP(RMSNorm(x)), T/t tokens out."""
    gain = copy_to_tp(p["mlp_norm"], mesh.TP)        # replicated gain, gradient all-reduced
    z = reference.rms_norm(x, gain, cfg.norm_eps)    # [B, T/t, D]: norm on this device's tokens
    return x + tensor.mlp_shard(p, z, cfg=cfg, axis=mesh.TP, sequence_parallel=True)


def main():
    tp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    m = mesh.make_mesh(dp=n // tp, tp=tp)           # 8 devices: dp=2 x tp=4
    dp = n // tp
    cfg = reference.ModelConfig(n_layers=1, n_heads=8, n_kv_heads=8, d_model=64, head_dim=8, d_ff=256)
    B, T = 2 * dp, 16
    rng = np.random.default_rng(0)                  # inputs drawn with numpy: no RNG kernel to compile
    print(f"{n} devices, mesh {mesh.describe(m)}; block D={cfg.d_model} N={cfg.n_heads} F={cfg.d_ff}, B={B} T={T}\n")

    print(f"Demo 1: Transformer block (attention + MLP, residuals), {tp}-way tensor parallel")
    p = reference.layer_params(reference.init_params(jax.random.key(0), cfg), 0)
    # wq [D, N, H] = [64, 8, 8] and w_up [D, F] = [64, 256] split by columns: [64, 8/t, 8] and [64, 256/t]
    # per device; wo [8, 8, 64] and w_down [256, 64] by rows; the norm gains replicated
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = normal(B, T, cfg.d_model)                   # [B, T, D]; P(dp): [B/dp, T, D] per device
    dy = normal(B, T, cfg.d_model) / (B * T)        # the cotangent of a mean loss
    (y, (g, dx)), tp_colls = fwd_bwd(tp_block(m, cfg, p, sp=False), p, x, ct=dy)   # compiled fwd and bwd
    y_ref, (g_ref, dx_ref) = reference_step(p, x, dy, cfg)
    print(f"  output      max diff {max_abs_diff(y, y_ref):.1e}")
    print(f"  input grad  max diff {max_abs_diff(dx, dx_ref):.1e}")
    worst = max(g, key=lambda k: max_abs_diff(g[k], g_ref[k]))
    print(f"  param grads max diff {max_abs_diff(g, g_ref):.1e} (worst: {worst}; lecture: about 1e-6)")

    print("\nDemo 2: counterexample - split A by rows, GeLU of the partial sums")
    err = tensor.row_split_gelu_error(mesh=m)
    print(f"  max |sum_i GeLU(X_i A_i) - GeLU(XA)| = {err:.2f}   (lecture: 0.82 for its setup)")
    print("  GeLU(a + b) != GeLU(a) + GeLU(b): row-splitting A needs an all-reduce before GeLU")

    print("\nDemo 3: sequence-parallel MLP sublayer (RMSNorm -> AG -> column -> row -> RS -> residual)")
    mlp_p = {k: p[k] for k in ("mlp_norm", "w_up", "w_down")}
    act = P(mesh.DP if dp > 1 else None, mesh.TP, None)
    sub = jax.jit(jax.shard_map(partial(sp_mlp_sublayer, cfg=cfg), mesh=m,
                                in_specs=({"mlp_norm": P(), "w_up": P(None, mesh.TP), "w_down": P(mesh.TP, None)}, act),
                                out_specs=act))
    ref = lambda p, x: x + reference.mlp(p, reference.rms_norm(x, p["mlp_norm"], cfg.norm_eps))
    y, vjp = jax.vjp(sub, mlp_p, x)
    y_ref, vjp_ref = jax.vjp(jax.jit(ref), mlp_p, x)
    (g3, dx3), (g3_ref, dx3_ref) = vjp(dy), vjp_ref(dy)
    mlp_w = lambda g: {k: g[k] for k in ("w_up", "w_down")}
    print(f"  output {max_abs_diff(y, y_ref):.1e}, input grad {max_abs_diff(dx3, dx3_ref):.1e}, "
          f"MLP grads {max_abs_diff(mlp_w(g3), mlp_w(g3_ref)):.1e}, "
          f"norm gain grad {max_abs_diff(g3['mlp_norm'], g3_ref['mlp_norm']):.1e} (all-reduced over tp)")

    print("\nCollectives of the compiled block (b = B/dp = local batch, s = T, h = D):")
    b = B // dp
    act_elems = b * T * cfg.d_model
    _, sp_colls = fwd_bwd(tp_block(m, cfg, p, sp=True), p, x, ct=dy)
    kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, dp=dp, tp=tp)
    for name, (fwd, bwd) in (("TP", tp_colls), ("SP", sp_colls)):
        for part, got in (("forward", fwd), ("backward", bwd)):
            want = tensor.tp_block_collectives(**kw, sequence_parallel=name == "SP", backward=part == "backward")
            print(f"  {name} {part:8s}: {comms.format_stats(got)}  {'= formula' if got == want else '!= formula'}")
    print(f"  lecture: 2 all-reduces of s*d each way; here 2*b*s*h = {2 * act_elems} elements "
          f"({comms.human_bytes(2 * act_elems * 4)} f32) each way "
          f"(backward also all-reduces the {tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=tp) // 4} "
          "param-gradient elements over dp; SP adds the 2*h gains')")
    ring = tensor.ring_bytes_per_device(cfg=cfg, batch_size=b, seq_len=T, dtype=jnp.float32, tp=tp)
    print(f"\nPer-device ring traffic per layer, 8*b*s*h*(t-1)/t = {ring / 4:.0f} elements "
          f"({comms.human_bytes(ring)} f32)")
    dp_bytes = tensor.block_param_bytes(cfg=cfg, dtype=jnp.float32, tp=tp) if dp > 1 else 0
    tp_ar = tp_colls[0]["all-reduce"][1] + tp_colls[1]["all-reduce"][1] - dp_bytes
    print(f"  measured: TP all-reduce bytes (fwd + bwd, dp gradients left out) x 2(t-1)/t = "
          f"{tp_ar * 2 * (tp - 1) / tp / 4:.0f} elements")

    demo_vocab(m, cfg, B, T, rng)


def demo_vocab(m, cfg, B, T, rng):
    tp, dp = mesh.axis_size(m, mesh.TP), mesh.axis_size(m, mesh.DP)
    V = 64 * tp
    cfg = dataclasses.replace(cfg, vocab=V)
    print(f"\nVocabulary-parallel LM head (Megatron): unembed[D, V/t] per device, V={V}; the logits "
          f"[B, T, V/t] are never gathered")
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    x = normal(B, T, cfg.d_model)                              # [B, T, D]
    gain = 1 + 0.1 * normal(cfg.d_model)                       # final_norm [D]
    unembed = normal(cfg.d_model, V) / cfg.d_model ** 0.5      # [D, V]: [D, V/t] per device
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    (loss, grads), (fwd, bwd) = fwd_bwd(
        lambda *a: tensor.vocab_parallel_lm_loss(*a, targets, mesh=m, cfg=cfg), x, gain, unembed,
        ct=jnp.float32(1.0))
    ref = jax.jit(jax.value_and_grad(reference.lm_head_loss, argnums=(0, 1, 2)))(x, gain, unembed, targets)
    print(f"  loss {float(loss):.4f}; loss and dL/dx, dL/dfinal_norm, dL/dunembed vs cross_entropy(rms_norm(x) "
          f"@ unembed): max diff {max_abs_diff((loss, grads), ref):.1e}")
    kw = dict(cfg=cfg, batch_size=B, seq_len=T, dtype=jnp.float32, tp=tp, dp=dp)
    for part, got, note in (("forward", fwd, "the max, then sum exp + target logit, [b, T] each; the loss's "
                                             "mean over dp"),
                            ("backward", bwd, "f: dL/dz over tp, b*T*D; unembed and final_norm grads over dp")):
        want = tensor.lm_loss_collectives(**kw, backward=part == "backward")
        print(f"  {part:8s}: {comms.format_stats(got)}  {'= formula' if got == want else '!= formula'}  ({note})")
    print(f"  the full logits would be {comms.human_bytes(B * T * V * 4)}; each device holds 1/{tp} of them")

    print("\nThe whole model, tensor parallel end to end: vocab-parallel embedding -> tp_block x 2 -> LM head + loss")
    cfg = dataclasses.replace(cfg, n_layers=2)
    params = reference.init_params(jax.random.key(5), cfg)
    tokens = jnp.asarray(rng.integers(0, V, (B, T + 1)), jnp.int32)
    ours = jax.jit(jax.value_and_grad(lambda p: tensor.tp_loss(p, tokens, mesh=m, cfg=cfg)))(params)
    want = jax.jit(jax.value_and_grad(lambda p: reference.loss(p, tokens, cfg)))(params)
    print(f"  loss {float(ours[0]):.4f} vs reference.loss {float(want[0]):.4f}; max diff over the loss and "
          f"every parameter's gradient {max_abs_diff(ours, want):.1e}")


if __name__ == "__main__":
    main()
