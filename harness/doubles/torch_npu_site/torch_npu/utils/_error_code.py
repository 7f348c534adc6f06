"""Stub of ``torch_npu.utils._error_code``: the names torch_npu's meta functions and graph code import."""

from enum import Enum


class ErrCode(Enum):
    SUCCESS = (0, "success")
    PARAM = (1, "invalid parameter")
    TYPE = (2, "invalid type")
    VALUE = (3, "invalid value")
    NOT_SUPPORT = (7, "feature not supported")
    INTERNAL = (5, "internal error")
    UNAVAIL = (6, "feature unavailable")


def ops_error(error) -> str:
    return f" [contract double: {getattr(error, 'name', error)}]"


def pta_error(error) -> str:
    return f" [contract double: {getattr(error, 'name', error)}]"
