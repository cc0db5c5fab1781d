"""The unsharded step every parity check compares against: `reference.loss_and_balance`,
optax's norm, the same clipping and AdamW as the trainer, the router bias moved by the
whole batch's load (`balance.update_bias`). Plain jit on one device, nothing sharded.

    tx, step = reference_trainer(cfg, optim)       # (params, opt, tokens) -> (params, opt, loss, norm)
    parts = reference_parts(cfg, optim)            # the same step in two halves:
    loss, grads, norm, load = parts.gradients(params, tokens)     # grads clipped by norm
    params, opt = parts.apply(params, opt, grads, load)

`reference_parts` is what `train.verify.parity` judges each step of a sharded run with:
the gradients at that run's weights, and AdamW applied to the gradients the run applied.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar import reference
from jaxpar.train import balance
from jaxpar.train import optim as optim_lib

# (cfg, optim[, compute dtype]) -> (ReferenceParts, reference_trainer's jitted step); a handful a process
_REFERENCE: dict = {}


class ReferenceParts(NamedTuple):
    """The unsharded step in its two halves, for a check at the weights of another run
    (`train.verify.parity`): `gradients(params, tokens)` -> (loss, the gradients clipped by
    their norm, the norm, the MoE load), and `apply(params, opt, clipped gradients, load)`
    -> (params, opt): AdamW and the router bias's move. Both jitted."""

    tx: optax.GradientTransformation
    gradients: Any
    apply: Any


def reference_trainer(cfg: reference.ModelConfig, optim: optim_lib.OptimConfig, compute_dtype=None):
    """The unsharded step the parity tests compare against: (params, opt, tokens) ->
    (params, opt, loss, norm), reference.loss with optax.tree.norm and the same AdamW;
    the router bias, if any, moved by the whole batch's load (`balance.update_bias`). One
    (tx, step) per (cfg, optim, compute_dtype): the step's compiled programs are shared by
    every caller. compute_dtype: mixed precision, as `Trainer`'s (reference.loss's casts)."""
    parts, step = _reference(cfg, optim, compute_dtype)
    return parts.tx, step


def reference_parts(cfg: reference.ModelConfig, optim: optim_lib.OptimConfig, compute_dtype=None) -> ReferenceParts:
    """`reference_trainer`'s step in two jitted halves (`ReferenceParts`), shared likewise."""
    return _reference(cfg, optim, compute_dtype)[0]


def _reference(cfg, optim, compute_dtype):
    key = (cfg, optim) if compute_dtype is None else (cfg, optim, jnp.dtype(compute_dtype).name)
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_step(cfg, optim, compute_dtype)
    return _REFERENCE[key]


def _reference_step(cfg: reference.ModelConfig, optim: optim_lib.OptimConfig, compute_dtype=None):
    tx = optim.transform()

    def gradients(params, tokens):
        (loss, terms), grads = jax.value_and_grad(reference.loss_and_balance, has_aux=True)(params, tokens, cfg,
                                                                                            compute_dtype)
        norm = optax.tree.norm(grads)
        return loss, optim_lib.clip(grads, norm, optim.clip), norm, terms["load"]

    def apply(params, opt, grads, load):
        updates, opt = tx.update(grads, opt, params)
        return balance.update_bias(optax.apply_updates(params, updates), params, load, cfg), opt

    @jax.jit
    def step(params, opt, tokens):
        loss, grads, norm, load = gradients(params, tokens)
        return *apply(params, opt, grads, load), loss, norm
    return ReferenceParts(tx, jax.jit(gradients), jax.jit(apply)), step
