"""lnstrain's import graph has no circles (docs/architecture.md, "Packages").

The graph is read from the source: every ``import`` of an lnstrain module, at module level, inside a
function or under ``TYPE_CHECKING``, is an edge; importing ``a.b.c`` also runs ``a/__init__`` and
``a/b/__init__``, so those are edges too. A circle found this way is one a reordering of imports can
turn into an ImportError, or one that only a deferred import hides.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lnstrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: from the module's package (or the package itself for __init__)
        base = module.split(".")
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in imported_names(node, module, path.name == "__init__.py"):
                while name:  # the module itself (or the package the name is in) and every package above it
                    if name in paths and name != module and not module.startswith(name + "."):
                        graph[module].add(name)
                    name = name.rpartition(".")[0]
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
                    found.append(sorted(component))
    return found


def test_the_graph_reader_sees_every_kind_of_import():
    graph = import_graph()
    assert "lnstrain.model.norm_schemes" in graph["lnstrain.model.block"]  # module level
    assert "lnstrain.data" in graph["lnstrain.training.trainer"]  # a package's __init__
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_lnstrain_imports_itself_through_others():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(circle) for circle in found)


def test_the_snapshot_memory_rule_is_in_one_place_imported_one_way():
    """The rule for a checkpoint snapshot's host memory is ``estimate/snapshot_memory.py``: the dry-run
    report and the background save both use it, and nothing in ``estimate`` reaches up into ``checkpoint``."""
    graph = import_graph()
    rule = "lnstrain.estimate.snapshot_memory"
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items() if module.startswith("lnstrain.estimate")
                    for target in targets if target.startswith("lnstrain.checkpoint"))
    assert not upward, upward
    for user in ("lnstrain.estimate.report", "lnstrain.checkpoint.async_save", "lnstrain.training.preflight",
                 "lnstrain.training.trainer"):
        assert rule in graph[user], user
    names = {"host_memory", "fits_in_host_memory", "snapshot_shortfall", "background_save_refusal",
             "MEMORY_RESERVE_FRACTION"}
    defined = sorted(f"{module_name(path)}.{node.name if hasattr(node, 'name') else node.targets[0].id}"
                     for path in PACKAGE.rglob("*.py") for node in ast.parse(path.read_text(encoding="utf-8")).body
                     if (isinstance(node, ast.FunctionDef) and node.name in names)
                     or (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                         and node.targets[0].id in names))
    assert defined == sorted(f"{rule}.{name}" for name in names), defined
