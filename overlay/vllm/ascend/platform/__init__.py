"""The Ascend NPU platform (``npu.py``), its host-emulation mode (``host.py``), and
the stand-in that explains what to do when neither is available (``unavailable.py``).
``detect.py`` picks one; patch 0004 registers it as a builtin vLLM platform."""
