"""The `jaxpar` command: help, verify and tour in-process, errors as one line with exit 2."""

import json
import os
import subprocess
import sys

import pytest

from jaxpar import cli, tour


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "tour" in out and "verify" in out


def test_verify_help_lists_the_techniques(capsys):
    with pytest.raises(SystemExit):
        cli.main(["verify", "--help"])
    out = capsys.readouterr().out
    for name in ("reference", "comms", "tp", "pp"):
        assert name in out


def test_python_dash_m_jaxpar_help():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jaxpar", "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "usage: jaxpar" in proc.stdout and "tour" in proc.stdout and "verify" in proc.stdout


def test_verify_unknown_technique_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "warp-drive"])
    assert e.value.code == 2
    assert "invalid choice: 'warp-drive'" in capsys.readouterr().err


def test_verify_comms_json(capsys):
    assert cli.main(["verify", "comms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    assert set(rows[0]) == {"technique", "mesh", "max_error", "collectives", "seconds", "ok", "note"}
    assert rows[0]["ok"] is True and rows[0]["mesh"] == "dp=8"


@pytest.mark.slow
def test_verify_reference_and_tour_return_0(capsys):
    # conftest.py started 8 CPU devices: the CLI's use_cpu_devices(8) finds them running.
    assert cli.main(["verify", "reference"]) == 0
    out = capsys.readouterr().out
    assert "reference attention (GQA) vs jax.nn" in out and "NO" not in out
    assert cli.main(["tour", "--only", "reference", "comms"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxpar tour on 8 cpu device(s)")
    assert "reference MoE (dense) vs per-token loop" in out and "comms: hand-built program" in out


def test_a_failing_check_gives_exit_status_1(monkeypatch, capsys):
    bad = tour.Row(technique="broken", mesh="-", max_error=1.0, collectives="-", seconds=0.1, ok=False)
    monkeypatch.setattr(tour, "run_checks", lambda names=None: [bad])
    assert cli.main(["tour"]) == 1
    assert "NO" in capsys.readouterr().out


def _assert_one_line_error(capsys, command, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"jaxpar {command}: error: ")
    for word in words:
        assert word in err


def test_unknown_tour_check_is_one_line_and_exit_2(capsys):
    assert cli.main(["tour", "--only", "warp-drive"]) == 2
    _assert_one_line_error(capsys, "tour", "'warp-drive'", "available:", "reference")


def test_bad_device_count_is_one_line_and_exit_2(capsys):
    assert cli.main(["verify", "comms", "--devices", "0"]) == 2
    _assert_one_line_error(capsys, "verify", "n must be >= 1")


def test_any_value_error_is_one_line_and_exit_2(monkeypatch, capsys):
    def bad_mesh(names=None):
        raise ValueError("mesh dp=3 needs 3 devices but 8 are available; choose sizes whose product is 8")
    monkeypatch.setattr(tour, "run_checks", bad_mesh)
    assert cli.main(["verify", "tp"]) == 2
    _assert_one_line_error(capsys, "verify", "mesh dp=3 needs 3 devices")


def test_output_cut_short_by_the_reader_is_not_an_error():
    # `jaxpar schedule ... --json | head -1`: the pipe closes while jaxpar still writes.
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar", "schedule", "gpipe", "-p", "8", "-m", "256", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_schedule_steps_prints_the_runtime_steps(capsys):
    assert cli.main(["schedule", "1f1b", "-p", "4", "-m", "6", "--steps"]) == 0
    out = capsys.readouterr().out
    assert "1f1b: p=4 m=6, 16 SPMD steps for 27 schedule ticks, 21 collective-permutes" in out
    assert "device 3: .    .    .    F0   B0F1 B1   F2" in out
