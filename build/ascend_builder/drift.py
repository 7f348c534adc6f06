"""What moved upstream that the overlay depends on, between two pristine releases.

``nox -s rebase`` runs this beside the patch trial: the patches say where upstream's code
moved under them; this says what the overlay (which patches do not cover) would trip on.
Every check compares the two releases' files (read from the trial tree's git history,
nothing is imported) and reports only what the overlay touches:

* requirement lines whose version specifier changed (the wheel's, the CPU build's and the
  KV connectors' ``requirements/*.txt``);
* upstream modules, and names imported from them, that the overlay imports or names in a
  dotted string (kernel override keys) and that the new release no longer has;
* ``Platform`` members that are new, gone, or whose parameters changed, with whether the
  overlay's platform defines them;
* config attributes the overlay reads or sets (``<x>_config.<name>``) that the new
  release's config class no longer has;
* defaults that moved on those attributes, and on every UPPER_CASE config class constant;
* ``VLLM_*`` variables the overlay reads that upstream no longer knows.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from .gitutil import git

# the config objects the overlay reaches through ``vllm_config.<x>_config`` and their classes
CONFIG_CLASSES = {
    "cache_config": ("vllm/config/cache.py", "CacheConfig"),
    "compilation_config": ("vllm/config/compilation.py", "CompilationConfig"),
    "device_config": ("vllm/config/device.py", "DeviceConfig"),
    "kv_transfer_config": ("vllm/config/kv_transfer.py", "KVTransferConfig"),
    "load_config": ("vllm/config/load.py", "LoadConfig"),
    "lora_config": ("vllm/config/lora.py", "LoRAConfig"),
    "model_config": ("vllm/config/model.py", "ModelConfig"),
    "parallel_config": ("vllm/config/parallel.py", "ParallelConfig"),
    "scheduler_config": ("vllm/config/scheduler.py", "SchedulerConfig"),
    "speculative_config": ("vllm/config/speculative.py", "SpeculativeConfig"),
}
PLATFORM = ("vllm/platforms/interface.py", "Platform")
# what the wheel installs (upstream's common set), the CPU build, and the KV connectors'
# set (it names the Mooncake release upstream tests with)
WHEEL_REQUIREMENTS = (
    "requirements/common.txt",
    "requirements/cpu.txt",
    "requirements/build/cpu.txt",
    "requirements/kv_connectors.txt",
)
_IMPORT = re.compile(r"^\s*from\s+(vllm(?:\.\w+)+)\s+import\s+(?:\(([^)]*)\)|([^\n(]+))", re.M)
_IMPORT_MODULE = re.compile(r"^\s*import\s+(vllm(?:\.\w+)+)", re.M)
_DOTTED = re.compile(r"[\"'](vllm(?:\.\w+){2,})\.?[\"']")
_CONFIG_ATTR = re.compile(r"\b(" + "|".join(CONFIG_CLASSES) + r")\.([a-z_]\w*)")
_ENV = re.compile(r"\b(VLLM_(?!ASCEND_)[A-Z0-9_]+)\b")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)\s*([<>=!~][^#;]*)?")


@dataclass
class Drift:
    requirements: list[str] = field(default_factory=list)
    missing_imports: list[str] = field(default_factory=list)
    platform: list[str] = field(default_factory=list)
    config: list[str] = field(default_factory=list)
    defaults: list[str] = field(default_factory=list)
    env: list[str] = field(default_factory=list)

    def sections(self) -> list[tuple[str, list[str]]]:
        return [
            ("Requirement specifiers that moved", self.requirements),
            ("Upstream modules and names the overlay imports that are gone", self.missing_imports),
            ("Platform members new, gone or changed", self.platform),
            ("Config attributes the overlay uses that are gone", self.config),
            ("Config defaults that moved (attributes the overlay uses, class constants)", self.defaults),
            ("VLLM_* variables the overlay reads that upstream no longer knows", self.env),
        ]

    def markdown(self) -> list[str]:
        lines = ["## What moved under the overlay", ""]
        for title, items in self.sections():
            lines.append(f"{title}: " + ("none" if not items else ""))
            lines += [f"- {item}" for item in items]
            lines.append("")
        return lines


class _Release:
    """One release's files, read from a commit of the trial tree."""

    def __init__(self, tree: Path, rev: str):
        self.tree, self.rev = tree, rev
        listing = git("ls-tree", "-r", "--name-only", rev, cwd=tree).stdout.split("\n")
        self.files = {name for name in listing if name}

    def read(self, path: str) -> str | None:
        if path not in self.files:
            return None
        return git("show", f"{self.rev}:{path}", cwd=self.tree).stdout

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if path in self.files:
                return path
        return None


