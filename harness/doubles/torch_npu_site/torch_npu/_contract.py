"""How the double stands in for torch_npu: schemas, kernels, meta functions, names.

1. Every schema torch_npu 2.14.0 registers (``harness/doubles/schemas.json``,
   generated from the wheel) is defined with ``torch.library`` in its namespace
   (``npu``, ``atb``), so the dispatcher checks argument names, types, defaults and
   keyword-only markers exactly as on an NPU host.
2. The ops this project calls get a CPU kernel (``_ops/``, one module per op family): documented
   preconditions first, then the documented semantics in plain torch. An op the
   project does not call has a schema but no kernel, so calling it fails loudly.
3. torch_npu's own meta functions are loaded from the pinned wheel (its sha256 must
   match the one the schemas were generated from) and every call's outputs are
   compared with them: shape and dtype as torch_npu itself infers them.
4. Names are exported the way torch_npu 2.14.0 does: ``torch_npu.<op>`` is
   ``torch.ops.npu.<op>``; ATB ops are ``torch_npu.<op>`` or ``torch_npu.atb.<op>``
   per the wheel's ``op_plugin/atb/_atb_ops.py`` lists.
"""

from __future__ import annotations

import ast
import atexit
import collections
import hashlib
import json
import os
import sys
import types
import zipfile
from pathlib import Path

import torch
from torch.library import Library

from . import _ops, _syncs

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas.json"
WHEEL_VARIABLE = "TORCH_NPU_DOUBLE_WHEEL"
CALL_LOG_VARIABLE = "TORCH_NPU_DOUBLE_CALL_LOG"

calls: collections.Counter = collections.Counter()
_libraries: list[Library] = []  # keep registrations alive


def _schema_data() -> dict:
    return json.loads(SCHEMAS.read_text())


def _wheel(expected_sha256: str) -> zipfile.ZipFile:
    path = os.environ.get(WHEEL_VARIABLE)
    if not path:
        raise RuntimeError(
            f"the torch_npu contract double needs the pinned torch_npu wheel for its meta functions: "
            f"set {WHEEL_VARIABLE} (harness/doubles/torch_npu_wheel.py fetches it)"
        )
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, but schemas.json was generated from {expected_sha256}; "
            "regenerate the schemas (harness/doubles/extract_schemas.py) or use the pinned wheel"
        )
    return zipfile.ZipFile(path)


def _define_schemas(schemas: dict[str, dict[str, str]]) -> None:
    for namespace, by_name in schemas.items():
        lib = Library(namespace, "DEF")
        _libraries.append(lib)
        for text in by_name.values():
            lib.define(text)


def _full_arguments(schema, args, kwargs) -> dict:
    """Every argument of the call by name, defaults filled in from the schema."""
    out = {}
    positional = list(args)
    for arg in schema.arguments:
        if positional and not arg.kwarg_only:
            out[arg.name] = positional.pop(0)
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise TypeError(f"{schema.name}: missing argument {arg.name}")
    return out


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _flat_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    return []


def _compare_with_meta(qualname: str, overload, schema, full: dict, result) -> None:
    if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):
        return
    pos = [_to_meta(full[a.name]) for a in schema.arguments if not a.kwarg_only]
    kw = {a.name: _to_meta(full[a.name]) for a in schema.arguments if a.kwarg_only}
    expected = _flat_tensors(overload(*pos, **kw))
    got = _flat_tensors(result)
    # torch_npu's meta returns a [0] placeholder for a softmax LSE nobody asked for;
    # the docs say [1]. Neither is used, so only real outputs are compared.
    wants_lse = full.get("softmax_lse_flag") or full.get("return_softmax_lse")
    if (
        qualname.endswith(("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2"))
        and not wants_lse
    ):
        expected, got = expected[:1], got[:1]
    if len(expected) != len(got):
        raise AssertionError(
            f"{qualname}: {len(got)} outputs, torch_npu's meta function gives {len(expected)}"
        )
    for i, (e, g) in enumerate(zip(expected, got)):
        if tuple(e.shape) != tuple(g.shape) or e.dtype != g.dtype:
            raise AssertionError(
                f"{qualname}: output {i} is {tuple(g.shape)} {g.dtype}, torch_npu's meta function says "
                f"{tuple(e.shape)} {e.dtype}"
            )


