"""The project's layers import downward only, counting imports made inside functions (read with `ast`,
nothing imported): storage <- components <- flows, and inside flows/ its rooms in the order
config <- runtime <- training <- tools. No module is part of an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("storage", "components", "flows")
RANKS = ("storage", "components", "flows", "flows.config", "flows.runtime", "flows.training", "flows.tools")
"""Each may import only those before it (and itself); a module takes the rank of its longest prefix here."""


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file), for every module of the layers."""
    modules = {_module_name(path, root): path for layer in LAYERS for path in (root / layer).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level-1 packages
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def rank(module: str) -> int:
    return max(index for index, prefix in enumerate(RANKS) if module == prefix or module.startswith(prefix + "."))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {target}" for module, targets in graph.items() for target in targets
                  if rank(target) > rank(module))


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_layer_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


LAZY_PROJECT_IMPORTS = {
    "flows.tools.cli": "the flow's and the worker's modules (transformers, Prefect's engine) load in the commands "
                       "that run them, after the config is checked; the parser's modules are at the top",
    "flows.tools.compare": "tracking imports mlflow, needed only when the command runs",
    "flows.tools.submit": "the flow's config resolution imports transformers and the stages, needed only when the "
                          "command runs",
    "flows.training.registry": "the Prefect task wrapper: the registry stays importable without Prefect",
}


def function_level_project_imports(root: Path = ROOT) -> list[str]:
    found = []
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            module = _module_name(path, root)
            for function in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    target = (node.module or "") if isinstance(node, ast.ImportFrom) else \
                        node.names[0].name if isinstance(node, ast.Import) else None
                    if target is not None and target.split(".")[0] in LAYERS and module not in LAZY_PROJECT_IMPORTS:
                        found.append(f"{module}.{function.name} imports {target}")
    return found


def test_project_modules_are_imported_at_the_top():
    """Imports inside functions hide the dependency graph; only the listed modules keep some, for a reason."""
    assert function_level_project_imports() == []


def test_the_checks_find_what_they_look_for(tmp_path):
    for layer in ("storage", "components", "flows"):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "__init__.py").write_text("")
    (tmp_path / "storage" / "a.py").write_text("def f():\n    from components import b\n")
    (tmp_path / "components" / "b.py").write_text("from components import c\n")
    (tmp_path / "components" / "c.py").write_text("from . import b\n")
    for room in ("runtime", "training"):
        (tmp_path / "flows" / room).mkdir()
        (tmp_path / "flows" / room / "__init__.py").write_text("")
    (tmp_path / "flows" / "runtime" / "d.py").write_text("def f():\n    from flows.training import e\n")
    (tmp_path / "flows" / "training" / "e.py").write_text("from flows.runtime import d\n")
    graph = import_graph(tmp_path)
    assert function_level_project_imports(tmp_path) == ["storage.a.f imports components",
                                                        "flows.runtime.d.f imports flows.training"]
    assert upward_imports(graph) == ["flows.runtime.d imports flows.training", "flows.runtime.d imports flows.training.e",
                                     "storage.a imports components", "storage.a imports components.b"]
    assert sorted(map(sorted, cycles(graph))) == [["components.b", "components.c"],
                                                  ["flows.runtime.d", "flows.training.e"]]
