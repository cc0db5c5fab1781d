"""A few bf16 training steps of a small model on one device: what the GPU tests compare a
kernel's trainer against the XLA path's with."""

import jax
import jax.numpy as jnp

from jaxpar.train import ParallelSpec, Trainer


def losses(cfg, tokens, *, steps: int = 3, **trainer_kwargs) -> tuple[list[float], Trainer]:
    """(the loss of each of `steps` steps from the same init on the same batch, the Trainer),
    mixed precision (bf16 layers), one device."""
    batch_size, seq_len = tokens.shape[0], tokens.shape[1] - 1
    trainer = Trainer(cfg, ParallelSpec(), batch_size=batch_size, seq_len=seq_len, devices=jax.devices()[:1],
                      compute_dtype=jnp.bfloat16, **trainer_kwargs)
    state, out = trainer.init(jax.random.key(1)), []
    for _ in range(steps):
        state, metrics = trainer.step(state, trainer.put(tokens))
        out.append(float(metrics["loss"]))
    return out, trainer
