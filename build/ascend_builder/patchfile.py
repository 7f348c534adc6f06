"""Reading one ``git format-patch`` file: its subject, rationale, trailers and hunks;
the file name a subject gives; and the lint of one patch's header."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.header import decode_header, make_header
from pathlib import Path

from .errors import BuildError

REQUIRED_TRAILERS = ("Upstream-Status", "Drop-When")
# The trailer that may give a Pending patch's reason on its own line.
PENDING_REASON = "Pending-Reason"
NAME_MAX = 64  # characters of a patch file name before ".patch"

# Upstream-Status values, after DEP-3 and Yocto: what happens to this change upstream.
_UPSTREAM_STATUS = re.compile(
    r"^(?:Pending(?: .*)?"
    r"|Submitted \S+://\S+"
    r"|Backport \S+"
    r"|Inappropriate \S.*)$"
)
# Why a Pending patch is not submitted yet: "[reason]" or an upstream URL on the same line.
_PENDING_REASON = re.compile(r"^Pending (?:\[\s*\S[^\]]*\]|\S+://\S+)$")
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

    @property
    def files(self) -> list[str]:
        """The upstream files this patch changes, in the order of its diff."""
        return list(dict.fromkeys(hunk.file for hunk in self.hunks))

    def hunk_at(self, file: str, line: int) -> Hunk | None:
        """The hunk of ``file`` that git reports as failing at ``line``."""
        for hunk in self.hunks:
            if hunk.file == file and hunk.old_start == line:
                return hunk
        candidates = [h for h in self.hunks if h.file == file]
        return candidates[0] if len(candidates) == 1 else None


def patch_file_name(subject: str) -> str:
    """The file name a patch with this subject is exported as: the subject in lower case,
    every run of other characters than letters and digits made one ``-``, cut at a word
    boundary to at most ``NAME_MAX`` characters, plus ``.patch``. No number: the series
    file alone gives the order, so inserting a patch renames no other."""
    slug = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")
    if len(slug) > NAME_MAX:
        cut = slug[: NAME_MAX + 1]
        slug = cut[: cut.rfind("-")] if "-" in cut else slug[:NAME_MAX]
    return slug + ".patch"


def read_patch_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").split("\n")
    except FileNotFoundError:
        raise BuildError(f"patch file {path} does not exist") from None


def parse_mail_header(lines: list[str]) -> tuple[dict[str, str], int]:
    """The mail header (up to the first blank line, folded lines joined) and the index
    of that blank line."""
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
    return headers, i


def decode_subject(raw: str) -> str:
    """The commit subject of a ``Subject:`` header: MIME-decoded, ``[PATCH ...]`` removed."""
    text = str(make_header(decode_header(raw)))
    return re.sub(r"^\[PATCH[^\]]*\]\s*", "", text).strip()


def read_message(lines: list[str], start: int) -> tuple[list[str], int]:
    """The commit message lines from ``start`` up to the ``---`` line or the first diff;
    and the index where the diff part begins."""
    message: list[str] = []
    i = start
    while i < len(lines) and lines[i] != "---" and not lines[i].startswith("diff --git "):
        message.append(lines[i])
        i += 1
    return message, i


def split_trailers(message: list[str]) -> tuple[str, dict[str, list[str]]]:
    """The rationale and the trailers: the last paragraph, if every line of it is ``Key: value``."""
    lines = list(message)
    while lines and not lines[-1].strip():
        lines.pop()
    start = len(lines)
    while start > 0 and lines[start - 1].strip():
        start -= 1
    trailers: dict[str, list[str]] = {}
    paragraph = [_TRAILER.match(line) for line in lines[start:]]
    if paragraph and all(paragraph):
        for match in paragraph:
            key, value = match.groups()  # type: ignore[union-attr]
            trailers.setdefault(key, []).append(value.strip())
        lines = lines[:start]
    return "\n".join(lines).strip(), trailers


def parse_hunks(lines: list[str]) -> list[Hunk]:
    """Every hunk of the diff, numbered per file the way ``git apply`` numbers them."""
    hunks: list[Hunk] = []
    current = None
    count = 0
    for line in lines:
        if line.startswith("diff --git "):
            current, count = None, 0
        elif line.startswith("+++ "):
            target = line[4:].strip()
            if target != "/dev/null":  # a deleted file keeps the name of its "---" line
                current = target.removeprefix("b/")
        elif line.startswith("--- ") and current is None:
            source = line[4:].strip()
            if source != "/dev/null":
                current = source.removeprefix("a/")
        elif (m := _HUNK.match(line)) and current is not None:
            count += 1
            hunks.append(Hunk(current, count, int(m.group(1)), line.split(" @@")[0] + " @@"))
    return hunks


def parse_patch(path: Path) -> PatchInfo:
    lines = read_patch_lines(path)
    headers, end = parse_mail_header(lines)
    if "Subject" not in headers:
        raise BuildError(
            f"{path.name}: not a git format-patch file (no Subject header); "
            "export patches with `nox -s patches -- export`"
        )
    message, diff_start = read_message(lines, end + 1)
    body, trailers = split_trailers(message)
    return PatchInfo(
        path=path,
        subject=decode_subject(headers["Subject"]),
        body=body,
        trailers=trailers,
        hunks=parse_hunks(lines[diff_start:]),
    )


def lint_name(info: PatchInfo) -> list[str]:
    """A patch file is named from its subject, with no number in front."""
    name = info.path.name
    if name[:1].isdigit():
        return [
            (
                f"{name}: the name starts with a number; patch names carry no order (the "
                "series does): re-export with `nox -s patches -- export`"
            )
        ]
    if info.subject and name != patch_file_name(info.subject):
        return [
            (
                f"{name}: the name does not come from the subject {info.subject!r} "
                f"(expected {patch_file_name(info.subject)}); re-export with `nox -s patches -- export`"
            )
        ]
    return []


def lint_upstream_status(info: PatchInfo) -> list[str]:
    name = info.path.name
    status = info.upstream_status
    if not status:
        return []
    if not _UPSTREAM_STATUS.match(status):
        return [
            (
                f"{name}: malformed 'Upstream-Status: {status}'; use one of "
                "'Pending [why not submitted yet]', 'Submitted <url>', 'Backport <ref>', 'Inappropriate <why>'"
            )
        ]
    if status == "Pending":
        reasons = [r for r in info.trailers.get(PENDING_REASON, []) if r]
        if not reasons:
            return [
                (
                    f"{name}: 'Upstream-Status: Pending' does not say why the patch is not submitted "
                    "yet; write 'Pending [why]' or 'Pending <upstream url>', or add a "
                    f"'{PENDING_REASON}: <why>' trailer"
                )
            ]
    elif status.startswith("Pending") and not _PENDING_REASON.match(status):
        return [
            (
                f"{name}: malformed 'Upstream-Status: {status}'; a Pending status takes its reason "
                "in brackets ('Pending [why not submitted yet]') or an upstream URL"
            )
        ]
    return []


def lint_patch(info: PatchInfo) -> list[str]:
    """Problems with a patch's name and header, each one line naming the patch and the fix."""
    name = info.path.name
    problems = lint_name(info)
    if not info.subject:
        problems.append(f"{name}: empty subject; give the commit a one-line summary")
    if not info.body:
        problems.append(f"{name}: no rationale; explain in the commit body why this patch exists")
    for key in REQUIRED_TRAILERS:
        values = info.trailers.get(key, [])
        if not values:
            problems.append(
                f"{name}: missing required trailer '{key}:' in the last paragraph of the commit message"
            )
        elif len(values) > 1:
            problems.append(f"{name}: trailer '{key}:' appears {len(values)} times; keep one")
        elif not values[0]:
            problems.append(f"{name}: trailer '{key}:' is empty")
    problems.extend(lint_upstream_status(info))
    if not info.hunks:
        problems.append(f"{name}: contains no diff hunks")
    return problems
