"""The layering of docs/design.md ("Who may import whom"): the import-linter contracts of
pyproject.toml hold, no jaxpar import hides inside a function below cli/, and the
pure-Python parts start without JAX."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpar"


def test_import_contracts_hold():
    linter = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert linter, "import-linter is a test dependency (pyproject.toml [test])"
    proc = subprocess.run([linter, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _late_jaxpar_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "jaxpar" or n.startswith("jaxpar.") for n in names):
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_jaxpar_import_inside_a_function_below_cli():
    modules = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts]
    assert len(modules) > 20
    late = [hit for p in modules for hit in _late_jaxpar_imports(p)]
    assert late == [], late


def test_the_scan_finds_a_late_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import jaxpar.mesh\n\ndef f():\n    from jaxpar import mesh\n    import jaxpar.comms\n"
                   "    import numpy\n    return mesh\n")
    assert _late_jaxpar_imports(bad) == ["bad.py:4", "bad.py:5"]


@pytest.mark.parametrize("module", ["jaxpar.schedules.schedule", "jaxpar.pipeline.formulas", "jaxpar.pipeline.plan",
                                    "jaxpar.schedules.timing", "jaxpar.schedules.published", "jaxpar.schedules.search",
                                    "jaxpar.schedules.interchange", "jaxpar.cli.schedule",
                                    "jaxpar.pipeline.stage_layers",
                                    "jaxpar.tensor.formulas", "jaxpar.context.formulas", "jaxpar.context.zigzag",
                                    "jaxpar.expert.formulas", "jaxpar.data.formulas", "jaxpar.memory.activations", "jaxpar.memory.states",
                                    "jaxpar.planner.search", "jaxpar.planner.exercises", "jaxpar.cli.plan",
                                    "jaxpar.comms", "jaxpar.errors", "jaxpar.lazy", "jaxpar.cli.main"])
def test_pure_python_parts_start_without_jax(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'chex', 'optax')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", (module, proc.stdout)
