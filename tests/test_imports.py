"""No import cycles among tokenmill's modules.

The graph is read from the source with `ast`, not by importing: an edge for every `import` and
`from ... import` that names a tokenmill module, at module level or inside a function (a
function-level import only postpones the cycle to the first call), relative imports resolved.
Each import counts as the most specific module it names: `from tokenmill.bench import peers` is
an edge to `tokenmill.bench.peers`, `from tokenmill import LLM` one to `tokenmill` (its
__init__.py). The parent packages Python imports on the way are not edges: every module has them,
and a package whose __init__ imports its own submodules would be a cycle with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tokenmill"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package` (a package is its __init__.py)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _named(name: str, modules: dict[str, Path]) -> str | None:
    """The most specific module of `modules` that the dotted `name` names (a.b.func -> a.b), if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `module`'s file imports, anywhere in the file."""
    # A relative import counts from the importing module's package (a package's __init__ is its own).
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # `from ..x import y` in a.b.c: a.x
                base = ".".join([*package[:len(package) - node.level + 1], *([base] if base else [])])
            # `from a import b`: b is a submodule (a.b) or a name defined in a
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m for m in (_named(n, modules) for n in names) if m is not None and m != module}
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (depth-first search; a module met again while
    it is still on the search path closes a cycle)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (cycle := visit(nxt)):
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (cycle := visit(node)):
            return cycle
    return None


def test_tokenmill_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "tokenmill.bench.compare" in graph and "tokenmill.bench.peers" in graph["tokenmill.bench.compare"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_relative_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.sub import a\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("import os\nfrom pkg.sub.b import helper\n")
    (package / "sub" / "b.py").write_text("def helper():\n    from . import a\n    from .. import sub\n")
    graph = import_graph(package)
    assert graph == {"pkg": {"pkg.sub.a"}, "pkg.sub": set(), "pkg.sub.a": {"pkg.sub.b"},
                     "pkg.sub.b": {"pkg.sub.a", "pkg.sub"}}
    assert find_cycle(graph) == ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]
    (package / "sub" / "b.py").write_text("def helper():\n    from .. import sub\n")
    assert find_cycle(import_graph(package)) is None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        for nxt in graph[node] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_server_does_not_depend_on_the_offline_llm_class():
    """The server and the offline LLM share the engine's input / output processors; neither is
    built on the other (tokenmill.llm is reachable from no server module, nor from the engine)."""
    graph = import_graph(PACKAGE)
    for module in graph:
        if module.startswith(("tokenmill.server", "tokenmill.engine")):
            assert "tokenmill.llm" not in reachable(graph, module), module
