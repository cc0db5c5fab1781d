"""The attention kernels: cuDNN's flash attention and a ring block's Pallas kernel on a GPU.

    python examples/12_attention_kernel.py            # CPU: what each platform would run, the XLA path
    PYTHONPATH=. python3 examples/12_attention_kernel.py   # on a GPU: cuDNN against the reference

  demo 1  `kernels.attention.choose`: which implementation runs for a platform, dtype and
          head size ("auto" takes cuDNN only where it applies), and the one-line refusal of
          "cudnn" where it cannot run;
  demo 2  the entry point on this machine's backend against reference.attention
          (outputs and dQ, dK, dV), bf16 on a GPU, float32 elsewhere;
  demo 3  what the backward keeps (T = 4096 on a GPU, 1024 elsewhere): the XLA path the [B, N, T, T] softmax,
          cuDNN q, k, v, the output and one float32 statistic per query and head (the
          activation model's flash=True term), from jax.vjp's residuals;
  demo 4  the trainer's choice for float32 and bf16 layers (Trainer.kernel);
  demo 5  ring attention whose every block is the Pallas kernel (kernels.flash: the
          merged lse goes into its backward), against the reference; interpreted off a GPU.
"""

import jax
import jax.numpy as jnp

from jaxpar import mesh as mesh_lib
from jaxpar import reference
from jaxpar.context import ring
from jaxpar.errors import ConfigError
from jaxpar.kernels import attention as kernel
from jaxpar.memory import activations
from jaxpar.testing import precision_policy
from jaxpar.train import ParallelSpec, Trainer

PLATFORM = jax.default_backend()


def draw(B, T, N, K, H, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]
    return [jax.random.normal(k, s).astype(dtype) for k, s in zip(keys, shapes)]


def main():
    print(f"== demo 1: which attention runs (this machine: {PLATFORM}) ==")
    for platform, dtype, head_dim in [("gpu", jnp.bfloat16, 128), ("gpu", jnp.float32, 128),
                                      ("gpu", jnp.bfloat16, 12), ("cpu", jnp.bfloat16, 128)]:
        chosen = kernel.choose("auto", dtype=dtype, head_dim=head_dim, platform=platform)
        print(f"  {platform} {jnp.dtype(dtype).name:<8} head_dim {head_dim:<4} auto -> {chosen}")
    try:
        kernel.choose("cudnn", dtype=jnp.float32, head_dim=128, platform="gpu")
    except ConfigError as e:
        print(f"  ConfigError: {e}")

    dtype = jnp.bfloat16 if kernel.choose(dtype=jnp.bfloat16, head_dim=64) == "cudnn" else jnp.float32
    q, k, v, do = draw(2, 256, 8, 2, 64, dtype)
    impl = kernel.choose(dtype=dtype, head_dim=64)
    print(f"\n== demo 2: {impl} ({jnp.dtype(dtype).name}) against reference.attention (float32), causal GQA 8/2 ==")
    o, vjp = jax.vjp(lambda *a: kernel.attention(*a, causal=True), q, k, v)
    with precision_policy():
        up = [a.astype(jnp.float32) for a in (q, k, v)]
        o_ref, vjp_ref = jax.vjp(lambda *a: reference.attention(*a, causal=True), *up)
        want = (o_ref, *vjp_ref(do.astype(jnp.float32)))
    for name, got, ref in zip(("out", "dQ", "dK", "dV"), (o, *vjp(do)), want):
        rel = jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
        print(f"  {name}: |{impl} - reference| / |reference| = {float(rel):.1e}")

    B, T, N, K, H = 1, 4096 if impl == "cudnn" else 1024, 8, 2, 64     # the XLA path's residuals grow as T^2
    q, k, v, _ = draw(B, T, N, K, H, dtype)
    _, residuals = jax.vjp(lambda *a: kernel.attention(*a, causal=True), q, k, v)
    kept = sum(a.nbytes for a in jax.tree.leaves(residuals) if hasattr(a, "nbytes"))
    block = activations.Block(d_model=N * H, n_heads=N, n_kv_heads=K, flash=True, act_bytes=q.dtype.itemsize)
    stats = {t.name: t.bytes for t in activations.layer_terms(block, seq_len=T, batch_size=B)}
    scores = B * N * T * T * 4
    print(f"\n== demo 3: what {impl}'s backward keeps at T={T} ==")
    print(f"  {kept / 2**20:.1f} MiB (one float32 [B, N, T, T] is {scores / 2**20:.0f} MiB; the flash model's "
          f"statistics {stats['softmax statistics (lse)'] / 2**10:.0f} KiB)")

    print("\n== demo 4: the trainer's attention ==")
    cfg = reference.ModelConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab=64)
    for compute in (None, jnp.bfloat16):
        trainer = Trainer(cfg, ParallelSpec(), batch_size=2, seq_len=16, devices=jax.devices()[:1],
                          compute_dtype=compute)
        name = "float32" if compute is None else "bfloat16"
        print(f"  {name} layers on {PLATFORM}: {kernel.describe(trainer.kernel)}")

    cp = 2 if len(jax.devices()) >= 2 else 1
    print(f"\n== demo 5: ring attention at cp={cp}, every block through the Pallas kernel ==")
    for platform, dtype in [("gpu", jnp.bfloat16), ("gpu", jnp.float32), ("cpu", jnp.bfloat16)]:
        chosen = [kernel.choose_block(name, dtype=dtype, tq=1024, tk=1024, head_dim=128, platform=platform)
                  for name in ("auto", "pallas")]
        print(f"  {platform} {jnp.dtype(dtype).name:<8} auto -> {chosen[0]}, pallas -> {chosen[1]}")
    q, k, v, _ = draw(1, 128, 4, 2, 16, jnp.float32)
    mesh = mesh_lib.make_mesh(cp=cp, devices=jax.devices()[:cp])
    with precision_policy():
        got = ring.ring_attention(q, k, v, mesh=mesh, layout="zigzag", kernel="pallas")
        err = float(jnp.max(jnp.abs(got - reference.attention(q, k, v, causal=True))))
    print(f"  zigzag, float32: max |ring - reference| = {err:.1e}")


if __name__ == "__main__":
    main()
