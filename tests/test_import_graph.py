"""The package's modules, and the recipes' modules, import each other without a cycle, counting
the imports inside functions (a deferred import hides a cycle; it does not remove it) and those
under ``TYPE_CHECKING`` aside (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import bsloss

PACKAGE = Path(bsloss.__file__).parent
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_blocks(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph(folder: Path = PACKAGE, root: Path = PACKAGE.parent) -> dict[str, set[str]]:
    """Module -> the modules of ``folder`` it imports, named from ``root`` (``from bsloss.x
    import y`` counts ``bsloss.x``, and ``bsloss.x.y`` when that is a module; the package root
    is left out: it only re-exports)."""
    modules = {_module_name(p, root): p for p in folder.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_blocks(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skipped:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t not in ("bsloss", name)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "bsloss.metric" in graph["bsloss.baseline_estimation"]
    assert "bsloss.scorer.encoder" in graph["bsloss.loss"]
    assert "bsloss.metric" not in graph["bsloss.plot"]  # a TYPE_CHECKING import only


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_import_cycle_among_the_recipes():
    graph = import_graph(RECIPES, RECIPES)
    assert {"generators", "examples", "config"} <= graph["run"] | graph["generators"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
