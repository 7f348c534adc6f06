"""Applying a patch series with ``git am``: zero fuzz, offsets reported, no 3-way."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BuildError
from .gitutil import git
from .patchfile import PatchInfo

_CHECKING = re.compile(r"^Checking patch (.+?)\.\.\.$")
_OFFSET = re.compile(r"^Hunk #(\d+) succeeded at (\d+) \(offset (-?\d+) lines?\)\.$")
_FAILED = re.compile(r"^error: patch failed: (.+):(\d+)$")
_ERROR = re.compile(r"^error: (.+)$")


@dataclass(frozen=True)
class Offset:
    file: str
    hunk: int
    line: int
    offset: int

    def __str__(self) -> str:
        return f"{self.file} hunk #{self.hunk} at line {self.line} (offset {self.offset:+d})"


@dataclass
class CheckResult:
    ok: bool
    offsets: list[Offset] = field(default_factory=list)
    failed_file: str | None = None
    failed_line: int | None = None
    errors: list[str] = field(default_factory=list)


def check_patch(tree: Path, patch: Path, reverse: bool = False) -> CheckResult:
    """Dry-run ``git apply`` and collect its per-hunk report."""
    args = ["apply", "--check", "--verbose"] + (["--reverse"] if reverse else []) + [str(patch)]
    result = git(*args, cwd=tree, check=False)
    res = CheckResult(ok=result.returncode == 0)
    current = None
    for line in (result.stdout + result.stderr).splitlines():
        if m := _CHECKING.match(line):
            current = m.group(1)
        elif (m := _OFFSET.match(line)) and current:
            res.offsets.append(Offset(current, int(m.group(1)), int(m.group(2)), int(m.group(3))))
        elif m := _FAILED.match(line):
            res.failed_file, res.failed_line = m.group(1), int(m.group(2))
        elif (m := _ERROR.match(line)) and not line.startswith("error: while searching"):
            res.errors.append(m.group(1))
    return res


def describe_failure(info: PatchInfo, check: CheckResult) -> str:
    """One line naming the patch, the file and the hunk that does not apply."""
    if check.failed_file is not None:
        hunk = info.hunk_at(check.failed_file, check.failed_line or 0)
        where = (
            f"hunk #{hunk.number} {hunk.header} of {check.failed_file}"
            if hunk
            else f"the hunk at {check.failed_file}:{check.failed_line}"
        )
        return (
            f"patch {info.path.name} does not apply: {where} does not match upstream "
            "exactly (fuzz is refused); refresh it in `nox -s tree` and re-export with "
            "`nox -s patches -- export`"
        )
    detail = "; ".join(check.errors) or "git apply failed"
    return f"patch {info.path.name} does not apply: {detail}; refresh it in `nox -s tree`"


def apply_patch(tree: Path, info: PatchInfo, date: int) -> list[Offset]:
    """Apply one patch as a commit; raise BuildError naming the hunk if it needs fuzz."""
    check = check_patch(tree, info.path)
    if not check.ok:
        raise BuildError(describe_failure(info, check))
    result = git("am", "--no-3way", "--quiet", str(info.path), cwd=tree, date=date, check=False)
    if result.returncode != 0:
        git("am", "--abort", cwd=tree, check=False)
        detail = result.stderr.strip().splitlines()[0] if result.stderr.strip() else "unknown error"
        raise BuildError(f"git am failed on {info.path.name}: {detail}")
    return check.offsets


def apply_series(tree: Path, patches: list[PatchInfo], date: int, note=print) -> dict[str, list[Offset]]:
    """Apply every patch in order; return the offsets each one needed."""
    report = {}
    for info in patches:
        offsets = apply_patch(tree, info, date)
        report[info.path.name] = offsets
        if offsets:
            note(f"{info.path.name}: applied with offsets: " + "; ".join(map(str, offsets)))
        else:
            note(f"{info.path.name}: applied cleanly")
    return report
