"""The shutdown diagnostic (harness/stacks.py): the stacks it prints are the hung process's."""

import subprocess
import sys
import time

import pytest

from harness.stacks import MARKER, _py_spy, dump_stacks, stacks_if_slow

pytestmark = pytest.mark.skipif(_py_spy() is None, reason="py-spy is in tests/requirements.txt")

PARKED = "import time\ndef parked_in_a_sleep():\n    time.sleep(60)\nparked_in_a_sleep()\n"


def test_a_slow_block_prints_its_childrens_stacks(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", PARKED])
    try:
        time.sleep(1)  # the child is in its function
        out = tmp_path / "log"
        with stacks_if_slow(child.pid, after=0.2, include_root=True, out=out):
            deadline = time.monotonic() + 20  # the block lasts until the stacks are written
            while not (out.exists() and "Thread" in out.read_text()) and time.monotonic() < deadline:
                time.sleep(0.1)
        text = out.read_text()
        assert "still shutting down" in text
        assert all(line.startswith(MARKER) for line in text.splitlines())
        assert "parked_in_a_sleep" in text, text
    finally:
        child.kill()
        child.wait()


def test_a_quick_block_prints_nothing(tmp_path):
    out = tmp_path / "log"
    with stacks_if_slow(1, after=5, out=out):
        pass
    time.sleep(0.1)
    assert not out.exists()
    assert dump_stacks(2**22 + 7) == f"{MARKER} process {2**22 + 7} is gone"  # said so, no stacks
