"""The contract double's device model: events and the device bound to each thread."""

from __future__ import annotations

import pytest

torch_npu = pytest.importorskip("torch_npu")
if not getattr(torch_npu, "IS_CONTRACT_DOUBLE", False):
    pytest.skip("the real torch_npu is active on this host", allow_module_level=True)


def test_events_need_a_device_on_their_thread_once_a_device_is_set():
    """CANN binds a device to the calling thread (aclrtSetDevice): a thread that never set
    one (a control-server thread of the P/D connector) must bind before it uses events."""
    import threading

    npu = torch_npu.npu
    saved = npu._current_device, npu._thread_device
    npu._current_device, npu._thread_device = None, threading.local()
    try:
        event = npu.Event()
        event.query()  # no device set anywhere yet: nothing to hold the thread to
        npu.set_device(0)
        errors = []

        def unbound():
            try:
                event.query()
            except RuntimeError as e:
                errors.append(str(e))

        def bound():
            npu.set_device(0)
            event.query()

        for target in (unbound, bound):
            thread = threading.Thread(target=target, name=target.__name__)
            thread.start()
            thread.join()
        assert len(errors) == 1 and "never set a device" in errors[0] and "'unbound'" in errors[0]
        event.query()  # the main thread set it
    finally:
        npu._current_device, npu._thread_device = saved
