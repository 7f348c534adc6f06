from __future__ import annotations

from pathlib import Path

import pytest

from .synthetic import Project, core_module, make_patch, make_sdist, upstream_files


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """A synthetic upstream 1.0 with one patch to fakeup/core.py and a one-file overlay."""
    files = upstream_files()
    proj = Project(root=tmp_path / "repo")
    proj.sdist = make_sdist(tmp_path / "sdists", "1.0", files)
    patch = make_patch(
        tmp_path,
        files,
        {"fakeup/core.py": core_module({30: "VALUE_30 = 'patched'"})},
        "core: patch value 30",
    )
    proj.write([patch])
    return proj
