"""The benchmarks have one list: their own scripts (``ascend_builder.benchmarks``), which
``nox -s bench`` reads; the README's table must name exactly those."""

from __future__ import annotations

import re

from ascend_builder.benchmarks import benchmarks, script
from ascend_builder.config import REPO_ROOT


def test_every_benchmark_program_is_listed_with_what_it_measures(tmp_path):
    found = benchmarks()
    assert "build" in found and "kv-transfer" in found and len(found) >= 10
    for name, summary in found.items():
        assert len(summary) > 20 and summary[0].isupper(), (name, summary)
        assert name == "build" or script(name).is_file()
    # a shared driver (no __main__ guard) is no benchmark; a new program is one
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "build" / "ascend_builder").mkdir(parents=True)
    (tmp_path / "build" / "ascend_builder" / "bench.py").write_text('"""Build timing."""\n')
    (tmp_path / "benchmarks" / "driver.py").write_text('"""Shared helpers."""\ndef run(): ...\n')
    (tmp_path / "benchmarks" / "new_one.py").write_text(
        '"""Something measured. More detail."""\nif __name__ == "__main__":\n    pass\n'
    )
    assert benchmarks(tmp_path) == {"build": "Build timing.", "new-one": "Something measured."}


def test_the_readme_lists_exactly_the_benchmarks():
    readme = (REPO_ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `nox -s bench -- ([\w-]+)`", readme, re.MULTILINE)
    assert sorted(listed) == sorted(benchmarks()), "README.md's benchmark rows differ from benchmarks/"
