"""Collective accounting: what a compiled program really sends, read from its HLO.

`collective_stats(jitted_fn, *args)` compiles the jitted function for `args`, walks the
optimised HLO module and, for each collective kind, returns how many times it runs
and how many bytes it moves per execution of the program:

    {"all-reduce": {"count": 2, "bytes": 65536}, "all-gather": {...}, ...}

Counting rules (tests pin each one):
  * an op in a while loop body counts once per iteration (XLA's known_trip_count;
    `lax.scan` and `fori_loop` with static bounds always have one);
  * a conditional (lax.switch / lax.cond) counts, for each kind, the branch that moves
    the most bytes of that kind: an upper bound per kind, since the branch is chosen at
    run time. Such ops are flagged (`CollectiveOp.conditional`; `in_conditional` in the
    stats), so a test of "measured == formula" can tell an estimate from a count;
  * async pairs (`all-gather-start` / `-done`) count once; combined (tuple) collectives
    count once with the bytes of all their operands; with split_combined=True, an
    all-reduce that XLA's combiner merged from separate JAX collectives (its op_name lists
    theirs, `prefix/(name_1:name_2:...)`, one per tuple element, or is the one name they
    all had) counts as the collectives it was, each with its own bytes and scope
    (`_split_combined`).

Bytes are the *logical* size of the collective, the same on every device, so that the
lecture's formulas read directly:
    all-reduce          size of the array reduced          (TP: B*T*D per all-reduce)
    all-gather          size of the gathered (full) array  (SP: B*T*D, as the all-reduce)
    reduce-scatter      size of the array before scatter   (SP: B*T*D)
    all-to-all          size of the array exchanged        (EP: tokens*k*D)
    collective-permute  size of the array each device sends (ring/pipeline: one block)
`wire_bytes` adds what one device sends on a ring: all-reduce 2(n-1)/n, all-gather and
reduce-scatter and all-to-all (n-1)/n of the bytes, collective-permute all of it (n is
the group size).

`Collectives` is the value both sides of "measured == formula" are: {kind: (count, bytes)}
of the kinds that occur. `nonzero(collective_stats(...))` gives the measured one; every
technique's `formulas.py` returns the expected one.

Pure Python: the HLO text comes from the jitted function's own `.lower(...).compile()`, so
the formulas that use `Collectives` (and the planner) never import JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping

from jaxpar.errors import ConfigError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
         "collective-permute": "CP", "all-to-all": "A2A"}

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _type_bytes(type_str: str) -> float:
    total = 0.0
    for dtype, dims in _ARRAY.findall(type_str):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled program."""

    kind: str            # one of KINDS
    name: str            # HLO instruction name
    computation: str     # the HLO computation holding it
    bytes: float         # logical bytes (see module docstring), per execution of the op
    group_size: int      # devices taking part in each group (2 for a permute pair)
    executions: int      # times it runs per execution of the program
    conditional: bool = False   # inside a conditional branch: counted as an upper bound
    scope: str = ""      # the op_name of its metadata: the named scopes of the JAX code

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends for one execution, on a ring."""
        n = self.group_size
        if self.kind == "collective-permute":
            return self.bytes
        factor = 2 * (n - 1) / n if self.kind == "all-reduce" else (n - 1) / n
        return self.bytes * factor


@dataclasses.dataclass
class _Instr:
    name: str
    type_str: str
    opcode: str
    rest: str


def _parse(hlo: str) -> tuple[dict[str, list[_Instr]], dict[str, dict[str, str]], str]:
    comps: dict[str, list[_Instr]] = {}
    types: dict[str, dict[str, str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            comps[current], types[current] = [], {}
            if line.startswith("ENTRY"):
                entry = current
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            name, type_str, opcode, rest = m.groups()
            comps[current].append(_Instr(name, type_str, opcode, rest))
            types[current][name] = type_str
    if entry is None:
        raise ConfigError("no ENTRY computation in the HLO text")
    return comps, types, entry


def _group_size(rest: str, partitions: int) -> int:
    m = _GROUPS_IOTA.search(rest)
    if m:
        return int(m.group(2))
    m = _GROUPS_LIST.search(rest)
    if m and m.group(1) != "{}":
        return len(m.group(1).strip("{}").split(","))
    return partitions


def _operand_bytes(instr: _Instr, types: dict[str, str]) -> float:
    # Operands are printed as "%name" (with types in some dialects): sum their sizes.
    args = instr.rest.split("),", 1)[0] if ")," in instr.rest else instr.rest.rsplit(")", 1)[0]
    inline = _type_bytes(args)
    if inline:
        return inline
    return sum(_type_bytes(types.get(n, "")) for n in re.findall(r"%([\w.\-]+)", args))


def _names(merged: str) -> list[str]:
    """'a:b(c:d):e' -> ['a', 'b(c:d)', 'e']: split at the colons outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(merged):
        depth += (ch == "(") - (ch == ")")
        if ch == ":" and depth == 0:
            out.append(merged[start:i])
            start = i + 1
    return out + [merged[start:]]


