"""No import cycle among entr_megatron's modules, counting the imports made inside functions.

A function-local import hides a cycle from Python (the module is complete by the time the
function runs) but not from a reader: go-to-definition goes round in circles, and the two
modules can only be understood, tested and split together. A shared piece belongs in a third
module both import.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx

PKG = pathlib.Path(__file__).resolve().parents[2] / "entr_megatron"


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PKG) -> nx.DiGraph:
    """Module -> module it imports, for every import statement of every module below `root`
    (module level, inside functions and classes, under `if TYPE_CHECKING:` alike). `from P import
    X` is an edge to P.X when that is a module, else to P; relative imports are resolved."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                # `import a.b.c` names module a.b.c; keep the longest prefix that is one of ours
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """For each group of modules that import each other, its shortest cycle through the group's
    first module (by name), as [m, ..., m]; empty: no cycle."""
    found = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            sub, start = graph.subgraph(group), min(group)
            found.append(min(([start, *nx.shortest_path(sub, s, start)] for s in sub.successors(start)), key=len))
    return sorted(found)


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (a function-local import counts):\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_scan_sees_function_local_and_relative_imports(tmp_path):
    """A cycle held only by a function-local import, and one through a relative import, are found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from . import d\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("from pkg.sub import b\n")  # into a cycle, not part of one
    graph = import_graph(pkg)
    assert set(graph.edges) == {("pkg.a", "pkg.sub.b"), ("pkg.sub.b", "pkg.a"), ("pkg.c", "pkg.d"),
                                ("pkg.d", "pkg.c"), ("pkg.e", "pkg.sub.b")}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]
