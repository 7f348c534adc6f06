"""The Ascend NPU platform (``npu.py``), its start-up rules (``checks.py``), its
host-emulation mode (``host.py``), and
the stand-in that explains what to do when neither is available (``unavailable.py``).
``detect.py`` picks one; patch ``platforms-register-the-ascend-platform-as-a-builtin``
registers it as a builtin vLLM platform."""
