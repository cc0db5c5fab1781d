"""The `jaxpar` command: help, verify and tour in-process, errors as one line with exit 2."""

import json
import os
import subprocess
import sys

import pytest

from jaxpar.cli import tour
from jaxpar.cli.main import main
from jaxpar.errors import ConfigError
from jaxpar.testing import Result


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "tour" in out and "verify" in out


def test_verify_help_lists_the_techniques(capsys):
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
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
        main(["verify", "warp-drive"])
    assert e.value.code == 2
    assert "invalid choice: 'warp-drive'" in capsys.readouterr().err


def test_verify_comms_json(capsys):
    assert main(["verify", "comms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    assert set(rows[0]) == {"name", "mesh", "errors", "tolerance", "measured", "expected", "collectives_match",
                            "passed", "skipped", "seconds", "note"}
    assert rows[0]["passed"] is True and rows[0]["mesh"] == "dp=8" and rows[0]["collectives_match"] is True
    assert rows[0]["measured"]["program"]["collective-permute"] == {"count": 5, "bytes": 5 * 8 * 16 * 4}
    assert rows[0]["measured"] == rows[0]["expected"]


def test_verify_on_one_device_skips_what_needs_more():
    # its own process: the session's JAX has 8 devices; the pipeline half of ZeRO-3 vs PP needs 2
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = os.environ | {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "jaxpar", "verify", "dp", "--devices", "1", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    assert all(r["passed"] for r in rows) and rows[-1]["mesh"] == "dp=1"
    assert "pipeline half skipped: needs 2 devices, this machine has 1" in rows[-1]["note"]


@pytest.mark.slow
def test_verify_reference_and_tour_return_0(capsys):
    # conftest.py started 8 CPU devices: the CLI's use_cpu_devices(8) finds them running.
    assert main(["verify", "reference"]) == 0
    out = capsys.readouterr().out
    assert "reference attention (GQA) vs jax.nn" in out and "NO" not in out
    assert main(["tour", "--only", "reference", "comms"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("jaxpar tour on 8 cpu device(s)")
    assert "reference MoE (dense) vs per-token loop" in out and "comms: hand-built program" in out


def test_a_failing_check_gives_exit_status_1(monkeypatch, capsys):
    bad = Result(name="broken", errors={"y": 1.0}, seconds=0.1, passed=False)
    monkeypatch.setattr(tour, "run_checks", lambda names=None: [bad])
    assert main(["tour"]) == 1
    assert "NO" in capsys.readouterr().out


def _assert_one_line_error(capsys, command, *words):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"jaxpar {command}: error: ")
    for word in words:
        assert word in err


def test_unknown_tour_check_is_one_line_and_exit_2(capsys):
    assert main(["tour", "--only", "warp-drive"]) == 2
    _assert_one_line_error(capsys, "tour", "'warp-drive'", "available:", "reference")


def test_bad_device_count_is_one_line_and_exit_2(capsys):
    assert main(["verify", "comms", "--devices", "0"]) == 2
    _assert_one_line_error(capsys, "verify", "--devices 0: give 1 to 65536 devices")


def test_a_config_error_is_one_line_and_exit_2(monkeypatch, capsys):
    def bad_mesh(names=None):
        raise ConfigError("mesh dp=3 needs 3 devices but 8 are available; choose sizes whose product is 8\nmore")
    monkeypatch.setattr(tour, "run_checks", bad_mesh)
    assert main(["verify", "tp"]) == 2
    _assert_one_line_error(capsys, "verify", "mesh dp=3 needs 3 devices")


def test_any_other_error_keeps_its_traceback(monkeypatch):
    # a ValueError that is not a refusal (a bug inside jnp, say) is not swallowed into one line
    def bug(names=None):
        raise ValueError("incompatible shapes for broadcasting")
    monkeypatch.setattr(tour, "run_checks", bug)
    with pytest.raises(ValueError, match="incompatible shapes"):
        main(["verify", "tp"])


def test_library_messages_speak_python_and_the_cli_speaks_flags(capsys):
    from jaxpar.schedules import schedule
    with pytest.raises(ConfigError) as e:
        schedule.make("dualpipe-v", 4, 4)
    assert "use microbatches=7 or more" in str(e.value) and "-m" not in str(e.value)
    assert main(["schedule", "dualpipe-v", "-p", "4", "-m", "4"]) == 2
    _assert_one_line_error(capsys, "schedule", "use -m 7 or more", "-m 4 < 7 for -p 4")


def test_the_pipeline_size_is_pp_in_every_command(capsys):
    """jaxpar schedule -p is --pp, as jaxpar memory's --pp and jaxpar train's --mesh pp=."""
    outputs = []
    for flag in ("-p", "--pp"):
        assert main(["schedule", "1f1b", flag, "4", "-m", "8"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "p=4" in outputs[0]
    with pytest.raises(SystemExit):
        main(["schedule", "1f1b", "--stages", "4"])       # a retired word, on purpose


@pytest.mark.parametrize("argv, words", [
    (["schedule", "--all", "-p", "0"], ["-p 0: need at least 1"]),
    (["schedule", "--all", "-m", "0"], ["-m 0: need at least 1"]),
    (["schedule", "--all", "-v", "0"], ["-v 0: need at least 1"]),
    (["schedule", "1f1b", "-p", "999999999", "-m", "1"], ["-p 999999999 is more than 1,024"]),
    (["schedule", "1f1b", "-p", "512", "-m", "60000"], ["actions, more than"]),
    (["schedule", "1f1b", "--trace", "no_such_dir/t.json"], ["--trace 'no_such_dir/t.json'", "does not exist"]),
    (["schedule", "1f1b", "--png", "no_such_dir/t.png"], ["--png 'no_such_dir/t.png'", "does not exist"]),
    (["schedule", "1f1b", "--costs", "F=x"], ["write kind=ticks pairs"]),
    (["schedule", "1f1b", "--costs", "W=1"], ["W exists only with the split backward"]),
    (["schedule"], ["give a schedule NAME"]),
    (["schedule", "warp"], ["unknown schedule 'warp'"]),
    # whole ticks of a microsecond each would build a table of millions of ticks
    (["schedule", "zb-h1", "-p", "8", "-m", "24", "--costs", "F=18522,B=18086,W=9337"],
     ["spans 1,293,577 ticks", "more than the 8,388,608", "with fractions"]),
    (["schedule", "1f1b", "--costs", "F=1000000000000,B=2"], ["cells, more than"]),
])
def test_schedule_refusals_are_one_line_and_exit_2(capsys, argv, words):
    assert main(argv) == 2
    _assert_one_line_error(capsys, "schedule", *words)


def test_schedule_never_imports_jax():
    code = ("import sys; from jaxpar.cli.main import main; main(['schedule', '1f1b', '--steps']); "
            "main(['schedule', '--all']); from jaxpar.pipeline import formulas, plan; from jaxpar.schedules import schedule, viz; "
            "schedule.make('dualpipe-v', 4, 8); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'chex', 'optax')); "
            "print('loaded:', bad)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("loaded: []"), proc.stdout[-300:]


def test_output_cut_short_by_the_reader_is_not_an_error():
    # `jaxpar schedule ... --json | head -1`: the pipe closes while jaxpar still writes.
    proc = subprocess.Popen([sys.executable, "-m", "jaxpar", "schedule", "gpipe", "-p", "8", "-m", "256", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err


def test_schedule_steps_prints_the_runtime_steps(capsys):
    assert main(["schedule", "1f1b", "-p", "4", "-m", "6", "--steps"]) == 0
    out = capsys.readouterr().out
    assert "1f1b: p=4 m=6, 16 SPMD steps for 27 schedule ticks, 21 collective-permutes" in out
    assert "device 3: .    .    .    F0   B0F1 B1   F2" in out


@pytest.mark.parametrize("argv, command, words", [
    (["train", "--steps", "2.5"], "train", ["argument --steps: invalid int value: '2.5'", "see jaxpar train --help"]),
    (["memory", "--recompute", "dots"], "memory", ["invalid choice: 'dots'"]),
    (["exercise", "9"], "exercise", ["invalid choice: 9"]),
    (["data", "prepare"], "data prepare", ["the following arguments are required: TEXT_FILES, --out"]),
    (["checkpoint", "ls"], "checkpoint ls", ["required: DIR"]),
])
def test_argparse_refusals_are_one_line_too(capsys, argv, command, words):
    """A flag's type, an unknown choice, a missing argument: one line and exit 2, without
    argparse's usage block."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    _assert_one_line_error(capsys, command, *words)


def test_flags_in_messages_leave_the_users_own_text_alone():
    """translate rewrites the library's name=value into flags, a run of mesh axes into one
    --mesh value, and never the quoted text the user typed."""
    from jaxpar.cli.flags import translate
    from jaxpar.cli.train_args import FLAGS

    assert translate("--mesh 'dp=-2': 'dp=-2' is not axis=size, e.g. dp=2,pp=2,tp=2", FLAGS) == \
        "--mesh 'dp=-2': 'dp=-2' is not axis=size, e.g. --mesh dp=2,pp=2,tp=2"
    assert translate("microbatches=7 is not divisible by pp=2", FLAGS) == "--microbatches 7 is not divisible by --mesh pp 2"
    assert translate("resume=1: give directory= too", FLAGS) == "--resume 1: give --checkpoint too"
    assert translate("trace='a=b.json' does not exist", {"trace": "--trace"}) == "--trace 'a=b.json' does not exist"
