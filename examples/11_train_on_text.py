"""A small language model trained on real English text on a dp x tp mesh, then asked to write.

    python examples/11_train_on_text.py

On 4 fake CPU devices, in about a minute, on Python's own help pages (`pydoc_data.topics`, 460 KB).
`text.prepare`: a byte-level BPE tokenizer of 512 tokens, the tokens written, the last 5% held out;
`text.TokenData` opens them memory-mapped (batch i depends on (seed, i) only: a resumed run sees
the same batches); `fit` trains on dp2 x tp2, the validation loss every 50 steps; the trained model
continues a prompt. Command line: `jaxpar data prepare FILE... --out DIR`, `jaxpar train --data DIR`.
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
from jaxpar.train import OptimConfig, ParallelSpec, Trainer, Validation, fit, text  # noqa: E402

VOCAB_SIZE = 512                                                 # the tokenizer's; a multiple of tp for the model
CFG = reference.ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, mlp="swiglu",
                            vocab=VOCAB_SIZE, rope_theta=10000.0)
SPEC = ParallelSpec(dp=2, tp=2)                                  # 2 replicas, each Megatron TP over 2 devices
STEPS, EVERY = 150, 50                                           # the validation loss every 50 steps
OPTIM = OptimConfig(lr=1e-2, warmup=10, steps=STEPS, clip=1.0)
B, T = 16, 64                                                    # batches int32[B, T + 1]


@jax.jit
def next_token(params, window, position):
    """The most likely token after window[:position + 1] of int32[T] (causal: one compile for every length)."""
    return jnp.argmax(reference.forward(params, window[None], CFG)[0, position])   # logits [1, T, V]


def continue_greedily(params, data, prompt: str, new_tokens: int) -> str:
    ids = list(data.encode(prompt))
    for _ in range(new_tokens):
        context = ids[-T:]
        window = np.zeros(T, np.int32)
        window[:len(context)] = context
        ids.append(int(next_token(params, window, len(context) - 1)))
    return data.decode(ids)


def prepare(directory: str) -> str:
    """The help pages as one UTF-8 file, tokenized into directory/data; that path."""
    source = os.path.join(directory, "python-help.txt")
    with open(source, "w", encoding="utf-8") as file:
        file.write("\n\n".join(pydoc_data.topics.topics.values()))
    print(f"source: the help pages in {pydoc_data.topics.__file__}, {os.path.getsize(source) / 1e3:.0f} KB of text")
    out = os.path.join(directory, "data")
    meta = text.prepare([source], out, vocab_size=VOCAB_SIZE, validation=0.05, seed=0)
    print(f"  {meta['train_tokens']:,} train and {meta['validation_tokens']:,} validation tokens "
          f"({meta['dtype']}), vocab {meta['vocab_size']}")
    return out


def main():
    print(f"{len(jax.devices())} {jax.devices()[0].platform} devices\n")
    with tempfile.TemporaryDirectory() as directory:
        print("== 1: prepare the text ==")
        path = prepare(directory)

        print("\n== 2: open it memory-mapped ==")
        data = text.TokenData(path)
        text.check_vocab(data, CFG.vocab)                        # a token >= CFG.vocab would have no embedding
        first = data.batch(0, batch_size=B, seq_len=T)
        print(f"  {data}")
        print(f"  batch 0: {first.dtype}{list(first.shape)}, its first row: {data.decode(first[0])[:60]!r}...")
        same = np.array_equal(first, text.TokenData(path).batch(0, batch_size=B, seq_len=T))
        print(f"  batch 0 again, from a fresh TokenData: the same tokens: {'ok' if same else 'FAILED'}")

        print(f"\n== 3: train on {SPEC.describe()}, {STEPS} steps ==")
        trainer = Trainer(CFG, SPEC, OPTIM, batch_size=B, seq_len=T)
        state, history = fit(trainer, steps=STEPS, corpus=data, progress=False,
                             validation=Validation(every=EVERY, batches=4))   # reference.loss on the held-out tail
        losses = history.losses                                  # each step's, before its update
        print(f"  step   0: training loss {losses[0]:.3f} (log V = {np.log(data.vocab):.3f})")
        for step, val in history.validation():                   # after steps 49, 99, 149: 50, 100, 150 done
            print(f"  step {step + 1:3d}: training loss {np.mean(losses[step - 9:step + 1]):.3f} (mean of the last "
                  f"10 steps), validation loss {val:.3f}")
        falling = np.mean(losses[-10:]) < losses[0] - 1.0 and val < losses[0] - 1.0
        print(f"  training and validation losses fell by more than 1 nat from the first step's: "
              f"{'ok' if falling else 'FAILED'}")

        print("\n== 4: continue a prompt greedily ==")
        prompt = "The return value of"
        continued = continue_greedily(trainer.canonical(state)[0], data, prompt, new_tokens=40)
        print(f"  prompt {prompt!r}, 40 tokens on: {continued!r}")


if __name__ == "__main__":
    main()
