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


def _summary(path: Path, program_only: bool = True) -> str | None:
    """The first sentence of a module's docstring, or None for a module that is no program
    (``program_only``: no ``if __name__ ...`` at its top level)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_program = any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        for node in tree.body
    )
    if program_only and not is_program:
        return None
    return _first_sentence(ast.get_docstring(tree) or "")


def _first_sentence(doc: str) -> str:
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"(.+?[.:])(?:\s+[A-Z(]|$)", paragraph)
    return match.group(1) if match else paragraph


def benchmarks(root: Path = REPO_ROOT) -> dict[str, str]:
    """Benchmark name -> what it measures (the first sentence of the script's docstring)."""
    # the builder's bench.py runs under `python -m ascend_builder bench`, not as a program
    found = {"build": _summary(root / "build" / "ascend_builder" / "bench.py", program_only=False) or ""}
    for path in sorted((root / "benchmarks").glob("*.py")):
        summary = _summary(path)
        if summary is not None:
            found[path.stem.replace("_", "-")] = summary
    return found


def script(name: str, root: Path = REPO_ROOT) -> Path:
    """The program a benchmark name runs (not ``build``: the builder runs that one)."""
    return root / "benchmarks" / f"{name.replace('-', '_')}.py"
