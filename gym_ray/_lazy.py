"""Package attributes imported on first use (PEP 562).

A package whose public names live in submodules lists them once (name -> module) and gets its module-level
``__getattr__`` and ``__dir__`` from :func:`lazy_exports`: importing the package stays cheap for a process
that needs one part of it (a Ray actor, a merge's sorting process, the CLI's start), and the first access to
a name imports its module and keeps the value in the package's namespace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, names: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``globals()`` is ``namespace``) that import each of
    ``names`` from its module on first access. An unknown name raises ``AttributeError`` as usual."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
