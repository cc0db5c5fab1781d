"""jaxpar.testing: the precision policy, and the row of a check the machine has too few
devices for, from the checks that build meshes (run here on fewer of the session's 8)."""

import jax
import jax.numpy as jnp
import pytest

from jaxpar import testing


def test_precision_policy_asks_for_float32_matmuls_and_restores_the_setting():
    with jax.default_matmul_precision("bfloat16"):
        with testing.precision_policy():
            assert jax.config.jax_default_matmul_precision == "highest"
            hlo = jax.jit(lambda a: a @ a).lower(jnp.ones((2, 2))).as_text()
        assert jax.config.jax_default_matmul_precision == "bfloat16"
        with pytest.raises(RuntimeError), testing.precision_policy():
            raise RuntimeError("a check that fails")
        assert jax.config.jax_default_matmul_precision == "bfloat16"
    assert "precision = [HIGHEST, HIGHEST]" in hlo


def test_skipped_says_why_and_passes():
    r = testing.skipped("MoE load imbalance", needs=4, have=2, mesh="ep=4")
    assert r.passed and r.skipped and r.mesh == "ep=4"
    assert r.note == "skipped: needs 4 devices, this machine has 2"
    assert r.to_json()["skipped"] is True and testing.Result(name="x", passed=True).to_json()["skipped"] is False


@pytest.fixture
def devices(monkeypatch):
    """devices(n): the checks (and jaxpar.mesh) see the first n of the session's devices."""
    every = jax.devices()

    def use(n):
        monkeypatch.setattr(jax, "devices", lambda backend=None: every[:n])
    return use


def test_checks_on_too_few_devices_return_skipped_rows(devices):
    from jaxpar import verify
    from jaxpar.expert import verify as expert
    from jaxpar.memory import verify as memory
    from jaxpar.train import verify as train

    devices(1)
    assert verify.check_comms().skipped
    assert memory.check_pipeline_memory()[0].note == "skipped: needs 2 devices, this machine has 1"
    devices(2)
    assert expert.check_imbalance().note == "skipped: needs 4 devices, this machine has 2"
    (tp4,) = memory.check_memory(cases=[("TP t=4", 4, False, "none")])
    assert tp4.skipped and tp4.mesh == "tp=4"
    rows = train.check_train()
    assert [r.name for r in rows] == [f"train {train.MESHES[n][0].describe()}, 20 steps" for n in train.TOUR]
    assert all(r.skipped and r.passed and "needs 8 devices, this machine has 2" in r.note for r in rows)
    assert rows[0].mesh == "dp=2 pp=2 tp=2"


def test_zero3_runs_where_the_pipeline_does_not_fit(devices):
    from jaxpar.data import verify

    devices(1)
    r = verify.check_zero3_vs_pp()
    assert r.passed and not r.skipped and r.mesh == "dp=1" and set(r.measured) == {"ZeRO-3"}
    assert r.measured["ZeRO-3"] == r.expected["ZeRO-3"] == {}
    assert "pipeline half skipped: needs 2 devices, this machine has 1" in r.note
