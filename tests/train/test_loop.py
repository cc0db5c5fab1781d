"""train.loop.fit: the progress line, validation losses against the reference, each
process's rows of a batch, the profile, and the refusals."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import reference
from jaxpar.errors import ConfigError
from jaxpar.train import loop, verify
from jaxpar.train.data import Corpus
from jaxpar.train.loop import Profiling, Validation, fit
from jaxpar.train.step import Trainer

# the checkpoint tests' request: the same compiled step
SPEC, CFG, BATCH = verify.MESHES["dp2 pp2 tp2"]
T = 16


@pytest.fixture(scope="module")
def trainer():
    return Trainer(CFG, SPEC, verify.OPTIM, batch_size=BATCH, seq_len=T)


class RecordingCorpus(Corpus):
    """The generated corpus, noting the rows each read asks for."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "asked", [])

    def batch(self, step, *, batch_size, seq_len, rows=None):
        self.asked.append(("batch", step, rows))
        return super().batch(step, batch_size=batch_size, seq_len=seq_len, rows=rows)

    def validation_batch(self, k, *, batch_size, seq_len, rows=None):
        self.asked.append(("validation", k, rows))
        return super().validation_batch(k, batch_size=batch_size, seq_len=seq_len, rows=rows)


@jax.jit
def _reference_loss(params, tokens):
    return reference.loss(params, tokens, CFG)


def test_validation_losses_are_the_reference_models_on_held_out_batches(trainer, tmp_path, capsys):
    """eval_every=2 over 5 steps: measured after steps 1, 3 and the last (4), each the
    mean of reference.loss over validation batches 0 and 1 of the weights then; in the
    log's rows and on the progress line (stderr), with tokens/s, ms/step and MFU (n/a on
    CPU: no peak is known)."""
    corpus = RecordingCorpus(vocab=CFG.vocab)
    state, history = fit(trainer, steps=5, corpus=corpus, validation=Validation(every=2, batches=2), log=str(tmp_path / "l"))
    assert [s for s, _ in history.validation()] == [1, 3, 4]
    assert [k for kind, k, _ in corpus.asked if kind == "validation"] == [0, 1] * 3
    assert all(rows is None for _, _, rows in corpus.asked)         # one process: it reads whole batches
    params, _, _ = trainer.canonical(state)
    held_out = [corpus.validation_batch(k, batch_size=BATCH, seq_len=T) for k in range(2)]
    expected = np.mean([float(_reference_loss(jax.device_get(params), jnp.asarray(b))) for b in held_out])
    assert history.validation()[-1][1] == pytest.approx(expected, rel=1e-6)
    rows = [json.loads(line) for line in (tmp_path / "l").read_text().splitlines()]
    assert rows == history.rows() and [("val_loss" in r) for r in rows] == [False, True, False, True, True]
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("step 5/5 |") and f"loss {history.losses[-1]:.4f}" in last, last
    assert f"val {history.validation()[-1][1]:.4f}" in last and "tok/s" in last and "ms/step" in last, last
    assert last.endswith("MFU n/a"), last


def test_no_progress_line_when_off_and_no_val_loss_without_eval(trainer, capsys):
    _, history = fit(trainer, steps=2, progress=False)
    assert capsys.readouterr().err == ""
    assert history.validation() == [] and set(history.row(-1)) == {"step", "loss", "grad_norm", "lr", "seconds"}


def test_the_global_batch_is_the_corpus_batch_split_by_rows(trainer):
    corpus = Corpus(vocab=CFG.vocab)
    batch = loop.global_batch(trainer, functools.partial(corpus.batch, 3, batch_size=BATCH, seq_len=T))
    assert batch.sharding == trainer.token_sharding == NamedSharding(trainer.mesh, P("dp"))   # as the step takes it
    assert {s.data.shape for s in batch.addressable_shards} == {(BATCH // 2, T + 1)}         # each device its rows
    np.testing.assert_array_equal(np.asarray(batch), corpus.batch(3, batch_size=BATCH, seq_len=T))


class _OneProcessOfTwo:
    """A sharding's view from process 1 of 2 on a dp=4 mesh: it holds rows 4..7 of 8."""

    def addressable_devices_indices_map(self, shape):
        return {f"device {d}": (slice(2 * d, 2 * d + 2), slice(None)) for d in (2, 3)}


def test_a_process_reads_only_its_own_rows():
    assert loop.local_rows(_OneProcessOfTwo(), (8, 17)) == slice(4, 8)


def test_profile_traces_steps_after_the_first(trainer, tmp_path):
    _, history = fit(trainer, steps=4, progress=False, profiling=Profiling(str(tmp_path / "trace"), steps=2))
    assert history.profile["steps"] == [1, 2] and history.profile["file"].endswith(".xplane.pb")
    measured = loop.throughput.collective_time(history.profile["file"], trainer.compiled.as_text())
    assert measured is not None and 0 < measured["fraction"] < 1


def test_refusals(trainer):
    class NoValidation:
        def batch(self, step, *, batch_size, seq_len, rows=None):
            return np.zeros((batch_size, seq_len + 1), np.int32)
    with pytest.raises(ConfigError, match="has no validation_batch"):
        fit(trainer, steps=1, corpus=NoValidation(), validation=Validation(every=1), progress=False)
    with pytest.raises(ConfigError, match="eval_every=0"):
        fit(trainer, steps=1, validation=Validation(every=0), progress=False)

    class TooLarge(NoValidation):
        def batch(self, step, *, batch_size, seq_len, rows=None):
            return np.full((batch_size, seq_len + 1), CFG.vocab, np.int32)
    with pytest.raises(ConfigError, match=rf"token ids in \[{CFG.vocab}, {CFG.vocab}\]"):
        fit(trainer, steps=1, corpus=TooLarge(), progress=False)


def test_a_step_that_cannot_fit_is_refused_before_a_weight_exists(trainer, monkeypatch):
    """budget.check compares the compiled step's memory (arguments + outputs + temporaries -
    donated) with what a device has, before init: here a device of half what the step needs."""
    from jaxpar.comms import human_bytes
    from jaxpar.train import budget

    m = trainer.compiled.memory_analysis()
    need = budget.step_bytes(trainer.compiled)
    assert need == m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert 0 < need and budget.device_bytes(jax.devices()[0]) > need      # a CPU device: its share of the host

    def no_init(*a, **k):
        raise AssertionError("init ran")
    monkeypatch.setattr(budget, "device_bytes", lambda device: need // 2)
    monkeypatch.setattr(trainer, "init", no_init)
    with pytest.raises(ConfigError, match=rf"the step needs {human_bytes(need)} per device .* more than the "
                                          rf"{human_bytes(need // 2)} a cpu device has here; fix: a smaller model"):
        fit(trainer, steps=1, progress=False)
