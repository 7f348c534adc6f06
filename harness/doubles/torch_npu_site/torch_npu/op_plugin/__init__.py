"""Stub of ``torch_npu.op_plugin``: only the ATB guard (``atb/_atb_ops.py``) lives here;
the wheel's meta registrations are loaded under their own names by ``_contract.py``."""
