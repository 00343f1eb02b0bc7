"""The layer rules of docs/ARCHITECTURE.md ("Layers"), checked on the source: every import of
`rlpipe.*` (top-level, inside a function, under TYPE_CHECKING alike) points down the layer table,
the module graph has no circle, Prefect is imported only in flows/ and tasks/, and core/ imports
nothing of rlpipe.

The checks are plain functions over parsed files, so the last tests can show that they catch a
breach on a small made-up tree."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "flows", "tasks", "rollouts", "envs", "engines", "training", "models", "storage", "dashboards")
# What each layer may import besides itself and core/ (core/ imports nothing of rlpipe).
ALLOWED: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "flows": frozenset(LAYERS) - {"flows"},
    "tasks": frozenset({"rollouts", "envs", "engines", "training", "models", "storage"}),
    "rollouts": frozenset({"envs", "engines", "training", "models", "storage"}),
    "envs": frozenset({"engines", "models", "storage"}),
    "engines": frozenset({"training", "models", "storage"}),
    "training": frozenset({"models"}),
    "models": frozenset(),
    "storage": frozenset(),
    "dashboards": frozenset({"storage"}),
}
PREFECT_LAYERS = frozenset({"flows", "tasks"})


@dataclass(frozen=True)
class Import:
    """One import statement's target, as found in a source file."""

    source: str  # the importing module, e.g. rlpipe.rollouts.generation
    path: Path  # its file, relative to the repository root
    line: int
    target: str  # the imported module, e.g. rlpipe.envs.base (or prefect.flows)


def layer_of(module: str) -> str:
    """`rlpipe.<layer>.<...>` -> layer."""
    return module.split(".")[1]


def module_files(root: Path, layers: Iterable[str] = LAYERS) -> dict[str, Path]:
    """Every module of the layer folders under `root`: dotted name -> file (relative to root)."""
    found = {}
    for layer in layers:
        for file in sorted((root / layer).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(("rlpipe", *parts))] = file.relative_to(root)
    return found


def imports_of(source: str, path: Path, tree: ast.AST, modules: Iterable[str]) -> Iterator[Import]:
    """Every module `tree` imports, wherever the statement sits. `from a.b import c` names the
    module a.b.c when that is one of `modules`, else a.b; a relative import is resolved against
    `source`'s package."""
    known = set(modules)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source, path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = (f"{base}.{alias.name}" for alias in node.names)
            for target in dict.fromkeys(t if t in known else base for t in targets):
                yield Import(source, path, node.lineno, target)


def collect(root: Path = ROOT, layers: Iterable[str] = LAYERS) -> tuple[dict[str, Path], list[Import]]:
    """The modules of the layer folders and every import they hold."""
    modules = module_files(root, layers)
    found: list[Import] = []
    for name, path in modules.items():
        tree = ast.parse((root / path).read_text(encoding="utf-8"), filename=str(path))
        found.extend(imports_of(name, path, tree, modules))
    return modules, found


def is_rlpipe(module: str) -> bool:
    """Whether `module` is one of ours."""
    return module == "rlpipe" or module.startswith("rlpipe.")


def layer_breaches(found: Iterable[Import]) -> list[str]:
    """One message per import of rlpipe that the layer table forbids."""
    out = []
    for imp in found:
        if not is_rlpipe(imp.target):
            continue
        have, want = layer_of(imp.source), (layer_of(imp.target) if "." in imp.target else "rlpipe")
        if have == "core":
            ok = False
            rule = "core/ imports nothing of rlpipe"
        else:
            ok = want in (have, "core") or want in ALLOWED[have]
            allowed = ", ".join(sorted({have, "core", *ALLOWED[have]}))
            rule = f"{have}/ may import {allowed}"
        if not ok:
            out.append(f"{imp.path}:{imp.line}: imports {imp.target} ({want}/), but {rule}")
    return sorted(out)


def prefect_breaches(found: Iterable[Import]) -> list[str]:
    """One message per import of Prefect outside flows/ and tasks/."""
    return [
        f"{imp.path}:{imp.line}: imports {imp.target}, but Prefect is imported only in flows/ and tasks/"
        for imp in found
        if (imp.target == "prefect" or imp.target.startswith("prefect."))
        and layer_of(imp.source) not in PREFECT_LAYERS
    ]


