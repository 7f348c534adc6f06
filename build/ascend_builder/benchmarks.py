"""The project's benchmarks, listed from their own scripts so the list has one home:
``build`` (this builder's, ``bench.py``) and every program in ``benchmarks/`` (a module
with an ``if __name__ == "__main__":`` guard; shared drivers have none), each named by
its file (``kv_transfer.py`` -> ``kv-transfer``) and described by its docstring's first
sentence. ``nox -s bench`` reads it (stdlib only); a test holds the README's table to it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .config import REPO_ROOT


def _summary(path: Path) -> str | None:
    """The first paragraph of a program's docstring, or None for a module that is no program."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_program = any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in tree.body
    )
    if not is_program:
        return None
    return _first_sentence(ast.get_docstring(tree) or "")


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"(.+?[.:])(?:\s+[A-Z(]|$)", paragraph)
    return match.group(1) if match else paragraph


def benchmarks(root: Path = REPO_ROOT) -> dict[str, str]:
    """Benchmark name -> what it measures (the first sentence of the script's docstring)."""
    found = {"build": _summary_of_builder(root)}
    for path in sorted((root / "benchmarks").glob("*.py")):
        summary = _summary(path)
        if summary is not None:
            found[path.stem.replace("_", "-")] = summary
    return found


def script(name: str, root: Path = REPO_ROOT) -> Path:
    """The program a benchmark name runs (not ``build``: the builder runs that one)."""
    return root / "benchmarks" / f"{name.replace('-', '_')}.py"


def _summary_of_builder(root: Path) -> str:
    source = (root / "build" / "ascend_builder" / "bench.py").read_text(encoding="utf-8")
    return _first_sentence(ast.get_docstring(ast.parse(source)) or "")