def _split_combined(op: CollectiveOp, type_str: str) -> list[CollectiveOp]:
    """A combined all-reduce as the collectives it was made of (each tuple element with its
    own bytes and op_name), when its op_name names one per element or is one name (the
    parts' common one); else [op]."""
    cut = op.scope.find("/(")
    elements = _ARRAY.findall(type_str)
    if op.kind != "all-reduce" or not type_str.startswith("(") or len(elements) < 2:
        return [op]
    if cut < 0 or not op.scope.endswith(")"):       # one name: every part was written under it
        return [dataclasses.replace(op, bytes=_type_bytes(f"{dtype}[{dims}]")) for dtype, dims in elements]
    prefix, names = op.scope[:cut + 1], _names(op.scope[cut + 2:-1])
    if len(names) != len(elements) or len(names) < 2:
        return [op]
    return [dataclasses.replace(op, bytes=_type_bytes(f"{dtype}[{dims}]"), scope=prefix + name)
            for (dtype, dims), name in zip(elements, names)]


def collective_ops_from_hlo(hlo: str, *, split_combined: bool = False,
                            every_branch: bool = False) -> list[CollectiveOp]:
    """Every collective of an optimised HLO module, with how often it runs (split_combined:
    an all-reduce XLA merged from named JAX collectives as those collectives). A
    conditional's ops are its heaviest branch's for each kind (an upper bound); with
    every_branch, every branch's, each still flagged conditional: for a caller that knows
    from the ops' scopes how often each branch runs (the trainer's pipeline lanes)."""
    comps, types, entry = _parse(hlo)
    m = _PARTITIONS.search(hlo)
    partitions = int(m.group(1)) if m else 1

    def walk(comp: str, executions: int) -> list[CollectiveOp]:
        ops: list[CollectiveOp] = []
        for instr in comps.get(comp, []):
            kind = instr.opcode.removesuffix("-start")
            if kind in KINDS:
                operand = _operand_bytes(instr, types[comp])
                n = 2 if kind == "collective-permute" else _group_size(instr.rest, partitions)
                logical = operand * n if kind == "all-gather" else operand
                scope = _OP_NAME.search(instr.rest)
                op = CollectiveOp(kind, instr.name, comp, logical, n, executions, scope=scope.group(1) if scope else "")
                ops += _split_combined(op, instr.type_str) if split_combined else [op]
            if instr.opcode == "while":
                callees = dict(_CALLS.findall(instr.rest))
                trip = _TRIP.search(instr.rest)
                body_ops = walk(callees["body"], 1)
                if body_ops and not trip:
                    raise ConfigError(
                        f"while loop {instr.name} holds collectives but has no known trip count; "
                        "use lax.scan or fori_loop with static bounds so they can be counted")
                count = int(trip.group(1)) if trip else 1
                ops += [dataclasses.replace(o, executions=o.executions * count * executions) for o in body_ops]
                continue
            if instr.opcode == "conditional":
                branches = _BRANCHES.search(instr.rest)
                names = ([b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches
                         else [c for k, c in _CALLS.findall(instr.rest) if k.endswith("_computation")])
                per_branch = [walk(b, executions) for b in names]
                if every_branch:
                    ops += [dataclasses.replace(o, conditional=True) for branch in per_branch for o in branch]
                    continue
                for kind in KINDS:
                    heaviest = max(([o for o in branch if o.kind == kind] for branch in per_branch),
                                   key=lambda os_: (sum(o.bytes * o.executions for o in os_),
                                                    sum(o.executions for o in os_)), default=[])
                    ops += [dataclasses.replace(o, conditional=True) for o in heaviest]
                continue
            if instr.opcode in ("async-update", "async-done"):
                continue  # they repeat their async-start's calls=: the op inside counts once
            for key, callee in _CALLS.findall(instr.rest):
                if key in ("calls", "to_apply") and callee in comps:
                    ops += walk(callee, executions)
        return ops

    return walk(entry, 1)


def resolve(ops: list[CollectiveOp], runs: Mapping[str, int]) -> list[CollectiveOp]:
    """Exact counts for guarded collectives: a program that wraps a collective in a
    `lax.cond` under `jax.named_scope(name)`, and knows from its static tables how many
    times per execution the predicate holds (`runs[name]`), gets those counts in place of
    the upper bound. Each name must match at least one conditional op, and a count above
    the bound the HLO allows is refused."""
    out, seen = [], set()
    for op in ops:
        names = [name for name in runs if op.conditional and f"/{name}/" in f"/{op.scope}/"]
        if len(names) > 1:
            raise ConfigError(f"collective {op.name} sits in the scopes {names}: give each guarded op one scope")
        if names:
            n = runs[names[0]]
            if n > op.executions:
                raise ConfigError(f"runs[{names[0]!r}] = {n} is more than the {op.executions} executions "
                                  f"the compiled loop allows for {op.name}")
            seen.add(names[0])
            op = dataclasses.replace(op, executions=n, conditional=False)
        out.append(op)
    missing = set(runs) - seen
    if missing:
        raise ConfigError(f"no conditional collective in the scopes {sorted(missing)}: the program does not "
                          "guard them as `runs` says")
    return out


def compiled_text(jitted_fn: Callable, *args, **kwargs) -> str:
    """Optimised HLO text of jitted_fn(*args): `jitted_fn.lower(*args).compile().as_text()`."""
    if not hasattr(jitted_fn, "lower"):
        raise ConfigError(f"{getattr(jitted_fn, '__name__', jitted_fn)!r} is not jitted: the collectives are read "
                          "from a compiled program. Fix: pass jax.jit(fn)")
    return jitted_fn.lower(*args, **kwargs).compile().as_text()


def collective_ops(jitted_fn: Callable, *args, **kwargs) -> list[CollectiveOp]:
    """The collectives of the compiled program, one entry per HLO instruction."""
    return collective_ops_from_hlo(compiled_text(jitted_fn, *args, **kwargs))


def summarize(ops: list[CollectiveOp]) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes", "wire_bytes", "in_conditional"}} for every kind in KINDS
    (zeros included); in_conditional counts the executions that are upper bounds."""
    stats = {k: {"count": 0, "bytes": 0, "wire_bytes": 0.0, "in_conditional": 0} for k in KINDS}
    for op in ops:
        s = stats[op.kind]
        s["count"] += op.executions
        s["in_conditional"] += op.executions if op.conditional else 0
        s["bytes"] += op.bytes * op.executions
        s["wire_bytes"] += op.wire_bytes * op.executions
    for s in stats.values():
        s["bytes"] = int(s["bytes"]) if float(s["bytes"]).is_integer() else s["bytes"]
    return stats


def collective_stats(jitted_fn: Callable, *args, **kwargs) -> dict[str, dict[str, float]]:
    """Count and bytes per execution of each collective kind in the compiled program."""
    return summarize(collective_ops(jitted_fn, *args, **kwargs))


class Collectives(Mapping):
    """{kind: (count, bytes)} of the collective kinds that occur, in KINDS order: what a
    compiled program runs per execution (`nonzero`) or what a formula says it must.

    Compares equal to a plain dict of the same pairs; `+` adds two (a program of two
    parts); `format()` is the short form of the tour table; `to_json()` a dict per kind."""

    def __init__(self, counts: Mapping | None = None):
        items = {}
        for kind, pair in dict(counts or {}).items():
            if kind not in KINDS:
                raise ConfigError(f"collective kind {kind!r}: one of {', '.join(KINDS)}")
            count, nbytes = pair
            if count or nbytes:
                items[kind] = (int(count), int(nbytes) if float(nbytes).is_integer() else float(nbytes))
        self._items = {k: items[k] for k in KINDS if k in items}

    def __getitem__(self, kind: str) -> tuple[int, int]:
        return self._items[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Collectives({self._items})"

    def __add__(self, other: Mapping) -> Collectives:
        out = dict(self._items)
        for kind, (count, nbytes) in other.items():
            c, b = out.get(kind, (0, 0))
            out[kind] = (c + count, b + nbytes)
        return Collectives(out)

    def format(self) -> str:
        """'2 AR 64.0 KiB + 4 CP 8.0 KiB', or '-' when nothing is communicated."""
        return " + ".join(f"{c} {SHORT[k]} {human_bytes(b)}" for k, (c, b) in self._items.items()) or "-"

    def to_json(self) -> dict[str, dict[str, int]]:
        return {k: {"count": c, "bytes": b} for k, (c, b) in self._items.items()}


def nonzero(stats: dict[str, dict[str, float]]) -> Collectives:
    """The kinds that occur in collective_stats' dict, as Collectives, to compare with a formula."""
    return Collectives({k: (int(v["count"]), v["bytes"]) for k, v in stats.items() if v["count"]})


def format_stats(stats: Mapping) -> str:
    """'2 AR 64.0 KiB + 4 CP 8.0 KiB' (or '-'), from collective_stats' dict or Collectives."""
    if isinstance(stats, Collectives):
        return stats.format()
    return Collectives({k: v if isinstance(v, tuple) else (v["count"], v["bytes"]) for k, v in stats.items()}).format()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
