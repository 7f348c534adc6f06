"""Patch ``engine-leave-stopping-engine-processes-to-the-shutdown-s-join``: upstream's
engine-core process manager has a monitor thread that polls a process once its sentinel
fires. When the process ends because ``shutdown()`` terminated it, that poll races the
shutdown's own join (two threads reaping one child: the loser's ``waitpid`` gets ECHILD,
CPython then answers "alive", and the shutdown force-kills a process that had exited).
With the patch the monitor leaves a stopping manager's processes alone.

Real processes (spawned, ended by the manager's SIGTERM), upstream's manager class."""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
import weakref

from vllm.v1.engine.utils import CoreEngineProcManager


class _Watched:
    """A process whose exit code reads are recorded with the reading thread."""

    def __init__(self, proc) -> None:
        self._proc = proc
        self.exitcode_readers: list[str] = []

    def __getattr__(self, name):
        return getattr(self._proc, name)

    @property
    def exitcode(self):
        self.exitcode_readers.append(threading.current_thread().name)
        return self._proc.exitcode


def _manager(proc: _Watched) -> CoreEngineProcManager:
    # (only the fields monitor_engine_liveness and shutdown read: no engine behind it)
    manager = CoreEngineProcManager.__new__(CoreEngineProcManager)
    manager.processes = [proc]  # type: ignore[list-item]
    manager.manager_stopped = threading.Event()
    manager.failed_proc_name = None
    manager._request_shutdown_timeout = 0
    manager._finalizer = weakref.finalize(manager, lambda: None)
    return manager


def test_the_monitor_leaves_a_stopping_managers_processes_to_its_join():
    proc = _Watched(multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,), daemon=True))
    proc.start()
    try:
        manager = _manager(proc)
        monitor = threading.Thread(target=manager.monitor_engine_liveness, name="monitor")
        monitor.start()
        time.sleep(0.2)  # (the monitor waits on the sentinel, up to 1 s a round)
        manager.shutdown(timeout=30)  # SIGTERM, then the join
        monitor.join(timeout=10)
        assert not monitor.is_alive()
        assert not proc.is_alive() and proc.exitcode is not None
        assert "monitor" not in proc.exitcode_readers, "the monitor polled a process the shutdown joins"
        assert manager.failed_proc_name is None
    finally:
        if proc.is_alive():
            proc.kill()


def test_the_monitor_still_reports_a_process_that_dies_on_its_own():
    proc = _Watched(multiprocessing.get_context("spawn").Process(target=sys.exit, args=(3,), daemon=True))
    proc.start()
    manager = _manager(proc)
    manager.monitor_engine_liveness()  # returns once the process has ended
    assert proc.exitcode_readers == [threading.current_thread().name]
    assert manager.failed_proc_name == proc.name
    assert manager.manager_stopped.is_set()  # it shut the manager down
