"""``nox -s rebase -- VERSION``: try the series on another upstream and report per patch.

Unlike the build, this never stops at the first failure and may use 3-way
merges, because its job is to tell the maintainer how much work a move is.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .apply import check_patch, describe_failure
from .drift import Drift, compare
from .errors import BuildError
from .fetch import obtain_unpinned_sdist
from .gitutil import git
from .overlay import plan_overlay
from .patched import Retarget, patched_tree
from .patchfile import PatchInfo
from .patchset import checked_patches, load_patch_set, sha256_file
from .worktree import attach_overlay

STATUSES = ("clean", "offset", "needs-3way", "conflict", "already-upstream")


@dataclass
class PatchOutcome:
    patch: str
    status: str
    detail: str = ""
    drop_when: str = ""  # the patch's Drop-When trailer: the condition to re-check by hand


@dataclass
class RebaseReport:
    name: str
    from_version: str
    to_version: str
    to_sdist_sha256: str
    patches: list[PatchOutcome] = field(default_factory=list)
    overlay: str = "ok"
    drift: Drift = field(default_factory=Drift)

    def counts(self) -> dict[str, int]:
        return {s: sum(p.status == s for p in self.patches) for s in STATUSES}

    @property
    def conflicts(self) -> int:
        return self.counts()["conflict"]

    def markdown(self) -> str:
        lines = [
            f"# Rebase report: {self.name} {self.from_version} -> {self.to_version}",
            "",
            f"Target sdist sha256: `{self.to_sdist_sha256}`",
            "",
            "Re-check each patch's Drop-When against the target (a patch whose change is",
            "already upstream shows as `already-upstream`; a condition met otherwise is not seen",
            "here), and say the result in the move's notes.",
            "",
            "| # | patch | status | detail | drop when |",
            "|---:|---|---|---|---|",
        ]
        lines += [
            f"| {i} | {p.patch} | {p.status} | {p.detail.replace('|', '/')} | {p.drop_when.replace('|', '/')} |"
            for i, p in enumerate(self.patches, 1)
        ]
        summary = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        lines += [
            "",
            f"Summary: {summary or 'no patches'}",
            f"Overlay: {self.overlay}",
            "",
            *self.drift.markdown(),
            "Next: once the series applies, add `patches/<name>-<version>/` (pin + series), point",
            "`patch-set` in pyproject.toml at it, build, and run upstream's own tests against the",
            f"new wheel: `nox -s upstream-tests` (upstream's tests come from the {self.to_version} sdist;",
            "start its upstream-expectations.toml from the current one). This needs a host where",
            f"{self.name} {self.to_version}'s dependencies install.",
            "",
        ]
        return "\n".join(lines)


def try_patch(tree: Path, info: PatchInfo, date: int) -> PatchOutcome:
    name = info.path.name
    forward = check_patch(tree, info.path)
    if forward.ok:
        git("am", "--no-3way", "--quiet", str(info.path), cwd=tree, date=date)
        if forward.offsets:
            return PatchOutcome(name, "offset", "; ".join(map(str, forward.offsets)))
        return PatchOutcome(name, "clean")
    if check_patch(tree, info.path, reverse=True).ok:
        return PatchOutcome(name, "already-upstream", "its changes are already in the target")
    merged = git("am", "--3way", "--quiet", str(info.path), cwd=tree, date=date, check=False)
    if merged.returncode == 0:
        return PatchOutcome(name, "needs-3way", describe_failure(info, forward))
    conflicted = git("diff", "--name-only", "--diff-filter=U", cwd=tree, check=False).stdout.split()
    git("am", "--abort", cwd=tree, check=False)
    files = ", ".join(conflicted) or (forward.failed_file or "?")
    return PatchOutcome(name, "conflict", f"conflicts in {files}; " + describe_failure(info, forward))


def try_series(tree: Path, patches: list[PatchInfo], date: int, note=print) -> dict[str, PatchOutcome]:
    """Try every patch in order, never stopping; a conflicting patch is left out."""
    outcomes = {}
    for info in patches:
        outcome = try_patch(tree, info, date)
        outcome.drop_when = " ".join(info.trailers.get("Drop-When", []))
        note(f"{outcome.patch}: {outcome.status}" + (f" ({outcome.detail})" if outcome.detail else ""))
        outcomes[outcome.patch] = outcome
    return outcomes


def rebase_report(
    patch_set_dir: Path,
    overlay: Path,
    target_version: str,
    cache: Path,
    work_root: Path,
    note=print,
    target_sdist: Path | None = None,
    pinned_sdist: Path | None = None,
    keep_tree: Path | None = None,
) -> RebaseReport:
    """Try the series on ``target_version`` and report per patch. With ``keep_tree`` the
    trial tree is kept there as the new version's work tree: tag ``pristine`` on the target
    release, one commit per patch that applied, the overlay linked in; a conflicting patch
    is left out, for the maintainer to apply there with ``git am -3`` and resolve."""
    patch_set = load_patch_set(patch_set_dir)
    patches = checked_patches(patch_set)
    pin = patch_set.pin
    if target_sdist is not None:
        new_sdist, new_sha = target_sdist, sha256_file(target_sdist)
    else:
        new_sdist, new_sha = obtain_unpinned_sdist(pin.name, target_version, cache, note)
    report = RebaseReport(pin.name, pin.version, target_version, new_sha)
    work_root.mkdir(parents=True, exist_ok=True)
    if keep_tree is not None and keep_tree.exists():
        raise BuildError(f"{keep_tree} already exists; remove it or name another --tree")
    with tempfile.TemporaryDirectory(prefix="rebase-", dir=work_root) as tmp:
        # The target release is committed on top of the pinned pristine, so the old blobs
        # that the patches' index lines name are there for 3-way merges.
        tree = patched_tree(
            pin,
            patches,
            keep_tree or Path(tmp) / "tree",
            cache,
            sdist=pinned_sdist,
            note=note,
            retarget=Retarget(new_sdist, target_version),
            apply=try_series,
        )
        report.patches.extend(tree.applied.values())
        # the target release is committed on top of the pinned one: compare the two
        report.drift = compare(tree.path, f"{tree.base}~1", tree.base, overlay)
        try:
            if keep_tree is not None:  # tags pristine first, then checks and links the overlay
                attach_overlay(keep_tree, tree.base, overlay, patch_set.replacements, pin.package)
            else:
                plan_overlay(overlay, tree.path, patch_set.replacements, pin.package)
        except BuildError as exc:
            report.overlay = f"problem: {exc}"
    return report


def write_report(report: RebaseReport, out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{report.name}-{report.from_version}-to-{report.to_version}"
    md = out_dir / f"{stem}.md"
    js = out_dir / f"{stem}.json"
    md.write_text(report.markdown())
    data = asdict(report) | {"counts": report.counts()}
    js.write_text(json.dumps(data, indent=2) + "\n")
    return md, js
