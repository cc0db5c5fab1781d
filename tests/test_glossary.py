"""The glossary (docs/design.md, "Glossary") held by the code: each word there means one
thing, so the words it retired must not come back. RETIRED lists them, each as a pattern,
the word that replaced it and a line that says the retired word; the test greps the
package, the tests, the examples, the benchmarks, the docs and the README, and names every
file:line that still says one."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEARCHED = ("jaxpar", "tests", "examples", "benchmarks", "docs", "README.md")
SUFFIXES = (".py", ".md")

# Names ending in _spec(s) that are JAX's (shard_map's in_specs / out_specs,
# nnx.get_partition_spec) or Python's (importlib's find_spec, module_from_spec) own.
FOREIGN_SPECS = r"(?:in_specs|out_specs|get_partition_spec|find_spec|module_from_spec)\b"
# A line that says a retired word to test that it is refused or read as its replacement.
ON_PURPOSE = "# a retired word, on purpose"

# (retired pattern, the word that replaced it, a line that says the retired word)
RETIRED = [
    (rf"\b(?!{FOREIGN_SPECS})[a-z]\w*_specs?\b", "*_pspec(s): a PartitionSpec is a pspec, a spec a ParallelSpec",
     "fn(param_specs=layer_pspecs, batch_spec=P('dp'))"),
    (r"\bVjpLayout\b", "VjpTemplate: `layout` is the token order over cp only", "template: VjpLayout"),
    (r"\bgrouped\.layout\(|^def layout\(", "grouped.block_slots: `layout` is the token order over cp only",
     "def layout(experts, n_experts: int, block: int):"),
    (r"(?<![-\w])permute=", "relayout=, in ring and hybrid attention alike",
     "ring_attention(q, k, v, mesh=m, permute=False)"),
    (r"\b(?:plan|pl|Plan)\.sends\b", "Plan.channels: a channel is a (lane, direction), a send one of Schedule.sends",
     "for j, ch in enumerate(plan.sends):"),
    (r"\.transfers\b|\bTransfer\b", "Plan.n_sends, plan.Send: a device's output moving to a neighbour is a send",
     "assert plan.transfers == 4"),
    (r"--stages\b", "--pp (-p): the pipeline size is pp in every command", "jaxpar schedule 1f1b --stages 4"),
    (r"\[(?:p|pp), v, |\[v, L(?:c|max)\b|\[p\]\[v\]", "[p, chunks, Lc, ...]: the letter v in closed forms only",
     "params [v, Lc, ...]"),
    (r"\bv chunks\b|\bp\*v model stages\b", "chunks: the letter v in closed forms only", "with v chunks per device"),
    (r"\brecompute=(?:True|False)\b|\brecompute is True\b", 'recompute="full" or "none"',
     "ParallelSpec(recompute=True)"),
    (r"--recompute(?: |=)all\b|\[all\\?\|dots\]", "--recompute full|dots", "jaxpar train --recompute all"),
]

# Lines that say what stays: JAX's and Python's own words, the new words, closed forms.
KEPT = [f"ParallelSpec(recompute=True)   {ON_PURPOSE}", "jax.shard_map(f, mesh=m, in_specs=(P('dp'),), out_specs=P())", "nnx.get_partition_spec(state)",
        "ring_attention(q, k, v, mesh=m, relayout=False)", "params [p, chunks, Lc, ...]", "a collective-permute=3",
        'ParallelSpec(recompute="full")', "x_pspec = P()", "len(s.sends) == 2 * m * (p - 1)",
        "bubble (p-1)/(vm+p-1)", "interleaved 1F1B (p=4, m=8, v=2)", "jaxpar schedule 1f1b -p 4 --pp 4"]


def _files():
    for name in SEARCHED:
        path = ROOT / name
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.suffix in SUFFIXES and f.is_file() and f.resolve() != pathlib.Path(__file__).resolve():
                yield f


def found(pattern: str, files=None) -> list[str]:
    """"file:line: text" for every line of `files` (default: every searched file) that
    matches `pattern`; a file outside the repository is named by its name alone."""
    rx = re.compile(pattern)
    out = []
    for f in files if files is not None else _files():
        name = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if rx.search(line) and ON_PURPOSE not in line:
                out.append(f"{name}:{n}: {line.strip()[:100]}")
    return out


@pytest.mark.parametrize("pattern, replacement, _", RETIRED, ids=[r.split(":")[0] for _, r, _ in RETIRED])
def test_no_retired_word(pattern, replacement, _):
    hits = found(pattern)
    assert not hits, f"retired: {pattern!r}; say {replacement}:\n" + "\n".join(hits)


@pytest.mark.parametrize("pattern, _, line", RETIRED, ids=[r.split(":")[0] for _, r, _ in RETIRED])
def test_each_pattern_catches_its_word(tmp_path, pattern, _, line):
    """The check can fail: a file that says a retired word is named, file:line."""
    bad = tmp_path / "bad.py"
    bad.write_text(f"ok = 1\n{line}\n")
    assert found(pattern, [bad]) == [f"bad.py:2: {line}"]


@pytest.mark.parametrize("line", KEPT)
def test_the_words_that_stay_pass(tmp_path, line):
    good = tmp_path / "good.py"
    good.write_text(line + "\n")
    assert [h for pattern, _, _ in RETIRED for h in found(pattern, [good])] == []
