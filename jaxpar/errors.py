"""The one error jaxpar raises for input it refuses, and the checks that raise it.

`ConfigError` (a ValueError) is raised before any compute, for every input the library
refuses: a mesh that does not divide what it splits, a wrong device count, a schedule
that cannot run, a wrong type, rank or dtype, an empty batch, a size no machine has. Its
message names the value, the constraint and a fix, in Python's words
(`microbatches=7 or more`); only the command line translates them into its flags.

The helpers below are the checks shared by every package: each returns the value it
accepted (normalised: a numpy integer becomes an int) or raises ConfigError. They look
at types and shapes (for a path, at the filesystem), never at traced values, and import
nothing beyond the standard library, so the pure-Python parts (schedules, formulas, the
planner) use them too.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping

import numpy as np


class ConfigError(ValueError):
    """An input jaxpar refuses, found before any compute. The message says what value was
    given, which constraint it breaks and how to fix it."""


def is_whole(n) -> bool:
    """True for an int (numpy integers included), False for bool, float, str, ..."""
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)


def whole(name: str, value, *, minimum: int = 1, maximum: int | None = None, fix: str = "") -> int:
    """`value` as an int if it is a whole number in [minimum, maximum]; True, 2.0 and "4"
    are not. `maximum` guards sizes no machine has; `fix` replaces the default advice."""
    if not is_whole(value):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}, not a whole number: "
                          f"{fix or f'give an int >= {minimum}, e.g. {name}={max(minimum, 4)}'}")
    if value < minimum:
        raise ConfigError(f"{name}={value}: need at least {minimum}; "
                          f"{fix or f'use {name}={minimum} or more'}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name}={value} is more than {maximum:,}, larger than any machine runs; "
                          f"{fix or f'use {name}={maximum} or less'}")
    return int(value)


def number(name: str, value, *, fix: str = "", zero: bool = False) -> float:
    """`value` as a float if it is a finite real number > 0 (>= 0 with zero=True; not a
    bool, not NaN, not infinite)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise ConfigError(f"{name}={value!r} is not a real number; {fix or f'give a float, e.g. {name}=1e-6'}")
    if value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{name}={value}: must be {'>=' if zero else '>'} 0; "
                          f"{fix or f'give a positive {name}'}")
    if value == float("inf"):
        raise ConfigError(f"{name}={value}: must be finite; {fix or f'give a finite {name}'}")
    return float(value)


def flag(name: str, value) -> bool:
    """`value` if it is a bool (1 and "yes" are not)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}: give True or False")
    return value


def one_of(name: str, value, choices: Iterable) -> object:
    """`value` if it is one of `choices`."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r}: use one of {', '.join(map(repr, choices))}")
    return value


def mapping(name: str, value, example: str) -> Mapping:
    """`value` if it is a dict-like Mapping."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name}={value!r} is a {type(value).__name__}, not a mapping: give a dict, "
                          f"e.g. {name}={example}")
    return value


def divisible(name: str, value: int, by_name: str, by: int, *, why: str, fix: str) -> None:
    """Refuse `value` (called `name`) unless `by` (called `by_name`) divides it."""
    if value % by:
        raise ConfigError(f"{name}={value} is not divisible by {by_name}={by}: {why}. Fix: {fix}")


def divisors(n: int) -> str:
    """'1, 2, 4, 8' for n = 8: the sizes that would divide n, for a message."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def array(name: str, x, *, ndim: int | None = None, kinds: str = "", shape_doc: str = "",
          nonempty: bool = True) -> tuple[int, ...]:
    """The shape of `x` if it is an array (anything with .shape and .dtype: numpy, jax, a
    ShapeDtypeStruct) of rank `ndim`, a dtype whose numpy kind is in `kinds` ("f" float,
    "i" signed int, "u" unsigned, "b" bool; empty: any) and, with `nonempty`, no zero-sized
    axis. `shape_doc` ("x[B, T, D]") says in messages what was expected."""
    want = shape_doc or name
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ConfigError(f"{name} is a {type(x).__name__}, not an array: pass {want} as a jax or numpy array")
    shape = tuple(int(d) for d in shape)
    if ndim is not None and len(shape) != ndim:
        raise ConfigError(f"{name} has shape {shape} (rank {len(shape)}); expected rank {ndim}: {want}")
    kind = _kind(dtype)
    if kinds and kind not in kinds:
        words = {"f": "floating point", "i": "integer", "u": "integer", "b": "bool"}
        wanted = " or ".join(dict.fromkeys(words[k] for k in kinds))
        raise ConfigError(f"{name} has dtype {dtype}; {want} must be {wanted}. Fix: cast it, "
                          f"e.g. {name}.astype({'jnp.float32' if 'f' in kinds else 'jnp.int32'})")
    if nonempty and 0 in shape:
        raise ConfigError(f"{name} has shape {shape}, with an empty axis: {want} needs at least one "
                          "element along every axis (an empty batch has no loss to compute)")
    return shape


