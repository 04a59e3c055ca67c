"""The floors of the project, read from its source with ``ast`` (nothing is imported): which
project module imports which, checked against the rules below, and no import cycle, neither at
module level nor through the imports inside functions.

Tier: unit (tests/conftest.py).
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Rule(NamedTuple):
    who: str  # the importing modules: this module and everything under it
    forbidden: tuple[str, ...]  # module prefixes it must not import; "*" is every project module
    allowed: tuple[str, ...]  # prefixes exempt from ``forbidden``
    why: str


# Every import counts, at module level or inside a function (a lazy import is still an arrow).
RULES = (
    #    who               must not import                 unless                  because
    Rule("models",         ("components",),                (),                     "models must not import the trainer's components"),
    Rule("models",         ("parallelisms",),              (),                     "models must not import their parallelization"),
    Rule("models",         ("train", "bench", "scripts"),  (),                     "models must not import what runs them"),
    Rule("kernels",        ("*",),                         ("kernels",),           "kernels import nothing above them"),
    Rule("kernels.common", ("kernels.moe", "kernels.fp8"), (),                     "the kernels' ground floor imports neither kernel folder"),
    Rule("kernels.fp8",    ("kernels.moe",),               (),                     "FP8 building blocks must not import the MoE backends"),
    Rule("parallelisms",   ("components",),                ("components.config",), "parallelisms import only the typed config from components"),
)

# Not project modules: the tests themselves, and what is not source.
SKIP_DIRS = {"tests", "assets", "docs", "train_configs"}


class Import(NamedTuple):
    importer: str  # dotted module name of the importing file
    path: str  # that file, relative to the root
    line: int
    target: str  # the project module imported
    scope: str  # "module" (runs on import), "function" (runs when called), "typing" (TYPE_CHECKING only)


def _under(module: str, prefix: str) -> bool:
    return prefix == "*" or module == prefix or module.startswith(prefix + ".")


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every project module: the top-level ``*.py`` files and every folder
    of source below the root, but for :data:`SKIP_DIRS` and hidden or virtual-environment folders."""
    modules = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (d in SKIP_DIRS and Path(folder) == root or d.startswith(".")
                                                  or d.endswith(".egg-info") or d == "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            parts = (Path(folder, name).relative_to(root)).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(folder, name)
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` names, or the longest project module it lies in (an attribute
    path); None outside the project."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, path: Path, root: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module in ``path``, with its line and scope. ``from x import y``
    names module ``x.y`` when that is a project module, else ``x``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    rel = path.relative_to(root).as_posix()
    found: list[Import] = []

    def visit(nodes, scope: str) -> None:
        for child in nodes:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(ast.iter_child_nodes(child), "function" if scope == "module" else scope)
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child.body, "typing" if scope == "module" else scope)
                visit(child.orelse, scope)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".") if package else []
                    base = ".".join([*parts[:len(parts) - child.level + 1], *([base] if base else [])])
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in child.names]
            targets = {_resolve(name, modules) for name in names} - {None, module}
            found.extend(Import(module, rel, child.lineno, target, scope) for target in sorted(targets))
            visit(ast.iter_child_nodes(child), scope)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body, "module")
    return found


@functools.cache
def import_graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Import]]:
    modules = project_modules(root)
    return modules, [imp for name, path in modules.items() for imp in imports_of(name, path, root, modules)]


def violations(rule: Rule, imports: list[Import]) -> list[str]:
    return [f"{imp.path}:{imp.line} imports {imp.target}: {rule.why}" for imp in imports
            if _under(imp.importer, rule.who) and not any(_under(imp.target, a) for a in rule.allowed)
            and any(_under(imp.target, f) for f in rule.forbidden)]


def module_cycles(imports: list[Import], scopes: tuple[str, ...] = ("module",)) -> list[list[Import]]:
    """One cycle of the imports of ``scopes`` through each strongly connected group of modules that
    has one, as its arrows in order."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in sorted(imports, key=lambda i: i.scope != "module"):  # name a module-level arrow where there is one
        if imp.scope in scopes:
            edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    # Tarjan's strongly connected components, iteratively.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    cycles = []
    for group in groups:
        # The shortest way back to the group's first module, by breadth-first search inside the group.
        members, first = set(group), group[0]
        came_from: dict[str, Import] = {}
        frontier = [first]
        while first not in came_from:
            nxt = []
            for node in frontier:
                for target, imp in sorted(edges.get(node, {}).items()):
                    if target in members and target not in came_from:
                        came_from[target] = imp
                        nxt.append(target)
            frontier = nxt
        path, node = [], first
        while True:
            imp = came_from[node]
            path.append(imp)
            node = imp.importer
            if node == first:
                break
        cycles.append(path[::-1])
    return cycles


def _describe_cycle(cycle: list[Import]) -> str:
    arrows = " -> ".join(f"{imp.importer} ({imp.path}:{imp.line}{', in a function' * (imp.scope == 'function')})"
                         for imp in cycle)
    return f"import cycle: {arrows} -> {cycle[0].importer}"


# --- the project ------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=[f"{r.who}-{'-'.join(r.forbidden)}" for r in RULES])
def test_import_rule(rule):
    modules, imports = import_graph()
    assert any(_under(m, rule.who) for m in modules), (
        f"no project module is {rule.who} or under it: the rule '{rule.why}' guards nothing; update RULES")
    found = violations(rule, imports)
    assert not found, "\n".join(found)


# Module level: a cycle there makes the import order matter. With functions' imports as well: a
# lazy import back is still two modules that cannot be read or moved one without the other.
@pytest.mark.parametrize("scopes", [("module",), ("module", "function")], ids=["module_level", "with_lazy"])
def test_no_import_cycle(scopes):
    _, imports = import_graph()
    cycles = module_cycles(imports, scopes)
    assert not cycles, "\n".join(_describe_cycle(c) for c in cycles)


# --- the checker itself, on a made-up tree ---------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_checker_sees_lazy_submodule_and_relative_imports(tmp_path):
    _tree(tmp_path, {
        "train.py": "import models.model\n",
        "models/__init__.py": "",
        "models/model.py": "from kernels import ops\n\ndef f():\n    from components.config import X\n",
        "kernels/__init__.py": "",
        "kernels/ops.py": "from . import base\nfrom .base import helper\n",
        "kernels/base.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kernels.ops\n",
        "components/__init__.py": "",
        "components/config.py": "import torch\n",
        "tests/test_x.py": "import models.model\n",
        ".venv/lib.py": "import models.model\n",
    })
    modules, imports = import_graph(tmp_path)
    assert sorted(modules) == ["components", "components.config", "kernels", "kernels.base", "kernels.ops",
                               "models", "models.model", "train"]
    assert sorted((i.importer, i.target, i.line, i.scope) for i in imports) == [
        ("kernels.base", "kernels.ops", 3, "typing"),
        ("kernels.ops", "kernels.base", 1, "module"),
        ("kernels.ops", "kernels.base", 2, "module"),
        ("models.model", "components.config", 4, "function"),
        ("models.model", "kernels.ops", 1, "module"),
        ("train", "models.model", 1, "module")]
    assert violations(RULES[0], imports) == [
        "models/model.py:4 imports components.config: models must not import the trainer's components"]
    assert module_cycles(imports) == []  # the TYPE_CHECKING arrow back runs at no import


def test_checker_names_a_cycle_with_its_lines(tmp_path):
    _tree(tmp_path, {
        "components/__init__.py": "",
        "components/a.py": "import torch\nfrom components.b import g\n",
        "components/b.py": "from components import c\n",
        "components/c.py": "import components.a\n",
        "components/d.py": "import components.e\n",
        "components/e.py": "import torch\n\ndef f():\n    import components.d\n",
    })
    _, imports = import_graph(tmp_path)
    (cycle,) = module_cycles(imports)
    assert _describe_cycle(cycle) == ("import cycle: components.a (components/a.py:2) -> components.b "
                                      "(components/b.py:1) -> components.c (components/c.py:1) -> components.a")
    _, lazy = module_cycles(imports, ("module", "function"))
    assert _describe_cycle(lazy) == ("import cycle: components.d (components/d.py:1) -> components.e "
                                     "(components/e.py:4, in a function) -> components.d")
