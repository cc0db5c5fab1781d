"""jaxpar.tour: the table, the registry that skips techniques not built yet, clear errors."""

import sys
import textwrap

import pytest

from jaxpar import tour
from jaxpar.tour import Row


def _row(**kw):
    base = dict(technique="TP block", mesh="dp=2 tp=4", max_error=1.5e-6, collectives="2 AR 64.0 KiB = formula",
                seconds=0.5, ok=True)
    return Row(**(base | kw))


def test_format_table_aligns_columns_and_formats_figures():
    table = tour.format_table([_row(), _row(technique="ring attention (zigzag)", mesh="cp=8", max_error=3e-12,
                                            collectives="7 CP 16.0 KiB", seconds=12.25, ok=False, note="x64")])
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
    assert "1.5e-06" in first and "0.5s" in first and first.rstrip().endswith("yes")
    assert "3.0e-12" in second and "12.2s" in second and "NO" in second and second.endswith("x64")
    assert all(line == line.rstrip() for line in lines)


def test_format_table_of_no_rows_is_the_header():
    lines = tour.format_table([]).splitlines()
    assert lines[0].split() == ["technique", "mesh", "max", "error", "collectives", "time", "ok", "note"]
    assert len(lines) == 2


def test_available_skips_modules_not_built_yet(monkeypatch):
    monkeypatch.setattr(tour, "CHECKS", {"ghost": "jaxpar.nonexistent:tour_check",
                                         "ghost-pkg": "jaxpar.nonexistent_pkg.sub:tour_check",
                                         "comms": "jaxpar.comms:tour_check"})
    found = tour.available()
    assert list(found) == ["comms"]
    from jaxpar import comms
    assert found["comms"] is comms.tour_check


def test_available_does_not_hide_a_broken_import(monkeypatch, tmp_path):
    # A module that exists but imports something missing is a bug to show, not a technique to skip.
    (tmp_path / "jaxpar_fake_broken.py").write_text("import jaxpar_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tour, "CHECKS", {"broken": "jaxpar_fake_broken:tour_check"})
    with pytest.raises(ModuleNotFoundError, match="jaxpar_missing_dependency_xyz"):
        tour.available()
    sys.modules.pop("jaxpar_fake_broken", None)


@pytest.fixture
def fake_checks(monkeypatch, tmp_path):
    (tmp_path / "jaxpar_fake_checks.py").write_text(textwrap.dedent("""
        from jaxpar.tour import Row
        calls = []
        def one():
            calls.append("one")
            return Row(technique="one", mesh="-", max_error=0.0, collectives="-", seconds=0.0, ok=True)
        def two():
            calls.append("two")
            return [Row(technique="two-a", mesh="-", max_error=0.0, collectives="-", seconds=0.0, ok=True),
                    Row(technique="two-b", mesh="-", max_error=1.0, collectives="-", seconds=7.0, ok=False)]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tour, "CHECKS", {"one": "jaxpar_fake_checks:one", "two": "jaxpar_fake_checks:two",
                                         "later": "jaxpar.nonexistent:tour_check"})
    import jaxpar_fake_checks
    yield jaxpar_fake_checks
    sys.modules.pop("jaxpar_fake_checks", None)


def test_run_checks_runs_all_available_in_order_and_times_untimed_rows(fake_checks):
    rows = tour.run_checks()
    assert [r.technique for r in rows] == ["one", "two-a", "two-b"]
    assert fake_checks.calls == ["one", "two"]
    assert rows[0].seconds > 0 and rows[1].seconds > 0
    assert rows[2].seconds == 7.0  # a check that timed itself keeps its time


def test_run_checks_named_subset(fake_checks):
    assert [r.technique for r in tour.run_checks(["two"])] == ["two-a", "two-b"]
    assert fake_checks.calls == ["two"]


def test_run_checks_unknown_name_lists_the_available_ones(fake_checks):
    with pytest.raises(ValueError) as e:
        tour.run_checks(["later"])
    assert "'later'" in str(e.value)
    assert "available: one, two" in str(e.value)


def test_run_checks_rejects_a_bad_name_before_running_anything(fake_checks):
    with pytest.raises(ValueError):
        tour.run_checks(["one", "later"])
    assert fake_checks.calls == []


def test_registry_targets_are_module_colon_function():
    for name, target in tour.CHECKS.items():
        module, _, func = target.partition(":")
        assert module.startswith("jaxpar.") and func.isidentifier(), name


def test_available_reports_a_missing_check_function(monkeypatch):
    monkeypatch.setattr(tour, "CHECKS", {"comms": "jaxpar.comms:no_such_check"})
    with pytest.raises(AttributeError, match="no_such_check"):
        tour.available()


def test_a_check_that_raises_becomes_a_failed_row_and_the_others_still_run(monkeypatch, tmp_path):
    (tmp_path / "jaxpar_fake_raising.py").write_text(textwrap.dedent("""
        from jaxpar.tour import Row
        def broken():
            raise RuntimeError("boom\\nsecond line")
        def fine():
            return Row(technique="fine", mesh="-", max_error=0.0, collectives="-", seconds=0.0, ok=True)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tour, "CHECKS", {"broken": "jaxpar_fake_raising:broken", "fine": "jaxpar_fake_raising:fine"})
    rows = tour.run_checks()
    sys.modules.pop("jaxpar_fake_raising", None)
    assert [r.technique for r in rows] == ["broken: check raised", "fine"]
    assert not rows[0].ok and rows[0].note == "RuntimeError: boom" and rows[1].ok
