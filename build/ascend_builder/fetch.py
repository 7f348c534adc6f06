"""Getting the upstream sdist: from the package index through pip, or a local file.

Downloads are cached by sha256, and every sdist is verified against the pin
before anything unpacks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import BuildError
from .patchset import Pin, sha256_file


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_file(path)
    if actual != expected:
        raise BuildError(
            f"sha256 mismatch for {path}: expected {expected} (from the pin), got {actual}; "
            "the file is not the pinned upstream release: delete it or point to the right one"
        )


def _cached_path(cache: Path, sha256: str, filename: str) -> Path:
    return cache / "sdists" / sha256 / filename


def pip_download(name: str, version: str, dest: Path) -> Path:
    """Fetch ``name==version`` as an sdist with pip into ``dest`` and return its path."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        name,
        "--disable-pip-version-check",
        "-d",
        str(dest),
        f"{name}=={version}",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = sorted(dest.glob(f"{name}-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise BuildError(
            f"pip could not download the sdist {name}=={version}; check the package index "
            f"or pass a local file with --sdist / VLLM_ASCEND_SDIST.\n{tail}"
        )
    return found[0]


def obtain_pinned_sdist(pin: Pin, cache: Path, local: Path | None, note=print) -> Path:
    """The verified sdist for ``pin``: ``local`` if given, else the cache, else pip."""
    if local is not None:
        if not local.is_file():
            raise BuildError(f"local sdist {local} does not exist; fix --sdist / VLLM_ASCEND_SDIST")
        verify_sha256(local, pin.sdist_sha256)
        note(f"using local sdist {local} (sha256 verified)")
        return local
    cached = _cached_path(cache, pin.sdist_sha256, pin.sdist_filename)
    if cached.is_file():
        verify_sha256(cached, pin.sdist_sha256)
        note(f"cache hit {cached} (sha256 verified)")
        return cached
    note(f"downloading {pin.name}=={pin.version} through pip (builds metadata, ~30-60s)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        downloaded = pip_download(pin.name, pin.version, Path(tmp))
        verify_sha256(downloaded, pin.sdist_sha256)
        cached.parent.mkdir(parents=True, exist_ok=True)
        os.replace(downloaded, cached)
    note(f"cached as {cached}")
    return cached


def obtain_unpinned_sdist(name: str, version: str, cache: Path, note=print) -> tuple[Path, str]:
    """An sdist with no pin yet (rebase trials): download once, cache by its own hash."""
    index = cache / "sdists" / "by-version" / f"{name}-{version}"
    if index.is_file():
        sha = index.read_text().strip()
        path = _cached_path(cache, sha, f"{name}-{version}.tar.gz")
        if path.is_file() and sha256_file(path) == sha:
            note(f"cache hit {path}")
            return path, sha
    note(f"downloading {name}=={version} through pip (builds metadata, ~30-60s)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        downloaded = pip_download(name, version, Path(tmp))
        sha = sha256_file(downloaded)
        path = _cached_path(cache, sha, downloaded.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(downloaded, path)
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(sha + "\n")
    return path, sha
