"""A small language model trained on real English text on a dp x tp mesh, then asked to write.

    python examples/11_train_on_text.py

On 4 fake CPU devices, in about a minute. The text is Python's own help pages, which
every Python installation carries (`pydoc_data.topics`, about 460 KB of English). The
example:
  1  prepares it (`jaxpar data prepare` does the same from the command line): a byte-level
     BPE tokenizer of 512 tokens trained on it, the tokens written as train.bin and
     val.bin (the stream's last 5% held out), tokenizer.json and meta.json;
  2  opens the directory memory-mapped (`TokenData`): batch i is a function of (seed, i)
     only, so a resumed run sees the batches the uninterrupted run saw;
  3  trains on dp2 x tp2 with `fit`, the training and the validation loss falling (the
     validation loss from the canonical parameters with `reference.loss`, on batches of
     the held-out tail only);
  4  continues a prompt greedily with `reference.forward` on the trained parameters.
The same from the command line: `jaxpar data prepare FILE... --out DIR`; the trainer
with a data directory: docs/train.md, "Real data".
"""

import os
import tempfile

from jaxpar import mesh

mesh.use_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pydoc_data.topics  # noqa: E402

from jaxpar import reference  # noqa: E402
from jaxpar.train import OptimConfig, ParallelSpec, Trainer, fit, text  # noqa: E402

VOCAB_SIZE = 512                                                 # the tokenizer's; a multiple of tp for the model
CFG = reference.ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, mlp="swiglu",
                            vocab=VOCAB_SIZE, rope_theta=10000.0)
SPEC = ParallelSpec(dp=2, tp=2)                                  # 2 replicas, each Megatron TP over 2 devices
STEPS, EVERY = 150, 50                                           # report the losses every 30 steps
OPTIM = OptimConfig(lr=1e-2, warmup=10, steps=STEPS, clip=1.0)
B, T = 16, 64                                                    # batches int32[B, T + 1]
VALIDATION_BATCHES = 4


def write_help_pages(directory: str) -> str:
    """The help pages of `pydoc_data.topics` (a dict of page name -> text in the module
    file below) as one UTF-8 text file; its path."""
    path = os.path.join(directory, "python-help.txt")
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n\n".join(pydoc_data.topics.topics.values()))
    print(f"source: the help pages in {pydoc_data.topics.__file__}, {os.path.getsize(path) / 1e3:.0f} KB of text")
    return path


@jax.jit
def mean_loss(params, batches):
    """The mean of reference.loss over batches int32[k, B, T + 1]."""
    return jnp.mean(jax.lax.map(lambda tokens: reference.loss(params, tokens, CFG), batches))


def validation_loss(trainer, state, data) -> float:
    """The loss on the first VALIDATION_BATCHES validation batches (the held-out tail)."""
    params = trainer.canonical(state)[0]                         # as reference.init_params lays them out
    batches = np.stack([data.validation_batch(k, batch_size=B, seq_len=T) for k in range(VALIDATION_BATCHES)])
    return float(mean_loss(params, batches))


@jax.jit
def next_token(params, window, position):
    """The most likely token after window[:position + 1]; window int32[T] (causal, so the
    padding after `position` does not matter, and one compile serves every length)."""
    logits = reference.forward(params, window[None], CFG)        # [1, T, V]
    return jnp.argmax(logits[0, position])


def continue_greedily(params, data, prompt: str, new_tokens: int) -> str:
    ids = list(data.encode(prompt))
    for _ in range(new_tokens):
        context = ids[-T:]
        window = np.zeros(T, np.int32)
        window[:len(context)] = context
        ids.append(int(next_token(params, window, len(context) - 1)))
    return data.decode(ids)


def main():
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices\n")
    with tempfile.TemporaryDirectory() as directory:
        print("== 1: prepare the text ==")
        meta = text.prepare([write_help_pages(directory)], os.path.join(directory, "data"), vocab_size=VOCAB_SIZE,
                            validation=0.05, seed=0)
        print(f"  {meta['train_tokens']:,} train and {meta['validation_tokens']:,} validation tokens "
              f"({meta['dtype']}), vocab {meta['vocab_size']}")

        print("\n== 2: open it memory-mapped ==")
        data = text.TokenData(os.path.join(directory, "data"))
        text.check_vocab(data, CFG.vocab)                        # a token >= CFG.vocab would have no embedding
        first = data.batch(0, batch_size=B, seq_len=T)
        print(f"  {data}")
        print(f"  batch 0: {first.dtype}{list(first.shape)}, its first row: {data.decode(first[0])[:60]!r}...")
        same = np.array_equal(first, text.TokenData(os.path.join(directory, "data")).batch(0, batch_size=B, seq_len=T))
        print(f"  batch 0 again, from a fresh TokenData: the same tokens: {'ok' if same else 'FAILED'}")

        print(f"\n== 3: train on {SPEC.describe()}, {STEPS} steps ==")
        trainer = Trainer(CFG, SPEC, OPTIM, batch_size=B, seq_len=T)
        state = trainer.init(jax.random.key(0))
        first_val = validation_loss(trainer, state, data)
        print(f"  step   0: validation loss {first_val:.3f} (log V = {np.log(data.vocab):.3f})")
        train_losses = []
        for stop in range(EVERY, STEPS + 1, EVERY):
            state, history = fit(trainer, steps=stop, corpus=data, state=state, progress=False)
            train_losses += history.losses
            val = validation_loss(trainer, state, data)
            recent = np.mean(history.losses[-10:])
            print(f"  step {stop:3d}: training loss {recent:.3f} (mean of the last 10 steps), validation loss {val:.3f}")
        falling = np.mean(train_losses[-10:]) < train_losses[0] - 1.0 and val < first_val - 1.0
        print(f"  training and validation losses fell by more than 1 nat: {'ok' if falling else 'FAILED'}")

        print("\n== 4: continue a prompt greedily ==")
        params = trainer.canonical(state)[0]
        prompt = "The return value of"
        continued = continue_greedily(params, data, prompt, new_tokens=40)
        print(f"  prompt {prompt!r}, 40 tokens on: {continued!r}")


if __name__ == "__main__":
    main()
