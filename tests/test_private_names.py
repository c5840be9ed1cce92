"""bert_reduce reaches other libraries through their public API only.

A private attribute reached through anything but ``self``/``cls``/``super()`` is ruff's
``SLF001`` (``pyproject.toml``). This scan of the package's source fails on what ruff cannot
see: an import of another package's private name or module, a private member of another
library's class used or overridden by a subclass, and Lightning's loop state
(:data:`LOOP_STATE`); except in :data:`PRIVATE_MODULE`, the one module allowed to touch
Lightning's undocumented state.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.lightning24  # also run under NeMo's Lightning 2.4 (.ci/run)

PACKAGE = Path(__file__).resolve().parents[1] / "bert_reduce"
PRIVATE_MODULE = "lightning/_lightning_private.py"
LOOP_STATE = frozenset(
    {"fit_loop", "epoch_loop", "val_loop", "batch_progress", "epoch_progress",
     "restarted_mid_evaluation", "reset_on_run"}
)  # fmt: skip


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@cache
def _members(klass: type) -> frozenset[str]:
    """The private names a class defines: its attributes and the ``self._x`` it assigns."""
    names = {name for name in vars(klass) if _private(name)}
    try:
        tree = ast.parse(inspect.getsource(klass).strip())
    except (OSError, TypeError, SyntaxError):  # built in, or source not available
        return frozenset(names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return frozenset(name for name in names if _private(name))


def _foreign_members(klass: type) -> frozenset[str]:
    own = ("bert_reduce", "builtins")
    return frozenset().union(
        *(_members(base) for base in klass.__mro__[1:] if base.__module__.split(".")[0] not in own)
    )


def _is_own(owner: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: members the class's own code may use, unless a base
    class outside bert_reduce defines them (checked through the class's MRO)."""
    if isinstance(owner, ast.Name):
        return owner.id in ("self", "cls")
    return isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super"


def private_uses(path: Path, module: ModuleType | None = None) -> list[tuple[int, str]]:
    """``(line, name)`` of every private name of another library that ``path`` uses; its
    classes' bases are looked up in ``module``, the file imported (if given)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("bert_reduce", "__future__"):
                continue
            parts = node.module.split(".") + [alias.name for alias in node.names]
            found += [(node.lineno, part) for part in parts if _private(part)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found += [(node.lineno, p) for p in alias.name.split(".") if _private(p)]
        elif isinstance(node, ast.Attribute) and node.attr in LOOP_STATE:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ClassDef) and module is not None:
            klass = getattr(module, node.name, None)
            if not isinstance(klass, type):
                continue
            foreign = _foreign_members(klass)
            for inner in ast.walk(node):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    name, line = inner.name, inner.lineno
                elif isinstance(inner, ast.Attribute) and _is_own(inner.value):
                    name, line = inner.attr, inner.lineno
                else:
                    continue
                if name in foreign:
                    found.append((line, name))
    return sorted(set(found))


def _import(path: Path) -> ModuleType | None:
    name = "bert_reduce." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    try:
        return importlib.import_module(name.removesuffix(".__init__"))
    except ImportError:  # an integration whose library this environment lacks (NeMo)
        return None


def test_no_private_names_of_other_libraries() -> None:
    unexpected = [
        f"{path}:{line}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != PRIVATE_MODULE
        for line, name in private_uses(path, _import(path))
    ]
    assert not unexpected, "\n".join(unexpected)
    # The exempt module is where the scan's finds are, not a module that needs no exemption.
    private = PACKAGE / PRIVATE_MODULE
    assert {name for _, name in private_uses(private, _import(private))} >= {"batch_progress"}


OLD_USES = """
from lightning.fabric.strategies.model_parallel import _FSDPNoSync
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
import torch._dynamo


class Last(ModelCheckpoint):
    def save(self, trainer):
        self._pending = []  # its own
        self._save_last_checkpoint(trainer, super()._monitor_candidates(trainer))
        trainer._signal_connector.received_sigterm = True
        key = self._generate_state_key(every=1)
        trainer.fit_loop.epoch_loop.val_loop.batch_progress.reset_on_run()


class Writer(ExperimentWriter):
    def _check_log_dir_exists(self):
        pass
"""


def test_the_scan_finds_them(tmp_path: Path) -> None:
    # (trainer._signal_connector, line 12, is ruff's SLF001.)
    pytest.importorskip("lightning")
    source = tmp_path / "old_uses.py"
    source.write_text(OLD_USES)
    spec = importlib.util.spec_from_file_location("old_uses", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert private_uses(source, module) == [
        (2, "_FSDPNoSync"), (5, "_dynamo"), (11, "_monitor_candidates"),
        (11, "_save_last_checkpoint"), (13, "_generate_state_key"),
        (14, "batch_progress"), (14, "epoch_loop"), (14, "fit_loop"), (14, "reset_on_run"),
        (14, "val_loop"), (18, "_check_log_dir_exists"),
    ]  # fmt: skip
