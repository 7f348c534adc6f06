"""Rules of the overlay's shape, read from its source (no import of it):

* no import cycle among ``vllm.ascend`` modules, counting imports inside functions too;
* imports go down the declared room order (``ROOMS``, bottom to top), never up, and the
  rooms of one tier import each other without a cycle;
* no assignment to an attribute of the ``torch`` or ``vllm`` modules (nor ``setattr`` on
  them) except in the few functions that run once while a process is being set up, each
  listed here with its reason (streams and events reach upstream's runner through the
  stream hook patch, not through a swap). Anything else would be a run-time monkey patch
  of upstream: give upstream a hook through a build-time patch instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"
PACKAGE = OVERLAY / "vllm" / "ascend"

# (module, function) -> why it may assign torch/vllm attributes
CONSTRUCTION_ONLY = {
    (
        "vllm.ascend.device.host",
        "answer_accelerator_calls",
    ): "host emulation only: torch.accelerator has no device to answer for; set once "
    "when the host platform is created",
}


# The rooms of vllm.ascend (its subpackages, and top-level modules by their own name),
# bottom to top. A room imports only from its own tier or lower ones; rooms of one tier
# must not import each other in a cycle.
ROOMS = (
    # the package itself, settings, errors, and the pure CP placement rule everything shares
    ("vllm.ascend", "envs", "errors", "context_parallel"),
    ("device",),  # the only code that touches torch_npu
    ("distributed", "step_cache"),
    ("kernels",),
    # the model-layer rooms, on the kernels
    ("attention", "moe", "spec_decode", "graph", "quantization", "ops", "lora"),
    ("kv_transfer", "worker", "registration"),
    ("platform",),
    ("bootstrap", "collect_env"),  # process entry points
)
# (importing module, imported module) -> why this upward import is right
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else module


def _tier(room: str) -> int:
    for tier, rooms in enumerate(ROOMS):
        if room in rooms:
            return tier
    raise AssertionError(f"room {room!r} is in no tier of ROOMS: add it where it belongs")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(OVERLAY).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), filename=str(path))
    return out


def _resolve(name: str, modules: dict) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, tree: ast.Module, modules: dict) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            target = _resolve(name, modules) if name.startswith("vllm.ascend") else None
            if target and target != module:
                found.add(target)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_overlay_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, tree, modules) for name, tree in modules.items()}
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the scan sees the tree
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_imports_go_down_the_room_order():
    modules = _modules()
    upward, allowed_seen, rooms = [], set(), {}
    for name, tree in modules.items():
        for target in _imports(name, tree, modules):
            here, there = _room(name), _room(target)
            if here == there:
                continue
            if _tier(there) > _tier(here):
                if (name, target) in UPWARD_ALLOWED:
                    allowed_seen.add((name, target))
                else:
                    upward.append(f"{name} ({here}) imports {target} ({there})")
            elif _tier(there) == _tier(here):
                rooms.setdefault(here, set()).add(there)
    assert not upward, "imports up the room order (ROOMS):\n" + "\n".join(sorted(upward))
    assert allowed_seen == set(UPWARD_ALLOWED), f"stale entries: {set(UPWARD_ALLOWED) - allowed_seen}"
    graph = {room: rooms.get(room, set()) for tier in ROOMS for room in tier}
    cycle = _cycle(graph)
    assert cycle is None, "rooms of one tier import each other in a cycle: " + " -> ".join(cycle)
    assert rooms, "the scan saw no import between rooms of one tier"


def test_every_room_has_a_tier():
    assert {_room(name) for name in _modules()} <= {room for tier in ROOMS for room in tier}


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _module_attribute_writes(tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, target, enclosing function) of every write to an attribute of an imported
    ``torch``/``vllm`` module, including ``setattr(module, ...)``."""
    roots = {"torch", "vllm"}
    bound = set()  # names bound to torch/vllm modules by imports
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in roots
            )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in roots
        ):
            bound.update(a.asname or a.name for a in node.names if a.name[:1].islower())
    writes = []

    def root_of(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def walk(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, ast.AugAssign | ast.AnnAssign):
                targets = [child.target]
            for target in targets:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(element, ast.Attribute) and root_of(element) in bound:
                        writes.append((child.lineno, ast.unparse(element), function))
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id == "setattr"
                and child.args
                and root_of(child.args[0]) in bound
            ):
                writes.append((child.lineno, f"setattr({ast.unparse(child.args[0])}, ...)", function))
            walk(child, inner)

    walk(tree, None)
    return writes


