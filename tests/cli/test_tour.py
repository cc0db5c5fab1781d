"""jaxpar.cli.tour: the explicit registry of what exists, the table and the JSON of Results."""

import json
import sys
import textwrap

import jax
import pytest

from jaxpar.cli import tour
from jaxpar.comms import Collectives
from jaxpar.errors import ConfigError
from jaxpar.testing import Result, skipped

AR = Collectives({"all-reduce": (2, 65536)})


def _result(**kw):
    base = dict(name="TP block", mesh="dp=2 tp=4", errors={"y": 1.5e-6, "dx": 1e-7}, tolerance=(2e-5, 2e-6),
                measured={"step": AR}, expected={"step": AR}, seconds=0.5, passed=True)
    return Result(**(base | kw))


def test_format_table_aligns_columns_and_formats_figures():
    table = tour.format_table([_result(), _result(name="ring attention (zigzag)", mesh="cp=8",
                                                  errors={"out": 3e-12}, measured={"step": Collectives(
                                                      {"collective-permute": (7, 16384)})},
                                                  expected=None, seconds=12.25, passed=False, note="x64")])
    lines = table.splitlines()
    assert len(lines) == 4
    header, rule, first, second = lines
    assert header.split() == ["technique", "mesh", "max", "error", "collectives", "time", "ok", "note"]
    assert set(rule.replace(" ", "")) == {"-"}
    # Every column starts where its header starts.
    for word in ("mesh", "max error", "collectives", "time", "ok"):
        col = header.index(word)
        assert first[col - 1] == " " and first[col] != " ", word
    width = len("ring attention (zigzag)")
    assert first[:width + 2] == "TP block".ljust(width + 2)
    assert "1.5e-06" in first and "2 AR 64.0 KiB = formula" in first and "0.5s" in first
    assert first.rstrip().endswith("yes")
    assert "3.0e-12" in second and "7 CP 16.0 KiB" in second and "formula" not in second
    assert "12.2s" in second and "NO" in second and second.endswith("x64")
    assert all(line == line.rstrip() for line in lines)


def test_format_table_says_when_collectives_differ_and_when_nothing_was_compared():
    r = _result(expected={"step": Collectives({"all-reduce": (3, 65536)})}, passed=False)
    assert "2 AR 64.0 KiB != formula 3 AR 64.0 KiB" in tour.format_table([r])
    two = _result(measured={"fwd": AR, "bwd": AR + AR}, expected={"fwd": AR, "bwd": AR + AR})
    assert "fwd 2 AR 64.0 KiB | bwd 4 AR 128.0 KiB = formula" in tour.format_table([two])
    row = tour.format_table([Result(name="schedule", passed=True)]).splitlines()[2]
    assert row.split()[1:4] == ["-", "-", "-"]


def test_format_table_says_skip_for_a_row_the_machine_has_too_few_devices_for():
    row = tour.format_table([skipped("MoE load imbalance", needs=4, have=2, mesh="ep=4")]).splitlines()[2]
    assert row.split()[3:9] == ["ep=4", "-", "-", "-", "skip", "skipped:"]
    assert row.endswith("skipped: needs 4 devices, this machine has 2")


def test_format_table_of_no_results_is_the_header():
    lines = tour.format_table([]).splitlines()
    assert lines[0].split() == ["technique", "mesh", "max", "error", "collectives", "time", "ok", "note"]
    assert len(lines) == 2


def test_json_is_structured_data():
    (d,) = json.loads(tour.format_json([_result()]))
    assert d["errors"] == {"y": 1.5e-6, "dx": 1e-7}
    assert d["tolerance"] == {"rtol": 2e-5, "atol": 2e-6}
    assert d["measured"] == d["expected"] == {"step": {"all-reduce": {"count": 2, "bytes": 65536}}}
    assert d["collectives_match"] is True and d["passed"] is True and d["mesh"] == "dp=2 tp=4"


def test_registry_lists_exactly_what_exists():
    # every entry is a module:function that imports and is callable; nothing is advertised that is not built
    for name, target in tour.CHECKS.items():
        module, _, func = target.partition(":")
        assert module.startswith("jaxpar.") and module.endswith("verify") and func.isidentifier(), name
        assert callable(tour.load(name)), name
    assert list(tour.CHECKS) == ["reference", "comms", "dp", "schedule", "pp", "tp", "sp", "cp", "ulysses", "ep",
                                 "pp-tp", "memory", "plan", "train"]


@pytest.fixture
def fake_checks(monkeypatch, tmp_path):
    (tmp_path / "jaxpar_fake_checks.py").write_text(textwrap.dedent("""
        import jax
        from jaxpar.testing import Result, skipped
        calls = []
        def one():
            calls.append("one")
            return Result(name="one", passed=True, note=str(jax.config.jax_default_matmul_precision))
        def two():
            calls.append("two")
            return [Result(name="two-a", passed=True),
                    Result(name="two-b", errors={"e": 1.0}, seconds=7.0, passed=False),
                    skipped("two-c", needs=16, have=8)]
        def broken():
            calls.append("broken")
            raise RuntimeError("boom\\nsecond line")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tour, "CHECKS", {"one": "jaxpar_fake_checks:one", "two": "jaxpar_fake_checks:two",
                                         "broken": "jaxpar_fake_checks:broken"})
    import jaxpar_fake_checks
    yield jaxpar_fake_checks
    sys.modules.pop("jaxpar_fake_checks", None)


def test_run_checks_runs_all_in_order_and_times_untimed_results(fake_checks):
    results = tour.run_checks(["one", "two"])
    assert [r.name for r in results] == ["one", "two-a", "two-b", "two-c"]
    assert fake_checks.calls == ["one", "two"]
    assert results[0].seconds > 0 and results[1].seconds > 0
    assert results[2].seconds == 7.0  # a check that timed itself keeps its time
    assert results[3].seconds == 0.0  # a skipped one ran nothing


def test_run_checks_runs_each_check_under_the_precision_policy(fake_checks):
    with jax.default_matmul_precision("bfloat16"):
        (one,) = tour.run_checks(["one"])
        assert jax.config.jax_default_matmul_precision == "bfloat16"
    assert one.note == "highest"


def test_run_checks_unknown_name_lists_the_available_ones_before_running_anything(fake_checks):
    with pytest.raises(ConfigError) as e:
        tour.run_checks(["one", "later"])
    assert "'later'" in str(e.value) and "available: one, two, broken" in str(e.value)
    assert fake_checks.calls == []


def test_a_check_that_raises_becomes_a_failed_result_and_the_others_still_run(fake_checks):
    results = tour.run_checks(["broken", "one"])
    assert [r.name for r in results] == ["broken: check raised", "one"]
    assert not results[0].passed and results[0].note == "RuntimeError: boom" and results[1].passed
