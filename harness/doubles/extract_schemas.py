"""Regenerate ``schemas.json``: the op schemas the pinned torch_npu wheel registers.

    python -m harness.doubles.extract_schemas --wheel torch_npu-2.14.0-...whl \
        --op-plugin /path/to/Ascend/op-plugin [--op-plugin-commit SHA]

Sources, in this order of trust:

* ``npu::`` ops: the schema strings compiled into ``torch_npu/lib/libtorch_npu.so``
  (lines ``name(args) -> ret`` that torch's own schema parser accepts). These are
  what the dispatcher enforces on an NPU host; the prototypes in
  ``_op_plugin_docs.py`` drift from them, so they are not used here.
* ``atb::`` ops: schema strings the compiler kept whole in
  ``lib/libop_plugin_atb.so``; for the ones it split into fragments, the ``m.def``
  strings of Ascend/op-plugin's ``op_plugin/ops/atb/*.cpp``, accepted only when
  their parameter names and mutability agree with the C++ declaration in the
  wheel's own ``AtbOpsInterface.h``.

Updating torch_npu is a data change: download the new wheel, run this script,
commit the new ``schemas.json`` (it records the wheel's sha256, which the contract
double checks against the wheel it loads meta functions from).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import tempfile
import zipfile
from pathlib import Path

from harness.doubles.torch_npu_wheel import download

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "schemas.json"
SCHEMA_LINE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?\(.*\) -> .+$")
ATB_HEADER = "torch_npu/include/third_party/op-plugin/op_plugin/include/AtbOpsInterface.h"


def _strings(data: bytes, min_len: int = 8) -> list[str]:
    """Printable runs of a binary, as `strings -n 8` prints them."""
    return [m.decode("ascii") for m in re.findall(rb"[\x20-\x7e]{%d,}" % min_len, data)]


def _parsed(lines, accept_name=lambda name: True) -> dict[str, str]:
    import torch

    out: dict[str, str] = {}
    for line in lines:
        if not SCHEMA_LINE.match(line):
            continue
        try:
            schema = torch._C.parse_schema(line)
        except RuntimeError:
            continue  # a C++ prototype or a fragment, not a registered schema
        if not accept_name(schema.name):
            continue
        key = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        out.setdefault(key, line)
    return out


def _atb_cpp_declarations(header: str) -> dict[str, list[tuple[str, bool]]]:
    """name -> [(param, mutable)] from AtbOpsInterface.h (non-const ``Tensor&`` = mutable)."""
    decls = {}
    for m in re.finditer(r"TORCH_NPU_API\s+[\w:<>, ]+?\s+(\w+)\(([^;]*)\);", header):
        params = []
        for raw in m.group(2).split(","):
            raw = raw.strip()
            if not raw:
                continue
            name = re.split(r"[\s&*]+", raw)[-1]
            params.append((name, "Tensor" in raw and "&" in raw and not raw.startswith("const")))
        decls[m.group(1)] = params
    return decls


def _op_plugin_atb_defs(op_plugin: Path) -> list[str]:
    defs = []
    for cpp in sorted((op_plugin / "op_plugin" / "ops" / "atb").glob("*.cpp")):
        text = cpp.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', text):
            defs.append("".join(re.findall(r'"([^"]*)"', m.group(1))))
    return defs


def _agrees_with_header(schema_text: str, decls) -> bool:
    import torch

    schema = torch._C.parse_schema(schema_text)
    if schema.overload_name or schema.name not in decls:
        return False
    cpp = decls[schema.name]
    ours = [(a.name, a.alias_info is not None and a.alias_info.is_write) for a in schema.arguments]
    return [n for n, _ in ours] == [n for n, _ in cpp] and ours == cpp


def extract(wheel: Path, op_plugin: Path | None, op_plugin_commit: str | None) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        npu = _parsed(_strings(zf.read("torch_npu/lib/libtorch_npu.so")))
        atb = _parsed(_strings(zf.read("torch_npu/lib/libop_plugin_atb.so")))
        header = zf.read(ATB_HEADER).decode()
        version = re.search(r"__version__ = '([^']+)'", zf.read("torch_npu/version.py").decode()).group(1)
    atb_sources = {key: "libop_plugin_atb.so" for key in atb}
    if op_plugin is not None:
        decls = _atb_cpp_declarations(header)
        for text in _op_plugin_atb_defs(op_plugin):
            key = text.split("(", 1)[0]
            if key in atb or not _agrees_with_header(text, decls):
                continue
            atb[key] = text
            atb_sources[key] = "op-plugin m.def, checked against AtbOpsInterface.h"
    return {
        "generated_by": "harness/doubles/extract_schemas.py",
        "torch_npu": {
            "version": version,
            "wheel": wheel.name,
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        },
        "op_plugin_source": (
            {"repository": "Ascend/op-plugin", "commit": op_plugin_commit} if op_plugin else None
        ),
        "schemas": {
            "npu": dict(sorted(npu.items())),
            "atb": dict(sorted(atb.items())),
        },
        "atb_sources": dict(sorted(atb_sources.items())),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel", type=Path, help="torch_npu wheel (default: download the pinned one with pip)")
    p.add_argument("--op-plugin", type=Path, help="a checkout of Ascend/op-plugin (for ATB schemas)")
    p.add_argument("--op-plugin-commit", help="the op-plugin commit, recorded for provenance")
    p.add_argument("--version", default="2.14.0", help="torch_npu version to download without --wheel")
    p.add_argument("--out", type=Path, default=OUTPUT)
    args = p.parse_args(argv)
    wheel = args.wheel
    if wheel is None:
        wheel = download(args.version, Path(tempfile.mkdtemp()))
    data = extract(wheel, args.op_plugin, args.op_plugin_commit)
    args.out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    counts = {ns: len(v) for ns, v in data["schemas"].items()}
    print(f"{wheel.name}: {counts} schemas -> {args.out}")


if __name__ == "__main__":
    main()
