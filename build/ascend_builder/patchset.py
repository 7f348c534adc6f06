"""A versioned patch set: ``patches/<name>-<version>/`` with its pin, series and patches."""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import BuildError
from .patchfile import PatchInfo, lint_patch, parse_patch, patch_file_name

PATCHSET_FILE = "patchset.toml"
SERIES_FILE = "series"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sdist_sha256: str

    @property
    def sdist_filename(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"

    @property
    def package(self) -> str:
        return self.name.replace("-", "_")


@dataclass(frozen=True)
class Replacement:
    """An overlay file allowed to replace an upstream file with this exact content."""

    path: str
    upstream_sha256: str
    reason: str


@dataclass
class PatchSet:
    directory: Path
    pin: Pin
    series: list[str]
    replacements: dict[str, Replacement] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.directory.name

    def patch_paths(self) -> list[Path]:
        return [self.directory / entry for entry in self.series]


def _require(table: dict, key: str, where: Path) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise BuildError(f"{where}: missing or empty string '{key}'")
    return value


def read_series(directory: Path) -> list[str]:
    path = directory / SERIES_FILE
    if not path.is_file():
        raise BuildError(f"{path} does not exist; list the patches in order, one per line")
    entries = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            entries.append(line)
    return entries


def load_patch_set(directory: Path) -> PatchSet:
    meta_path = directory / PATCHSET_FILE
    if not meta_path.is_file():
        raise BuildError(
            f"{meta_path} does not exist; a patch set needs a {PATCHSET_FILE} with an "
            "[upstream] table (name, version, sdist-sha256)"
        )
    try:
        meta = tomllib.loads(meta_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{meta_path}: invalid TOML: {exc}") from None
    upstream = meta.get("upstream", {})
    sha = _require(upstream, "sdist-sha256", meta_path).lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise BuildError(f"{meta_path}: sdist-sha256 must be 64 hex digits, got {sha!r}")
    pin = Pin(
        name=_require(upstream, "name", meta_path),
        version=_require(upstream, "version", meta_path),
        sdist_sha256=sha,
    )
    replacements = {}
    for entry in meta.get("overlay-replace", []):
        rep = Replacement(
            path=_require(entry, "path", meta_path),
            upstream_sha256=_require(entry, "upstream-sha256", meta_path).lower(),
            reason=_require(entry, "reason", meta_path),
        )
        replacements[rep.path] = rep
    return PatchSet(directory, pin, read_series(directory), replacements)


def lint_series(patch_set: PatchSet) -> list[str]:
    problems = []
    seen = set()
    for entry in patch_set.series:
        if entry in seen:
            problems.append(f"series lists {entry} twice; remove the duplicate line")
        seen.add(entry)
        if "/" in entry or not entry.endswith(".patch"):
            problems.append(f"series entry {entry!r} must be a .patch file name in {patch_set.directory}")
        elif not (patch_set.directory / entry).is_file():
            problems.append(
                f"series entry {entry} names a missing file in {patch_set.directory}; "
                "add the patch or remove the line from the series"
            )
    for path in sorted(patch_set.directory.glob("*.patch")):
        if path.name not in seen:
            problems.append(
                f"{path.name} is not listed in {patch_set.directory / SERIES_FILE}; "
                "add it to the series or delete it"
            )
    return problems


def lint_patch_set(patch_set: PatchSet) -> list[str]:
    """Problems with the series and with every patch's name and header."""
    problems = lint_series(patch_set)
    by_name: dict[str, str] = {}
    for path in patch_set.patch_paths():
        if not path.is_file():
            continue
        info = parse_patch(path)
        problems.extend(lint_patch(info))
        if not info.subject:
            continue
        name = patch_file_name(info.subject)
        if name in by_name and by_name[name] != path.name:
            problems.append(
                f"{by_name[name]} and {path.name} have subjects that both give the file name {name}; "
                "patch names come from subjects: reword one of the two subjects"
            )
        by_name.setdefault(name, path.name)
    return problems


def checked_patches(patch_set: PatchSet) -> list[PatchInfo]:
    """Parse every patch of the series; raise on the first lint problem."""
    problems = lint_patch_set(patch_set)
    if problems:
        more = f" (and {len(problems) - 1} more; run `nox -s patches -- check`)" if len(problems) > 1 else ""
        raise BuildError(problems[0] + more)
    return [parse_patch(path) for path in patch_set.patch_paths()]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
