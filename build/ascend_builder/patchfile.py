"""Reading one ``git format-patch`` file: its subject, rationale, trailers and hunks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.header import decode_header, make_header
from pathlib import Path

from .errors import BuildError

REQUIRED_TRAILERS = ("Upstream-Status", "Drop-When")

# Upstream-Status values, after DEP-3 and Yocto: what happens to this change upstream.
_UPSTREAM_STATUS = re.compile(
    r"^(?:Pending"
    r"|Submitted \S+://\S+"
    r"|Backport \S+"
    r"|Inappropriate \S.*)$"
)
_TRAILER = re.compile(r"^([A-Za-z][A-Za-z0-9-]*): (.*)$")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Hunk:
    file: str
    number: int  # 1-based within its file, as git apply counts them
    old_start: int
    header: str


@dataclass
class PatchInfo:
    path: Path
    subject: str
    body: str  # rationale text without trailers
    trailers: dict[str, list[str]] = field(default_factory=dict)
    hunks: list[Hunk] = field(default_factory=list)

    @property
    def upstream_status(self) -> str:
        values = self.trailers.get("Upstream-Status", [])
        return values[0] if values else ""

    def hunk_at(self, file: str, line: int) -> Hunk | None:
        """The hunk of ``file`` that git reports as failing at ``line``."""
        for hunk in self.hunks:
            if hunk.file == file and hunk.old_start == line:
                return hunk
        candidates = [h for h in self.hunks if h.file == file]
        return candidates[0] if len(candidates) == 1 else None


def _decode_subject(raw: str) -> str:
    text = str(make_header(decode_header(raw)))
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", text).strip()


def parse_patch(path: Path) -> PatchInfo:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BuildError(f"patch file {path} does not exist") from None
    lines = text.split("\n")

    # Mail header: up to the first blank line, with folded continuation lines.
    headers: dict[str, str] = {}
    i = 0
    last = None
    while i < len(lines) and lines[i] != "":
        line = lines[i]
        if line[:1] in (" ", "\t") and last:
            headers[last] += " " + line.strip()
        elif ":" in line and not line.startswith("From "):
            last, _, value = line.partition(":")
            headers[last] = value.strip()
        i += 1
    if "Subject" not in headers:
        raise BuildError(
            f"{path.name}: not a git format-patch file (no Subject header); "
            "export patches with `nox -s patches -- export`"
        )
    subject = _decode_subject(headers["Subject"])

    # Message body: up to the '---' line that starts the diffstat/diff.
    body_lines: list[str] = []
    i += 1
    while i < len(lines) and lines[i] != "---" and not lines[i].startswith("diff --git "):
        body_lines.append(lines[i])
        i += 1

    # Trailers are the last paragraph of the body.
    while body_lines and not body_lines[-1].strip():
        body_lines.pop()
    para_start = len(body_lines)
    while para_start > 0 and body_lines[para_start - 1].strip():
        para_start -= 1
    trailers: dict[str, list[str]] = {}
    last_paragraph = body_lines[para_start:]
    if last_paragraph and all(_TRAILER.match(line) for line in last_paragraph):
        for line in last_paragraph:
            key, value = _TRAILER.match(line).groups()  # type: ignore[union-attr]
            trailers.setdefault(key, []).append(value.strip())
        body_lines = body_lines[:para_start]
    body = "\n".join(body_lines).strip()

    # Hunks, numbered per file the way `git apply` numbers them.
    hunks: list[Hunk] = []
    current = None
    count = 0
    for line in lines[i:]:
        if line.startswith("diff --git "):
            current, count = None, 0
        elif line.startswith("+++ "):
            target = line[4:].strip()
            current = target[2:] if target.startswith("b/") else target
        elif line.startswith("--- ") and current is None:
            source = line[4:].strip()
            if source != "/dev/null":
                current = source[2:] if source.startswith("a/") else source
        elif (m := _HUNK.match(line)) and current is not None:
            count += 1
            hunks.append(Hunk(current, count, int(m.group(1)), line.split(" @@")[0] + " @@"))
    return PatchInfo(path=path, subject=subject, body=body, trailers=trailers, hunks=hunks)


def lint_patch(info: PatchInfo) -> list[str]:
    """Problems with a patch's header, each one line naming the patch and the fix."""
    name = info.path.name
    problems = []
    if not info.subject:
        problems.append(f"{name}: empty subject; give the commit a one-line summary")
    if not info.body:
        problems.append(
            f"{name}: no rationale; explain in the commit body why this patch exists"
        )
    for key in REQUIRED_TRAILERS:
        values = info.trailers.get(key, [])
        if not values:
            problems.append(
                f"{name}: missing required trailer '{key}:' in the last paragraph "
                "of the commit message"
            )
        elif len(values) > 1:
            problems.append(f"{name}: trailer '{key}:' appears {len(values)} times; keep one")
        elif not values[0]:
            problems.append(f"{name}: trailer '{key}:' is empty")
    status = info.upstream_status
    if status and not _UPSTREAM_STATUS.match(status):
        problems.append(
            f"{name}: malformed 'Upstream-Status: {status}'; use one of "
            "'Pending', 'Submitted <url>', 'Backport <ref>', 'Inappropriate <why>'"
        )
    if not info.hunks:
        problems.append(f"{name}: contains no diff hunks")
    return problems
