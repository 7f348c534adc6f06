"""Running git with an isolated, fixed configuration.

Every builder git call goes through :func:`git`, so a maintainer's ~/.gitconfig
(diff algorithm, abbrev length, hooks, signing) can never change what the
builder commits or exports.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

IDENTITY_NAME = "vllm-ascend builder"
IDENTITY_EMAIL = "builder@vllm-ascend.invalid"

_FIXED_CONFIG = {
    "safe.directory": "*",
    "core.autocrlf": "false",
    "core.fileMode": "true",
    "core.abbrev": "12",
    "diff.algorithm": "myers",
    "diff.renames": "false",
    "diff.noprefix": "false",
    "diff.mnemonicPrefix": "false",
    "format.signature": "",
    "am.threeWay": "false",
    "am.keepcr": "false",
    "apply.whitespace": "nowarn",
    "commit.gpgSign": "false",
    "init.defaultBranch": "main",
    "gc.auto": "0",
    "core.looseCompression": "1",
    "advice.detachedHead": "false",
}


def git_env(date: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_COUNT=str(len(_FIXED_CONFIG)),
        GIT_COMMITTER_NAME=IDENTITY_NAME,
        GIT_COMMITTER_EMAIL=IDENTITY_EMAIL,
        GIT_AUTHOR_NAME=IDENTITY_NAME,
        GIT_AUTHOR_EMAIL=IDENTITY_EMAIL,
        LC_ALL="C",
        LANG="C",
        TZ="UTC",
    )
    for i, (key, value) in enumerate(_FIXED_CONFIG.items()):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    if date is not None:
        stamp = f"@{date} +0000"
        env["GIT_AUTHOR_DATE"] = stamp
        env["GIT_COMMITTER_DATE"] = stamp
    if extra:
        env.update(extra)
    return env


def git(
    *args: str,
    cwd: Path,
    date: int | None = None,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``git args`` in ``cwd``; raise CalledProcessError on failure if ``check``."""
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=git_env(date, env),
        input=input,
        text=True,
        capture_output=True,
        check=check,
    )


def commit_all(repo: Path, message: str, date: int, *, force: bool = False) -> str:
    """Stage everything in ``repo`` and commit it with the builder identity; return the id.
    ``force`` also stages what the tree's own .gitignore names: an unpacked release must be
    committed whole (vLLM 0.33's .gitignore has ``*_hip*``, which matches a shipped module)."""
    git("add", "-A", *(["--force"] if force else []), cwd=repo)
    git("commit", "-q", "--no-verify", "--allow-empty", "-m", message, cwd=repo, date=date)
    return head(repo)


def head(repo: Path) -> str:
    return git("rev-parse", "HEAD", cwd=repo).stdout.strip()
