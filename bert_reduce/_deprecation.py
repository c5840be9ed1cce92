"""(Private) Old names kept for one release: each use warns and names its replacement."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

REMOVED_IN = "0.3.0"
"""The release that drops the deprecated names (they work, with a warning, until then)."""


def deprecated_names(module: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name of ``renamed`` with a ``DeprecationWarning``.

    Args:
        module: The module's ``__name__``, for the messages.
        renamed: Old name -> ``"package.module.new_name"`` (where the replacement lives; it
            is imported on first use, so modules may point at each other).

    Returns:
        The function to assign to the module's ``__getattr__``. An unknown name raises
        ``AttributeError`` as Python would.
    """

    def __getattr__(name: str) -> Any:
        target = renamed.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new = target.rpartition(".")
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in bert_reduce {REMOVED_IN}; "
            f"use {target} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), new)

    return __getattr__