def module_graph(modules: Iterable[str], found: Iterable[Import]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (itself excluded)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in found:
        if imp.target in graph and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def describe_circle(component: list[str], graph: dict[str, set[str]], files: dict[str, Path]) -> str:
    """A circle and the imports inside it that close it."""
    members = set(component)
    arrows = [f"{files[a]} -> {b}" for a in component for b in sorted(graph[a] & members)]
    return f"circle of {len(component)}: " + ", ".join(component) + "\n    " + "\n    ".join(arrows)


# ----------------------------------------------------------------------------- the rules, on rlpipe


def test_the_layer_folders_are_all_scanned():
    modules, found = collect()
    assert set(LAYERS) == set(ALLOWED)
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages == set(LAYERS), "a new layer folder gets its row in LAYERS and ALLOWED"
    assert {layer_of(m) for m in modules} == set(LAYERS), "every layer folder holds modules"
    assert sum(is_rlpipe(i.target) for i in found) > 100, "the scan finds the imports"


def test_every_import_points_down_the_layers():
    _, found = collect()
    breaches = layer_breaches(found)
    assert not breaches, "imports against the layer table (docs/ARCHITECTURE.md, Layers):\n" + "\n".join(breaches)


def test_no_import_circles():
    modules, found = collect()
    graph = module_graph(modules, found)
    found_circles = circles(graph)
    assert not found_circles, "import circles:\n" + "\n".join(describe_circle(c, graph, modules) for c in found_circles)


def test_prefect_is_imported_only_in_flows_and_tasks():
    _, found = collect()
    breaches = prefect_breaches(found)
    assert not breaches, "\n".join(breaches)


def test_core_imports_nothing_of_rlpipe():
    _, found = collect(layers=("core",))
    ours = [f"{i.path}:{i.line}: {i.target}" for i in found if is_rlpipe(i.target)]
    assert not ours, "core/ is the ground level:\n" + "\n".join(ours)


# ----------------------------------------------------------------------------- the checks catch breaches


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_an_upward_import_inside_a_function_is_named_with_its_file_line_and_rule(tmp_path):
    _tree(tmp_path, {
        "training/__init__.py": "",
        "training/step.py": "import torch\n\ndef f():\n    from rlpipe.storage.layout import x\n",
        "storage/__init__.py": "",
        "storage/layout.py": "x = 1\n",
        "core/__init__.py": "",
        "core/files.py": "from rlpipe.models import loading\n",
        "models/__init__.py": "",
        "models/loading.py": "",
    })
    _, found = collect(tmp_path, ("training", "storage", "core", "models"))
    assert layer_breaches(found) == [
        "core/files.py:1: imports rlpipe.models.loading (models/), but core/ imports nothing of rlpipe",
        "training/step.py:4: imports rlpipe.storage.layout (storage/), but training/ may import core, models, training",
    ]


def test_a_circle_through_a_from_import_of_a_module_is_found(tmp_path):
    _tree(tmp_path, {
        "envs/__init__.py": "",
        "envs/base.py": "def build():\n    from rlpipe.envs import arithmetic\n",
        "envs/arithmetic.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlpipe.envs.base import Env\n",
        "envs/rewards.py": "from rlpipe.envs.base import Env\n",
    })
    modules, found = collect(tmp_path, ("envs",))
    assert circles(module_graph(modules, found)) == [["rlpipe.envs.arithmetic", "rlpipe.envs.base"]]


def test_prefect_outside_flows_and_tasks_is_named(tmp_path):
    _tree(tmp_path, {
        "tasks/__init__.py": "",
        "tasks/a.py": "from prefect import task\n",
        "storage/__init__.py": "",
        "storage/b.py": "def f():\n    import prefect.context\n",
    })
    _, found = collect(tmp_path, ("tasks", "storage"))
    assert prefect_breaches(found) == [
        "storage/b.py:2: imports prefect.context, but Prefect is imported only in flows/ and tasks/"
    ]
