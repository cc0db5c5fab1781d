"""Lazy re-exports for a technique package's __init__ (PEP 562), pure Python.

A package lists {module: (public names)}; each name loads from its module on first use,
so importing a pure-Python part (`jaxpar.tensor.formulas`, `jaxpar.context.zigzag`) does
not start JAX through the package's __init__:

    __getattr__, __dir__, __all__ = lazy.exports(__name__, {"block": ("tp_block", ...), ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, modules: Mapping[str, tuple[str, ...]]) -> tuple[Callable, Callable, list[str]]:
    """(__getattr__, __dir__, __all__) for `package`, re-exporting `modules`' names."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
