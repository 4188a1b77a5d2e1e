"""The package's imports run one way: no module of ``panther_lite`` imports, directly or through
others, a module that imports it back (read from the source with ``ast``, imports inside
functions included, so a hidden in-function import cannot close a circle)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parents[1] / "panther_lite"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> Dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that module ``name`` (file ``path``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c: the deepest module of the package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> Dict[str, Set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_reads_the_package():
    graph = import_graph()
    assert "panther_lite.conversion.workflows.convert" in graph["panther_lite.conversion"]
    assert "panther_lite.conversion.records" in graph["panther_lite.conversion.kinds.base"]


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles (each: modules importing each other): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_a_new_circle_is_caught():
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph["panther_lite.conversion.records"].add("panther_lite.conversion.kinds.base")
    assert any("panther_lite.conversion.records" in component for component in circles(graph))


def test_the_layers_need_torch_alone():
    """``panther_lite.nn`` and ``panther_lite.sketch`` import nothing of the package above them."""
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith(("panther_lite.nn", "panther_lite.sketch")):
            above = {t for t in targets if not t.startswith(("panther_lite.nn", "panther_lite.sketch"))}
            assert above <= {"panther_lite.extras"}, (name, above)


def test_a_module_tests_are_found_by_its_path():
    """``tests/`` mirrors the package: a test file named after a module (``test_<module>.py``) lies
    at that module's path (``panther_lite/a/b.py`` → ``tests/a/test_b.py``)."""
    tests = PACKAGE.parent / "tests"
    stems = {path.stem for path in PACKAGE.rglob("*.py")}
    misplaced = []
    for path in sorted(tests.rglob("test_*.py")):
        place, name = PACKAGE / path.parent.relative_to(tests), path.stem[len("test_"):]
        if name in stems and not ((place / f"{name}.py").is_file() or (place / name / "__init__.py").is_file()):
            misplaced.append(str(path.relative_to(tests)))
    assert not misplaced, f"test files named after a module but not at its path: {misplaced}"
