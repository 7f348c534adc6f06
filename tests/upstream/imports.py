"""Which of upstream's test files import a module the patch set changes.

A test file imports a module when it says so (``import m``, ``from m import x``,
``from pkg import m``) or when a helper module of upstream's own test tree that it
imports (``tests.v1.core.utils`` ...) does, transitively. Read from the source with
``ast``: nothing is imported or run.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


def _imports(path: Path) -> frozenset[str]:
    """Absolute module names a file imports; for ``from a import b`` both ``a`` and ``a.b``
    (``b`` may be a module or a name in ``a``)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError):
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    return frozenset(names)


class ImportScanner:
    """Answers, for files of the upstream tree at ``source``, which of ``modules`` they reach."""

    def __init__(self, source: Path, modules: set[str], helper_package: str = "tests") -> None:
        self.source = source
        self.modules = frozenset(modules)
        self.helper_package = helper_package

    def _helper_file(self, module: str) -> Path | None:
        if module.split(".")[0] != self.helper_package:
            return None
        base = self.source.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def reached(self, path: Path) -> frozenset[str]:
        return self._reached(path.resolve(), frozenset())

    @functools.cache  # noqa: B019  (one scanner per run)
    def _reached(self, path: Path, visiting: frozenset[Path]) -> frozenset[str]:
        found = set()
        for module in _imports(path):
            if module in self.modules:
                found.add(module)
            helper = self._helper_file(module)
            if helper is not None and helper.resolve() not in visiting and helper.resolve() != path:
                found |= self._reached(helper.resolve(), visiting | {path})
        return frozenset(found)


def test_files(source: Path, paths: list[str]) -> list[str]:
    """Upstream's test files (``test_*.py``) at or under ``paths``, relative to ``source``."""
    files = set()
    for rel in paths:
        target = source / rel
        if target.is_file():
            files.add(target)
        elif target.is_dir():
            files.update(target.rglob("test_*.py"))
    return sorted(f.relative_to(source).as_posix() for f in files)


def importers(source: Path, paths: list[str], modules: set[str]) -> dict[str, list[str]]:
    """Test files under ``paths`` that import one of ``modules``: file -> the modules."""
    scanner = ImportScanner(source, modules)
    found = {}
    for rel in test_files(source, paths):
        reached = scanner.reached(source / rel)
        if reached:
            found[rel] = sorted(reached)
    return found