def overlay_sources(overlay: Path) -> dict[str, str]:
    """The overlay's Python files (its own ``vllm/ascend`` package and any other file it
    adds), by path relative to the overlay."""
    return {
        str(p.relative_to(overlay)): p.read_text(errors="replace")
        for p in sorted(overlay.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def compare(tree: Path, old_rev: str, new_rev: str, overlay: Path) -> Drift:
    old, new = _Release(tree, old_rev), _Release(tree, new_rev)
    sources = overlay_sources(overlay)
    return Drift(
        requirements=requirement_changes(old, new),
        missing_imports=missing_imports(old, new, sources),
        platform=platform_changes(old, new, sources),
        config=config_changes(old, new, sources),
        defaults=default_changes(old, new, sources),
        env=env_changes(old, new, sources),
    )


def _requirements(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip().removesuffix("\\").strip()
        if not line or line.startswith("-"):
            continue
        match = _REQUIREMENT.match(line)
        if match:
            out[match.group(1).lower()] = (match.group(2) or "").strip()
    return out


def requirement_changes(old: _Release, new: _Release) -> list[str]:
    out = []
    for path in WHEEL_REQUIREMENTS:
        before, after = _requirements(old.read(path) or ""), _requirements(new.read(path) or "")
        for package in sorted(before.keys() | after.keys()):
            a, b = before.get(package), after.get(package)
            if a == b:
                continue
            if a is None:
                out.append(f"{path}: {package} added ({b or 'any version'})")
            elif b is None:
                out.append(f"{path}: {package} removed (was {a or 'any version'})")
            else:
                out.append(f"{path}: {package} {a or 'any version'} -> {b or 'any version'}")
    return out


def _defines(source: str, name: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # unreadable: do not claim it is gone
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (alias.asname or alias.name.split(".")[0]) == name for alias in node.names
        ):
            return True
    return False


def missing_imports(old: _Release, new: _Release, sources: dict[str, str]) -> list[str]:
    """What the overlay imports (or names by dotted string) that the old release had and the
    new one has not. Names that the overlay itself provides (its own files) are skipped."""
    found: dict[str, set[str]] = {}
    for path, text in sources.items():
        uses = []
        for module, grouped, names in _IMPORT.findall(text):
            for name in (grouped or names).split(","):
                name = name.split("#", 1)[0].strip().split(" as ")[0].strip()
                if name:
                    uses.append((module, name))
        uses += [(module, None) for module in _IMPORT_MODULE.findall(text)]
        uses += [_split_dotted(old, new, dotted) for dotted in _DOTTED.findall(text)]
        for module, name in uses:
            if module.startswith("vllm.ascend") or f"{module.replace('.', '/')}.py" in sources:
                continue
            problem = _gone(old, new, module, name)
            if problem:
                found.setdefault(problem, set()).add(path)
    return [f"{problem} (overlay: {', '.join(sorted(paths))})" for problem, paths in sorted(found.items())]


def _split_dotted(old: _Release, new: _Release, dotted: str) -> tuple[str, str | None]:
    """``a.b.c.D.e`` -> (the longest module prefix either release has, the name after it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        module = ".".join(parts[:cut])
        if old.module_path(module) or new.module_path(module):
            return module, (parts[cut] if cut < len(parts) else None)
    return dotted, None


def _gone(old: _Release, new: _Release, module: str, name: str | None) -> str | None:
    before, after = old.module_path(module), new.module_path(module)
    if after is None:
        return f"module {module}" if before is not None else None
    if name is None or new.module_path(f"{module}.{name}"):
        return None
    head = name.split(".")[0]
    old_source, new_source = old.read(before) if before else None, new.read(after)
    if (
        old_source is not None
        and _defines(old_source, head)
        and not (new_source and _defines(new_source, head))
    ):
        return f"{module}.{head}"
    return None


def _class_body(source: str | None, cls: str) -> list[ast.stmt]:
    """The statements of class ``cls`` in ``source`` (none if either is missing)."""
    if source is None:
        return []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return node.body
    return []


def _class_members(source: str | None, cls: str) -> dict[str, list[str]]:
    """Members of ``cls``: name -> parameter names (empty for attributes)."""
    members = {}
    for item in _class_body(source, cls):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = item.args
            members[item.name] = [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members[item.target.id] = []
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    members[target.id] = []
    return members


def platform_changes(old: _Release, new: _Release, sources: dict[str, str]) -> list[str]:
    path, cls = PLATFORM
    before, after = _class_members(old.read(path), cls), _class_members(new.read(path), cls)
    overlay_text = "\n".join(sources.values())

    def overlay_defines(name: str) -> str:
        defined = re.search(rf"^\s+(?:def {name}\b|{name}\s*[:=])", overlay_text, re.M)
        return "the overlay defines it" if defined else "the overlay does not define it"

    out = [
        f"new: {name}({', '.join(after[name])}) ({overlay_defines(name)})"
        for name in sorted(after.keys() - before.keys())
    ]
    out += [f"gone: {name} ({overlay_defines(name)})" for name in sorted(before.keys() - after.keys())]
    out += [
        f"parameters changed: {name}({', '.join(before[name])}) -> ({', '.join(after[name])}) "
        f"({overlay_defines(name)})"
        for name in sorted(before.keys() & after.keys())
        if before[name] != after[name]
    ]
    return out


def config_changes(old: _Release, new: _Release, sources: dict[str, str]) -> list[str]:
    used: dict[tuple[str, str], set[str]] = {}
    for path, text in sources.items():
        for config, attr in _CONFIG_ATTR.findall(text):
            used.setdefault((config, attr), set()).add(path)
    members = {
        config: (_class_members(old.read(file), cls), _class_members(new.read(file), cls))
        for config, (file, cls) in CONFIG_CLASSES.items()
    }
    out = []
    for (config, attr), paths in sorted(used.items()):
        before, after = members[config]
        if attr in before and attr not in after:
            out.append(f"{CONFIG_CLASSES[config][1]}.{attr} (overlay: {', '.join(sorted(paths))})")
    return out


def _class_defaults(source: str | None, cls: str) -> dict[str, str]:
    """Class-level assignments of ``cls``: name -> the value's source text."""
    out = {}
    for item in _class_body(source, cls):
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value:
            out[item.target.id] = ast.unparse(item.value)
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = ast.unparse(item.value)
    return out


def default_changes(old: _Release, new: _Release, sources: dict[str, str]) -> list[str]:
    """Defaults that moved: of the attributes the overlay reads or sets, and every
    UPPER_CASE class constant (0.34's ``CacheConfig.DEFAULT_BLOCK_SIZE`` 16 -> 64 reached
    the platform through a pass that starts from it, with no attribute of the overlay's)."""
    used: dict[str, set[str]] = {}
    for text in sources.values():
        for config, attr in _CONFIG_ATTR.findall(text):
            used.setdefault(config, set()).add(attr)
    out = []
    for config, (file, cls) in CONFIG_CLASSES.items():
        before, after = _class_defaults(old.read(file), cls), _class_defaults(new.read(file), cls)
        for name in sorted(before.keys() & after.keys()):
            watched = name in used.get(config, ()) or (name.isupper() and not name.startswith("_"))
            if watched and before[name] != after[name]:
                out.append(f"{cls}.{name}: {before[name]} -> {after[name]}")
    return out


def env_changes(old: _Release, new: _Release, sources: dict[str, str]) -> list[str]:
    old_envs, new_envs = old.read("vllm/envs.py") or "", new.read("vllm/envs.py") or ""
    read: dict[str, set[str]] = {}
    for path, text in sources.items():
        for name in _ENV.findall(text):
            read.setdefault(name, set()).add(path)

    def known(source: str, name: str) -> bool:  # a key of upstream's environment_variables
        return re.search(rf'^\s*"{name}"\s*:', source, re.M) is not None

    return [
        f"{name} (overlay: {', '.join(sorted(paths))})"
        for name, paths in sorted(read.items())
        if known(old_envs, name) and not known(new_envs, name)
    ]
