"""benchmarks.triton_sm90 without the triton package (as in `make test`): it says so and
exits 0; each case it would compile lowers, and its Triton modules pass MLIR's verifier."""

import sys

import pytest

from benchmarks import triton_sm90
from jaxpar.kernels import triton_ir


def test_without_triton_it_skips_and_says_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)        # import triton raises ImportError
    assert triton_sm90.main([]) == 0
    assert "skipped: the triton package is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["grouped bfloat16", "flash h128 bfloat16"])
def test_each_case_lowers_to_verified_modules(name):
    fn, args = triton_sm90.CASES[name]()
    assert len(triton_ir.modules(fn, *args)) == 3