def ids_below(name: str, ids, bound: int, *, of: str, fix: str) -> None:
    """Refuse integer `ids` outside [0, bound) (`of`: what the bound counts, "vocab=32"),
    when they are concrete: under jit (a tracer, which numpy cannot read) only their shape
    and dtype are known, and an id out of range reaches a gather that clamps or wraps it
    (a NaN loss, or a plausible wrong number)."""
    try:
        values = np.asarray(ids)
    except TypeError:       # a tracer: jax.errors.TracerArrayConversionError
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= bound:
        raise ConfigError(f"{name} holds ids from {lo} to {hi}, outside [0, {of}): {fix}")


def _kind(dtype) -> str:
    # bfloat16 and the float8 types are numpy 'V' (void) dtypes registered by ml_dtypes.
    kind = getattr(dtype, "kind", "")
    name = str(getattr(dtype, "name", dtype))
    if kind == "V" and ("float" in name):
        return "f"
    return kind


def existing_directory(name: str, path) -> str:
    """`path` made absolute, if it is an existing directory (nothing is created)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{name}={path!r}: give the path of a directory")
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ConfigError(f"{name}={path!r} is {'a file' if os.path.exists(path) else 'not there'}: give the "
                          "path of an existing directory")
    return path


def writable_path(name: str, path, *, directory: bool = False) -> str:
    """`path` made absolute, if this process can write a file (or, with `directory`, a
    directory) there: an existing one of that kind, or a new one in an existing folder.
    The folder above a new path is not created: a mistyped path would otherwise grow a
    whole tree in the wrong place. Writability is `os.access` for this user (root passes
    the permission bits; a read-only filesystem refuses everyone)."""
    kind = "directory" if directory else "file"
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(f"{name}={path!r}: give the path of a {kind}")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        if os.path.isdir(path) != directory:
            raise ConfigError(f"{name}={path!r} is a {'directory' if os.path.isdir(path) else 'file'}, "
                              f"not a {kind}: give the path of a {kind}")
        place = path
    else:
        place = os.path.dirname(path)
        above = place
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above):
            raise ConfigError(f"{name}={path!r} lies under {above!r}, a file, not a folder: "
                              f"give a {kind} in a folder")
        if above != place:
            raise ConfigError(f"{name}={path!r}: its folder {place!r} does not exist; "
                              f"create it (mkdir -p {place}) or give a {kind} in an existing folder")
    # a directory is entered (X) and written (W); an existing checkpoint directory is also listed (R)
    need = (os.W_OK | os.X_OK | (os.R_OK if place == path else 0)) if os.path.isdir(place) else os.W_OK
    if not os.access(place, need):
        raise ConfigError(f"{name}={path!r}: {place!r} is not writable by this user; "
                          f"give a {kind} where you may write")
    return path