def _kernel(namespace: str, name: str, fn):
    packet = getattr(getattr(torch.ops, namespace), name.split(".")[0])
    overload = getattr(packet, name.split(".")[1] if "." in name else "default")
    schema = overload._schema
    qualname = f"{namespace}::{name}"

    def kernel(*args, **kwargs):
        graphs = sys.modules.get("torch_npu._graphs")
        if graphs is not None:  # (a replay's own tasks run while it advances)
            graphs.refuse_while_a_replay_waits(f"{qualname} launched")
        with _syncs.kernel_running():
            full = _full_arguments(schema, args, kwargs)
            result = fn(**full)
            _compare_with_meta(qualname, overload, schema, full, result)
        calls[qualname] += 1
        _syncs.launched()
        return result

    return kernel


def _register_kernels() -> None:
    for namespace, kernels in _ops.KERNELS.items():
        lib = Library(namespace, "IMPL", "CPU")
        _libraries.append(lib)
        for name, fn in kernels.items():
            lib.impl(name, _kernel(namespace, name, fn))


class _SkipAtenLibrary(Library):
    """torch_npu's meta file also overrides two aten meta kernels; the double leaves aten alone."""

    def impl(self, *args, **kwargs):
        if self.ns == "aten":
            return None
        return super().impl(*args, **kwargs)


def _load_meta_functions(wheel: zipfile.ZipFile) -> None:
    import torch.library as torch_library

    files = {
        "torch_npu.op_plugin.meta._meta_registrations": "torch_npu/op_plugin/meta/_meta_registrations.py",
        "torch_npu.op_plugin.atb._atb_meta_registrations": "torch_npu/op_plugin/atb/_atb_meta_registrations.py",
    }
    saved = torch_library.Library
    torch_library.Library = _SkipAtenLibrary
    try:
        for module_name, member in files.items():
            module = types.ModuleType(module_name)
            module.__file__ = f"{wheel.filename}!{member}"
            sys.modules[module_name] = module
            exec(compile(wheel.read(member).decode(), module.__file__, "exec"), module.__dict__)
            _libraries.extend(v for v in module.__dict__.values() if isinstance(v, Library))
    finally:
        torch_library.Library = saved


def _atb_name_lists(wheel: zipfile.ZipFile) -> tuple[list[str], list[str]]:
    tree = ast.parse(wheel.read("torch_npu/op_plugin/atb/_atb_ops.py").decode())
    lists = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            lists[node.targets[0].id] = [ast.literal_eval(e) for e in node.value.elts]
    return lists["API_LIST"], lists["ATB_API_LIST"]


def _export_names(module, schemas: dict, wheel: zipfile.ZipFile) -> None:
    for key in schemas["npu"]:
        name = key.split(".")[0]
        setattr(module, name, getattr(torch.ops.npu, name))
    api_list, atb_api_list = _atb_name_lists(wheel)
    atb = types.ModuleType("torch_npu.atb")
    sys.modules["torch_npu.atb"] = atb
    module.atb = atb
    defined = {key.split(".")[0] for key in schemas["atb"]}
    for name in api_list:
        if name in defined:
            setattr(module, name, getattr(torch.ops.atb, name))
    for name in atb_api_list:
        if name in defined:
            setattr(atb, name, getattr(torch.ops.atb, name))


def _write_call_log() -> None:
    directory = os.environ.get(CALL_LOG_VARIABLE)
    if directory and calls:
        path = Path(directory) / f"{os.getpid()}.json"
        path.write_text(json.dumps(dict(calls), sort_keys=True))


def install(module) -> None:
    data = _schema_data()
    wheel = _wheel(data["torch_npu"]["sha256"])
    _define_schemas(data["schemas"])
    _register_kernels()
    _load_meta_functions(wheel)
    _export_names(module, data["schemas"], wheel)
    module.__version__ = data["torch_npu"]["version"]
    from . import _graphs

    _graphs.install(module, wheel)
    atexit.register(_write_call_log)
    _syncs.install()