def test_no_run_time_assignment_to_torch_or_vllm_module_attributes():
    offenders, allowed_seen = [], set()
    for name, tree in _modules().items():
        for line, target, function in _module_attribute_writes(tree):
            if (name, function) in CONSTRUCTION_ONLY:
                allowed_seen.add((name, function))
            else:
                offenders.append(f"{name}:{line} {target} (in {function or 'module body'})")
    assert not offenders, "run-time patching of torch/vllm:\n" + "\n".join(offenders)
    assert allowed_seen == set(CONSTRUCTION_ONLY), "stale entries: " + str(
        set(CONSTRUCTION_ONLY) - allowed_seen
    )


def test_the_attribute_scan_sees_writes():
    tree = ast.parse(
        "import torch\nfrom vllm.v1.worker import dp_utils\n"
        "def f():\n    torch.cuda.Stream = None\n    setattr(dp_utils, 'x', 1)\n"
        "def g(obj):\n    obj.torch = 1\n"
    )
    assert [(t, f) for _, t, f in _module_attribute_writes(tree)] == [
        ("torch.cuda.Stream", "f"),
        ("setattr(dp_utils, ...)", "f"),
    ]


# Rooms whose public functions (and public classes' methods) carry full annotations, which
# `nox -s lint`'s mypy then checks.
ANNOTATED_ROOMS = ("kernels", "kv_transfer", "platform")


def _unannotated(source: str) -> list[str]:
    """Public functions and public methods of public classes with an unannotated argument
    (``self``/``cls`` aside) or no return annotation (``__init__`` aside)."""
    found = []

    def visit(body: list[ast.stmt], owner: str = "") -> None:
        for node in body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                visit(node.body, node.name + ".")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.name.startswith("_") and node.name != "__init__":
                    continue
                a = node.args
                args = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                if owner and args and args[0].arg in ("self", "cls"):
                    args = args[1:]
                args += [x for x in (a.vararg, a.kwarg) if x is not None]
                if any(x.annotation is None for x in args) or (
                    node.returns is None and node.name != "__init__"
                ):
                    found.append(f"{owner}{node.name}:{node.lineno}")

    visit(ast.parse(source).body)
    return found


def test_public_functions_of_the_annotated_rooms_are_annotated():
    missing = {
        str(path.relative_to(OVERLAY)): names
        for room in ANNOTATED_ROOMS
        for path in sorted((OVERLAY / "vllm" / "ascend" / room).rglob("*.py"))
        if (names := _unannotated(path.read_text()))
    }
    assert not missing, f"public functions without full annotations: {missing}"


def test_the_annotation_scan_sees_a_missing_annotation():
    source = (
        "def f(x: int) -> int: ...\n"
        "def g(x): ...\n"
        "def _h(x): ...\n"
        "class C:\n"
        "    def __init__(self, y: int): ...\n"
        "    def m(self, z) -> None: ...\n"
        "    def n(self) : ...\n"
    )
    assert _unannotated(source) == ["g:2", "C.m:6", "C.n:7"]


# -- the harness, the benchmarks and the tests ------------------------------------------------
REPO = OVERLAY.parent


def _imported(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """(module, names) of every absolute import, inside functions too; ``-m module``
    arguments of child processes count as imports of that module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.List | ast.Tuple):
            items = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [(m, []) for flag, m in zip(items, items[1:]) if flag == "-m" and isinstance(m, str)]
    return found


def _upward_into_tests(source: str) -> list[str]:
    return [m for m, _ in _imported(ast.parse(source)) if m == "tests" or m.startswith("tests.")]


def _private_names_of_other_test_modules(source: str, own: str) -> list[str]:
    return [
        f"{m}.{name}"
        for m, names in _imported(ast.parse(source))
        if m.startswith("tests.") and m != own
        for name in names
        if name.startswith("_")
    ]


def test_benchmarks_and_the_harness_import_no_test_module():
    found = {
        str(path.relative_to(REPO)): bad
        for room in ("benchmarks", "harness")
        for path in sorted((REPO / room).rglob("*.py"))
        if (bad := _upward_into_tests(path.read_text()))
    }
    assert not found, f"move what these need into harness/: {found}"


def test_tests_import_no_private_helper_of_another_test_module():
    found = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        own = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if bad := _private_names_of_other_test_modules(path.read_text(), own):
            found[own] = bad
    assert not found, f"make these public in their module (or move them into tests/support): {found}"


def test_the_import_scans_see_what_they_look_for():
    source = (
        "import os\n"
        "from tests.support.oracle import hf_greedy, _cache\n"
        "def f():\n"
        "    import tests.npu\n"
        "    run([sys.executable, '-m', 'tests.support.x', spec])\n"
    )
    assert _upward_into_tests(source) == ["tests.support.oracle", "tests.npu", "tests.support.x"]
    assert _private_names_of_other_test_modules(source, "tests.a") == ["tests.support.oracle._cache"]
    assert _private_names_of_other_test_modules(source, "tests.support.oracle") == []
